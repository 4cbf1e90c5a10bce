"""Activation checkpointing, applied per transformer block (``[activation_checkpoint]``).

Modes:
    none       keep every activation.
    full       every block recomputes its forward in backward.
    selective  every ``selective_every``-th block recomputes (layers 0, N, 2N, ...: the
               cheapest trade of memory for compute at a chosen ratio).
    op         every block, per-op selective: outputs of matmuls, grouped GEMMs, attention
               kernels and all-to-alls are saved; cheap pointwise ops, norms and the rest are
               recomputed. Saving the all-to-all outputs means expert-parallel communication
               is never repeated in backward.
    modules    every block, by part (DeepSeek-V3's selective recompute, named as Megatron-LM's
               ``recompute_modules``): every op of the named parts is recomputed, matmuls and
               attention included (``_PARTS`` says which ops each name covers); elsewhere op's rule,
               but the norms' and the experts' activation outputs are kept unless named.

``checkpoint_wrapper`` keeps state-dict names unchanged (it strips its own prefix), so
checkpoints are interchangeable across modes.

A recomputation records nothing: the statistics a block's forward adds into (the MoE's routed-token
counts behind the bias update and ``moe_imbalance``, Engram's gate sums, QK-clip's max logits:
``models.common.forward_stats``) are put back as they were when it ends, so every micro-batch
counts once whatever the schedule recomputes. Counting on would not: a zero-bubble schedule's
split backward recomputes a block in its input pass and again in its weight pass (torch's own
weight pass once per parameter group; the trainer's once, trainer/parallel/pipeline_step.py
`weight_pass`), DualPipeV gives some micro-batches a split backward and others a full one, and the
bias update then moves the wrong experts. The put-back runs in the checkpoint's recompute context, around the block's
call, so it holds for a compiled block too (its graph adds, eagerly restored after it).

A block is recomputed as often as its backward is split: ``op`` replays the saved outputs of its
per-op policy on every recomputation (torch's selective checkpoint hands each one out once and
refuses a second backward), so a zero-bubble schedule's weight pass sees the same values as its
input pass. The saved outputs then live until the block's autograd graph is freed (after
the weight pass) rather than until the first recomputation takes them: never longer than a run
without checkpointing keeps the same tensors.
"""

from __future__ import annotations

import functools
import typing

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from models.common.forward_stats import forward_statistics
from trainer.config.activation_checkpoint import CHEAP_PARTS, ACMode, ActivationCheckpoint, recompute_module_set

AC_MODES = typing.get_args(ACMode)


def _save_list() -> set:
    ops = [
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._grouped_mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops._c10d_functional_autograd.all_to_all_single.default,  # in torch 2.11 and 2.13
    ]
    # Kernels that exist only in some builds.
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"):
        if hasattr(torch.ops.aten, name):
            ops.append(getattr(torch.ops.aten, name).default)
    return set(ops)


def _op_policy(save: set, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE


_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,
}


def _is_attention(func) -> bool:
    return "scaled_dot_product" in func.__name__ or "flex_attention" in func.__name__


def _is_exchange(func) -> bool:
    return func.__name__.startswith("all_to_all")


def _is_view(func) -> bool:
    return any(ret.alias_info is not None for ret in func._schema.returns)


# Ops whose output depends on no input's values: free to recompute, and often filled in place
# afterwards (the router's ``scatter_`` into ``zeros_like``), which a saved output must not be.
_FACTORIES = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones",
    "ones_like",
    "new_ones",
    "full",
    "full_like",
    "new_full",
    "arange",
    "scalar_tensor",
}


