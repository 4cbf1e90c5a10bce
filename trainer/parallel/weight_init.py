"""Layout-invariant weight initialisation: one seed, the same initial weights in every layout.

The model's own ``init_weights`` keeps defining *which* distribution each parameter gets
(models/: std per projection, ones for norms, ...). What it cannot know is the layout: under
FSDP / TP / EP / HSDP a parameter is a DTensor whose local shard is only part of the tensor, and
the default generator would draw the shard's values as if it were the whole tensor (repeating
values across shards, and differing from one process). So every random fill of a parameter
(``nn.init.normal_`` / ``uniform_`` / ``trunc_normal_`` and the tensor methods ``normal_`` /
``uniform_``) is replaced, for the duration of ``init_model_weights``, by one rule:

    the full tensor's values are drawn block of rows by block of rows (dim 0), block ``b``
    from its own generator seeded by ``hash(seed, parameter FQN, n-th draw of it, b)``.

A rank generates only the blocks that hold its rows (and keeps its columns of them), so a
sharded parameter never exists in full on one rank. The truncated normal redraws its rejected
values from the block's generator too (torch's own redraws into fresh tensors from the global
generator). The blocks are cut the same way in every layout, so the values only depend on the
seed, the parameter's global name and shape: 1 process, FSDP, HSDP, EP, TP and CP runs start from
the same weights. Draws run on the parameter's device (on CUDA the device's generator): layouts
agree on one kind of device; CPU and CUDA draws differ. Other random ``nn.init`` fills
(kaiming, xavier, ...) on a parameter are refused rather than drawn unkeyed.

Deterministic fills (ones, zeros) need no rule. Engram tables draw their rows from their own
seeded row blocks (models/engram/table.py), which is already layout-invariant.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from trainer.distributed import is_shard, shard_on

# Module names that wrappers insert into parameter names (checkpoint_wrapper, torch.compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
# Elements drawn per generator (a block of whole rows): bounds the temporary memory of a draw
# (16 MiB in fp32) and the rows a shard generates beyond its own.
BLOCK_ELEMENTS = 1 << 22


def init_model_weights(model: nn.Module, seed: int) -> None:
    """Run ``model.init_weights()`` (after ``to_empty``) with every parameter's random draws
    keyed by ``seed`` and the parameter's global name: the same weights in every layout."""
    draws = _KeyedDraws(model, seed)
    original = nn.init.trunc_normal_

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if id(tensor) not in draws.names:
            return original(tensor, mean, std, a, b, generator)
        draws.keyed_fill(tensor, _truncated_normal(mean, std, a, b), generator)
        return tensor

    # trunc_normal_ has no __torch_function__ hook, and torch's own version redraws rejected
    # values into fresh tensors from the global generator: it is replaced for the duration.
    nn.init.trunc_normal_ = trunc_normal_
    try:
        with torch.no_grad(), draws:
            model.init_weights()
    finally:
        nn.init.trunc_normal_ = original


class _KeyedDraws(TorchFunctionMode):
    """Replaces ``uniform_`` / ``normal_`` on the model's parameters by keyed block draws."""

    def __init__(self, model: nn.Module, seed: int):
        super().__init__()
        self.seed = seed
        self.names = {id(p): global_name(name) for name, p in model.named_parameters()}
        self.draws: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DRAWS:
            tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
            if id(tensor) in self.names:
                # nn.init.normal_ / uniform_ dispatch here as themselves (their tensor method
                # would run with this mode off), so both spellings are keyed alike.
                kind, names = _DRAWS[func]
                given = list(args[1:])
                defaults = zip(names, (0.0, 1.0))
                lo, hi = (given[i] if i < len(given) else kwargs.get(n, d) for i, (n, d) in enumerate(defaults))
                self.keyed_fill(tensor, kind(float(lo), float(hi)), kwargs.get("generator"))
                return tensor
        elif getattr(func, "__module__", None) == "torch.nn.init" and func not in _DETERMINISTIC:
            tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
            if id(tensor) in self.names:
                raise NotImplementedError(
                    f"{self.names[id(tensor)]}: nn.init.{func.__name__} is not keyed by the layout-invariant init "
                    "(trainer/parallel/weight_init.py); use normal_ / trunc_normal_ / uniform_"
                )
        return func(*args, **kwargs)

    def keyed_fill(self, param: torch.Tensor, draw, generator) -> None:
        name = self.names[id(param)]
        if generator is not None:
            raise ValueError(f"{name}: init draws with its own generator; the layout-invariant init keys them itself")
        count = self.draws.get(name, 0)
        self.draws[name] = count + 1
        _fill(param, draw, key=(self.seed, name, count))


