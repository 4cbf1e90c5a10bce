"""torch.compile per block: where the graphs break, no recompiles under changing routing, parity.

Compiling is slow on a small CPU, so the inductor runs are shared: one module-scoped run per
dtype trains a compiled and an eager copy of the debug model (shapes chosen to match the e2e
test, which then hits the session's inductor cache) and the tests read its records. Graph
structure tests use dynamo's "eager"/"aot_eager" backends, which trace but skip codegen.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.moe import MoE
from trainer.loss import cross_entropy_sum
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from trainer.parallel.compile import apply_compile, compile_dynamo_config, compiled_cross_entropy_sum

pytestmark = pytest.mark.numerics  # docs/numerics.md

BATCH, SEQ = 2, 64
# Compiled steps with changing routing: the patterns of `_force_routing` cycle every 3 steps, so
# 12 steps (11 with recompiles armed) show each pattern 4 times, and as often as each other.
STEPS = 12
PARITY_STEPS = 10  # of which compared with eager
# Loss tolerances, compiled vs eager, over 10 AdamW steps (measured max |diff| on CPU, torch
# 2.13: fp32 9.5e-7, bf16 3.3e-4). fp32 differs only by kernel reassociation; bf16 also by where
# inductor rounds fused ops (it keeps fp32 intermediates that eager rounds to bf16).
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}
# Graphs per block kind: a dense block is one graph (fullgraph=True); so is an MoE block on one
# device, whose dispatcher has static shapes and no host reads (router, sort, experts, gate
# weighting and shared experts in one graph).
MOE_GRAPH_BREAKS = 0
MOE_GRAPHS = 1
# All MoE blocks share one trace per input dtype. With bf16 autocast the MTP block gets a bf16
# input (from `eh_proj`) where the main blocks get fp32, so the MoE block is traced twice.
MOE_TRACES = {"fp32": 1, "bf16": 2}
RUN_GRAPHS = {k: 1 + n * MOE_GRAPHS + 1 for k, n in MOE_TRACES.items()}  # + dense block + loss


def _args(**kw) -> DeepSeekV3ModelArgs:
    return dataclasses.replace(
        DeepSeekV3ModelArgs(), max_seq_len=SEQ, attn_mask_type="block_causal", eos_id=1, **kw
    )


def _model(args: DeepSeekV3ModelArgs, seed: int = 0) -> DeepSeekV3Model:
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.train()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(2, 8192, (BATCH, SEQ + 1), generator=g)
    data[:, 17] = 1  # an EOS: two documents per row
    return data[:, :-1], data[:, 1:]


def _moes(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _force_routing(model: torch.nn.Module, step: int) -> None:
    """Varies routing between steps: every third step experts 0-3 get no token at all (their
    groups' biased scores are hopeless), every other third one expert is strongly preferred."""
    with torch.no_grad():
        for moe in _moes(model):
            moe.expert_bias.zero_()
            if step % 3 == 1:
                moe.expert_bias[:4] = -10.0
            elif step % 3 == 2:
                moe.expert_bias[5] = 10.0


def _train(model, steps, dtype, loss_fn, compiled_from=None):
    """AdamW steps with the trainer's objective.

    From step `compiled_from` on, a recompile raises (`error_on_recompile`). Returns the
    losses, layer-1 expert counts and the number of unique graphs after each step.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, counts, graphs = [], [], []
    for step in range(steps):
        _force_routing(model, step)
        inputs, labels = _batch(step)
        armed = compiled_from is not None and step >= compiled_from
        with torch._dynamo.config.patch(error_on_recompile=armed):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                out = model(inputs, labels=labels)
                loss = loss_fn(out.logits, labels) / labels.numel()
                objective = loss + out.aux_loss
            objective.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        counts.append(_moes(model)[0].tokens_per_expert.clone())
        for moe in _moes(model):
            moe.tokens_per_expert.zero_()
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, counts, graphs


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def inductor_run(request):
    """One compiled (inductor) and one eager training run of the debug model per dtype."""
    dtype = request.param
    torch._dynamo.reset()
    counters.clear()
    compiled = _model(_args())
    apply_compile(compiled)
    # Step 0 compiles everything (forward and backward); every later step must reuse it.
    losses, counts, graphs = _train(compiled, STEPS, dtype, compiled_cross_entropy_sum(), compiled_from=1)
    graph_breaks = dict(counters["graph_break"])
    eager_losses, _, _ = _train(_model(_args()), PARITY_STEPS, dtype, cross_entropy_sum)
    return {
        "dtype": dtype,
        "losses": losses,
        "eager_losses": eager_losses,
        "counts": counts,
        "graphs": graphs,
        "graph_breaks": graph_breaks,
    }


@pytest.mark.slow  # the inductor_run fixture compiles and trains twice
def test_no_recompiles_when_routing_changes(inductor_run):
    counts = torch.stack(inductor_run["counts"])  # [steps, E]
    # The routing really did change, with experts left without tokens on some steps.
    assert (counts[1::3, :4] == 0).all()
    assert (counts[0::3] > 0).sum() > (counts[1::3] > 0).sum()
    assert len({tuple(c.tolist()) for c in counts}) == STEPS
    # Reaching here means no step after the first recompiled (error_on_recompile was armed),
    # and the graph count never moved after step 0.
    assert inductor_run["graphs"] == [RUN_GRAPHS[inductor_run["dtype"]]] * STEPS


@pytest.mark.slow  # the inductor_run fixture compiles and trains twice
def test_compiled_losses_match_eager(inductor_run):
    tol = TOLERANCE[inductor_run["dtype"]]
    compiled = torch.tensor(inductor_run["losses"][:PARITY_STEPS])
    eager = torch.tensor(inductor_run["eager_losses"])
    assert torch.isfinite(compiled).all()
    print(f"{inductor_run['dtype']}: max |compiled - eager| loss = {(compiled - eager).abs().max():.3g}")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=tol)
    assert eager[-1] < eager[0]  # it trains


@pytest.mark.slow  # the inductor_run fixture compiles and trains twice
def test_moe_blocks_have_no_graph_breaks(inductor_run):
    # Counted over the whole run: a break would be counted when an MoE trace is made (once per
    # input dtype, shared by all MoE blocks). Dense blocks and the loss are compiled with
    # fullgraph=True, so a break there would have raised.
    breaks = inductor_run["graph_breaks"]
    assert sum(breaks.values()) == MOE_GRAPH_BREAKS * MOE_TRACES[inductor_run["dtype"]], breaks


def _one_step(model, inputs, labels):
    out = model(inputs, labels=labels)
    loss = cross_entropy_sum(out.logits, labels) / labels.numel() + out.aux_loss
    loss.backward()
    return loss.detach()


def test_per_block_graph_breaks_with_checkpoint_wrapper():
    """Blocks wrapped for activation checkpointing stay compiled, with the same graphs per
    MoE block, and give the eager numbers (aot_eager: compiled autograd, eager kernels). The
    recomputation runs the compiled graph, count additions included, again; the routed-token
    counts are still the eager forward's (trainer/parallel/activation_checkpoint.py)."""
    args = _args(n_layers=2, mtp_depth=1)  # one dense block, one MoE block, one MoE MTP block
    eager, wrapped = _model(args), _model(args)
    names = set(wrapped.state_dict())
    assert apply_activation_checkpointing(wrapped, "full") == 3
    torch._dynamo.reset()
    counters.clear()
    assert apply_compile(wrapped, backend="aot_eager") == 3
    assert set(wrapped.state_dict()) == names  # no `_orig_mod.` / wrapper names

    inputs, labels = _batch(0)
    loss_eager, loss_compiled = _one_step(eager, inputs, labels), _one_step(wrapped, inputs, labels)
    assert sum(counters["graph_break"].values()) == MOE_GRAPH_BREAKS
    assert counters["stats"]["unique_graphs"] == 1 + MOE_GRAPHS
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-5)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in wrapped.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    for got, want in zip(_moes(wrapped), _moes(eager), strict=True):
        assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)