# What each ``recompute_modules`` name recomputes, by the module an op runs in (its path inside the
# block, outermost first, with the module classes) and the op. Megatron-LM's meanings, on this
# model's names (``wq_b``, ``wkv_b``, ``experts`` ... as in DeepSeek's reference code):
#   layernorm       every RMSNorm of the block (attention, FFN, MLA's q_norm / kv_norm, Engram's);
#   mla_up_proj     the per-head query / key / value built from MLA's latents: q_norm, wq_b, kv_norm,
#                   wkv_b and MLA's own rope, concatenations and padding, all but the attention kernel;
#   core_attn       the attention kernel (its inputs saved, its output and logsumexp recomputed);
#   moe_act         the routed experts' SwiGLU activation (silu and the product; their GEMMs saved);
#   mlp             a dense block's FFN; shared_experts: the MoE's shared experts;
#   moe             the whole MoE layer but its all-to-alls (expert-parallel traffic is never repeated).
_PARTS = {
    "layernorm": lambda paths, classes, func, moe: any(issubclass(c, nn.RMSNorm) for c in classes),
    "mla_up_proj": lambda paths, classes, func, moe: (
        paths[-1] in ("attn.q_norm", "attn.wq_b", "attn.kv_norm", "attn.wkv_b")
        or (paths[-1] == "attn" and not _is_attention(func))
    ),
    "core_attn": lambda paths, classes, func, moe: paths[-1] == "attn" and _is_attention(func),
    "moe_act": lambda paths, classes, func, moe: "ffn.experts" in paths and func not in _MATMULS,
    "mlp": lambda paths, classes, func, moe: not moe and "ffn" in paths,
    "shared_experts": lambda paths, classes, func, moe: "ffn.shared_experts" in paths,
    "moe": lambda paths, classes, func, moe: moe and "ffn" in paths and not _is_exchange(func),
}

_REDUCTIONS = {"mean", "sum", "amax", "max", "min"}


def _relative(path: str, known: tuple[str, ...]) -> str:
    """``path`` (a compiled graph's module path: ``L['self']._checkpoint_wrapped_module.attn.wq_b``
    or the like) as the block-relative name it ends with, longest first; "" for the block itself."""
    path = path.replace("['", ".").replace("']", "")
    return next((name for name in known if path.endswith("." + name)), "")