def global_name(name: str) -> str:
    """The parameter's name in the plain model: without the wrappers that activation
    checkpointing and ``torch.compile`` insert (their names depend on the run's options)."""
    for wrapper in WRAPPER_PREFIXES:
        name = name.replace(wrapper, "")
    return name


def _uniform(lo: float, hi: float):
    return lambda values, gen: values.uniform_(lo, hi, generator=gen)


def _normal(mean: float, std: float):
    return lambda values, gen: values.normal_(mean, std, generator=gen)


def _truncated_normal(mean: float, std: float, a: float, b: float):
    """N(mean, std) with values outside [a, b] drawn again, from the block's own generator."""

    def draw(values: torch.Tensor, gen: torch.Generator) -> None:
        values.normal_(mean, std, generator=gen)
        while True:
            bad = (values < a) | (values > b)
            n = int(bad.sum())
            if n == 0:
                return
            values[bad] = torch.empty(n, dtype=values.dtype, device=values.device).normal_(mean, std, generator=gen)

    return draw


# Random fills and their (low or mean, high or std) argument names; nn.init's own spellings
# reach a TorchFunctionMode before their tensor method does.
_DRAWS = {
    torch.Tensor.uniform_: (_uniform, ("from", "to")),
    torch.Tensor.normal_: (_normal, ("mean", "std")),
    nn.init.uniform_: (_uniform, ("a", "b")),
    nn.init.normal_: (_normal, ("mean", "std")),
}
_DETERMINISTIC = (nn.init.ones_, nn.init.zeros_, nn.init.constant_, nn.init.eye_, nn.init.dirac_)


def _fill(param: torch.Tensor, draw, key: tuple) -> None:
    """Fill this rank's part of ``param`` with its rows of the keyed full-tensor draw."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    if param.ndim == 0:
        shape, local_view, index = (1,), local.view(1), [torch.zeros(1, dtype=torch.long)]
    else:
        (shape, index), local_view = _layout(param), local
    row_elems = math.prod(shape[1:])
    block_rows = max(1, BLOCK_ELEMENTS // max(row_elems, 1))
    rows = index[0].to(local.device)
    gen = torch.Generator(device=local.device)
    for block in torch.unique(rows // block_rows).tolist():
        start = block * block_rows
        n = min(block_rows, shape[0] - start)
        gen.manual_seed(_block_seed(key, block))
        values = torch.empty((n, *shape[1:]), dtype=local.dtype, device=local.device)
        draw(values, gen)
        mine = torch.nonzero((rows >= start) & (rows < start + n)).flatten()
        picked = values.index_select(0, rows[mine] - start)
        for dim in range(1, len(shape)):
            if len(index[dim]) != shape[dim]:
                picked = picked.index_select(dim, index[dim].to(local.device))
        local_view.index_copy_(0, mine, picked)


def _layout(param: torch.Tensor) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """The global shape and, per dimension, the global indices of this rank's local shard, in
    local order. The placements cut an index vector per dimension, left to right, with DTensor's
    own split (so FSDP's strided shards on top of TP / EP come out as DTensor lays them out)."""
    indices = [torch.arange(n) for n in param.shape]
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        for mesh_dim, placement in enumerate(param.placements):
            if is_shard(placement):
                d = placement.dim
                chunks, _ = shard_on(placement, 0)._split_tensor(indices[d], mesh.size(mesh_dim), with_padding=False)
                coord = mesh.get_local_rank(mesh_dim)
                indices[d] = chunks[coord] if coord < len(chunks) else indices[d][:0]
    return tuple(param.shape), indices


def _block_seed(key: tuple, block: int) -> int:
    digest = hashlib.blake2b(repr((*key, block)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