def test_compile_is_scoped_and_refuses_twice():
    model = _model(_args(n_layers=2, mtp_depth=0))
    apply_compile(model, backend="eager")
    with pytest.raises(ValueError, match="already has a compiled forward"):
        apply_compile(model, backend="eager")
    # The dynamo settings apply only while a compiled block runs.
    before = {k: getattr(torch._dynamo.config, k) for k in compile_dynamo_config()}
    model(_batch(0)[0])
    assert {k: getattr(torch._dynamo.config, k) for k in before} == before


@pytest.mark.slow  # compiles the debug model's blocks twice (aot_eager)
def test_recompute_modules_compiled_match_no_checkpointing():
    """``activation_checkpoint.mode modules`` around compiled blocks: the loss, the gradients and
    the routed-token counts are bitwise those of the compiled model without checkpointing
    (aot_eager: the same eager kernels on the same values, recomputed or not)."""
    args = _args(n_layers=2, mtp_depth=1)
    plain, wrapped = _model(args), _model(args)
    assert apply_activation_checkpointing(wrapped, "modules", recompute_modules=["deepseek"]) == 3
    torch._dynamo.reset()
    apply_compile(plain, backend="aot_eager")
    apply_compile(wrapped, backend="aot_eager")
    inputs, labels = _batch(0)
    assert torch.equal(_one_step(wrapped, inputs, labels), _one_step(plain, inputs, labels))
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in wrapped.named_parameters()}
    for name, p in plain.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            assert torch.equal(grads[name], p.grad), name
    for got, want in zip(_moes(wrapped), _moes(plain), strict=True):
        assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