class _PartTracker:
    """Which of a block's modules is running, for the ``modules`` policy. Eagerly, forward hooks
    on the block's submodules keep the stack; compiled, the graph being traced says (its node's
    ``nn_module_stack``), and the hooks step aside so they add nothing to the graph."""

    def __init__(self, block: nn.Module, parts: tuple[str, ...]):
        self.parts = parts
        self.save = _save_list()
        self.moe = bool(getattr(block, "moe_enabled", False))
        named = [(name, module) for name, module in block.named_modules() if name]
        self.known = tuple(sorted((name for name, _ in named), key=len, reverse=True))
        self.stack: list[tuple[str, type]] = []
        for name, module in named:
            module.register_forward_pre_hook(functools.partial(self._enter, name, type(module)))
            module.register_forward_hook(functools.partial(self._leave, name), always_call=True)

    def _enter(self, name: str, cls: type, module, args) -> None:
        if not torch.compiler.is_compiling():
            self.stack.append((name, cls))

    def _leave(self, name: str, module, args, output) -> None:
        if not torch.compiler.is_compiling() and self.stack and self.stack[-1][0] == name:
            self.stack.pop()

    def _current(self) -> list[tuple[str, type]]:
        if fx_traceback.has_preserved_node_meta():
            modules = fx_traceback.get_current_meta().get("nn_module_stack") or {}
            return [(_relative(path, self.known), cls) for path, cls in modules.values()]
        return self.stack

    def policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        """Recompute every op of the chosen parts. Elsewhere ``op``'s rule: keep the outputs of
        matmuls, attention kernels and all-to-alls, recompute the cheap ops between them (an
        output kept that no backward reads, a residual sum, a gather of routed rows, would cost
        memory that no checkpointing does not), but for the cheap parts not chosen (the norms,
        the experts' activation), whose results are kept as without checkpointing (their
        reductions aside: the norm adds its epsilon in place). In-place and out= ops (the
        statistics' adds), factories and views are always recomputed: a kept output could not
        replay them, and a kept view of a parameter would pin its version."""
        if func._schema.is_mutable or func.overloadpacket.__name__ in _FACTORIES or _is_view(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        current = self._current()
        where = ([path for path, _ in current] or [""], [cls for _, cls in current], func, self.moe)
        if any(_PARTS[part](*where) for part in self.parts):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in self.save or (
            any(_PARTS[part](*where) for part in CHEAP_PARTS if part not in self.parts)
            and func.overloadpacket.__name__ not in _REDUCTIONS
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


class _SkipProfilerOps(TorchDispatchMode):
    """Sits right above a per-op SAC mode and runs profiler annotations past it.

    SAC replays by counting each op's calls, and must see the same calls in forward and in
    recompute. FSDP2 hooks of a unit *inside* the checkpointed block (the routed experts' own
    unit under EP on torch < 2.13, trainer/parallel/fsdp.py) annotate with ``record_function``
    a different number of times in recompute (there ``FSDP::root_pre_forward`` also runs), which
    SAC rejects, though annotations compute nothing. PyTorch has the same bypass in review upstream; until a release carries it, this
    keeps the two counts equal by hiding annotations from SAC.
    """

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            with _pop_mode_temporarily():  # the SAC mode right below this one
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Modes:
    """Dispatch modes entered in order and left in reverse, as often as the checkpoint asks: a
    recompute context is entered once per backward that needs the block (module docstring), which
    a generator's one-shot context manager cannot be."""

    def __init__(self, *modes: TorchDispatchMode):
        self.modes = modes

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        return False


class _Recomputation(_Modes):
    """The recompute context of one checkpointed call of ``block``: each recomputation leaves the
    block's statistics as it found them and, under ``op`` (``modes``: torch's replaying mode and
    the profiler bypass above it), replays every saved output of the forward."""

    def __init__(self, block: nn.Module, *modes: TorchDispatchMode):
        super().__init__(*modes)
        self.block = block
        self.saved_outputs: dict | None = None
        self.stats: list[torch.Tensor] = []
        self.before: list[torch.Tensor] = []

    def __enter__(self):
        self.stats = forward_statistics(self.block)
        with torch.no_grad():
            self.before = [t.clone() for t in self.stats]
        if self.modes:
            # The replaying mode marks each saved output consumed as it hands it out: give every
            # pass the forward's entries.
            storage = self.modes[0].storage
            if self.saved_outputs is None:
                self.saved_outputs = {key: dict(entries) for key, entries in storage.items()}
            storage.update({key: dict(entries) for key, entries in self.saved_outputs.items()})
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        with torch.no_grad():
            for stat, before in zip(self.stats, self.before):
                stat.copy_(before)
        self.stats, self.before = [], []
        return False


def _contexts(block: nn.Module, policy) -> tuple[_Modes, _Recomputation]:
    """``context_fn`` of ``block``'s checkpoint, called at each forward: (forward context,
    recompute context). ``policy``: the per-op policy of ``op`` / ``modules``, None under ``full``."""
    if policy is None:
        return _Modes(), _Recomputation(block)
    caching, cached = create_selective_checkpoint_contexts(policy)
    return _Modes(caching, _SkipProfilerOps()), _Recomputation(block, cached, _SkipProfilerOps())


def apply_activation_checkpointing(
    model: nn.Module, mode: str, selective_every: int = 1, recompute_modules: typing.Sequence[str] = ("deepseek",)
) -> int:
    """Wraps blocks of ``model.layers`` (and ``model.mtp``) in place; returns how many.
    ``recompute_modules``: ``modules`` mode's parts (names or sets, trainer/config/schema.py)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return 0
    # Benchmarks call this without a config: the section's own checks are the one validator.
    section = ActivationCheckpoint(
        mode=mode, selective_every=selective_every, recompute_modules=list(recompute_modules)
    )
    if problems := section.problems():
        raise ValueError(" ".join(problems))
    parts = recompute_module_set(recompute_modules)

    def wrap(block: nn.Module) -> nn.Module:
        if mode == "op":
            policy = functools.partial(_op_policy, _save_list())
        elif mode == "modules":
            policy = _PartTracker(block, parts).policy
        else:
            policy = None
        context_fn = functools.partial(_contexts, block, policy)
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)

    wrapped = 0
    for index, (name, block) in enumerate(list(model.layers.items())):
        if mode == "selective" and index % selective_every:
            continue
        model.layers[name] = wrap(block)
        wrapped += 1
    mtp = getattr(model, "mtp", None)
    if mtp is not None and mode != "selective":
        for module in mtp:
            module.block = wrap(module.block)
            wrapped += 1
    return wrapped
