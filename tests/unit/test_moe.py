"""Unit tests of models/moe: routing, experts, dispatcher, MoE block, load balancing."""

import itertools

import pytest
import torch

from models.moe import (
    GroupedExperts,
    LocalTokenDispatcher,
    MoE,
    MoEArgs,
    TokenChoiceTopKRouter,
    moe_modules,
    update_expert_bias,
)
from models.moe.permutation import permute, sort_by_expert, unpermute

pytestmark = pytest.mark.numerics  # docs/numerics.md

DIM, INTER = 32, 16


def _moe(**overrides) -> MoE:
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, **overrides})
    moe = MoE(DIM, INTER, args)
    moe.init_weights(init_std=0.1)
    return moe


# --- args -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_experts": 4, "top_k": 5}, "top_k"),
        ({"num_experts": 8, "num_expert_groups": 3}, "num_expert_groups"),
        ({"num_expert_groups": 2, "num_limited_groups": 3}, "num_limited_groups"),
        ({"score_func": "relu"}, "score_func"),
        ({"num_experts": 8, "num_expert_groups": 4, "num_limited_groups": 1, "top_k": 3}, "top_k"),
        (
            {"num_experts": 4, "num_expert_groups": 4, "num_limited_groups": 2, "top_k": 1},
            "experts per group",
        ),
    ],
)
def test_args_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MoEArgs(**kwargs)


# --- router -----------------------------------------------------------------------------


def _brute_force_route(scores, bias, args):
    """Per token: best group subset by summed top-2 group scores, then the best K experts."""
    per_group = args.num_experts // args.num_expert_groups
    selected = []
    for row in (scores + bias).tolist():
        groups = [row[g * per_group : (g + 1) * per_group] for g in range(args.num_expert_groups)]
        group_score = [sum(sorted(g, reverse=True)[:2]) for g in groups]
        best_groups = max(
            itertools.combinations(range(args.num_expert_groups), args.num_limited_groups),
            key=lambda subset: sum(group_score[g] for g in subset),
        )
        allowed = [g * per_group + i for g in best_groups for i in range(per_group)]
        best = max(
            itertools.combinations(allowed, args.top_k), key=lambda c: sum(row[e] for e in c)
        )
        selected.append(sorted(best))
    return torch.tensor(selected)


@pytest.mark.parametrize(
    "score_func, use_bias, route_norm, route_scale",
    [("sigmoid", True, True, 2.5), ("softmax", False, False, 1.0), ("softmax", True, False, 16.0)],
)
def test_group_limited_routing_matches_brute_force(score_func, use_bias, route_norm, route_scale):
    torch.manual_seed(0)
    args = MoEArgs(
        num_experts=12, top_k=3, num_expert_groups=4, num_limited_groups=2,
        score_func=score_func, route_norm=route_norm, route_scale=route_scale,
    )
    router = TokenChoiceTopKRouter(DIM, args)
    router.init_weights(init_std=0.5)
    x = torch.randn(64, DIM)
    bias = 0.1 * torch.randn(12) if use_bias else None

    top_scores, selected, scores = router(x, bias)

    logits = x @ router.weight.T
    raw = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    torch.testing.assert_close(scores, raw)
    expected = _brute_force_route(raw, bias if use_bias else torch.zeros(12), args)
    order = selected.argsort(dim=-1)
    assert torch.equal(selected.gather(-1, order), expected)
    gates = raw.gather(-1, expected)
    if route_norm:
        gates = gates / gates.sum(-1, keepdim=True)
    torch.testing.assert_close(top_scores.gather(-1, order), gates * route_scale)


def test_bias_changes_selection_not_gate_values():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, score_func="sigmoid")
    router = TokenChoiceTopKRouter(DIM, args)
    router.init_weights(init_std=0.5)
    x = torch.randn(32, DIM)
    _, unbiased_sel, _ = router(x)
    bias = torch.zeros(8)
    bias[[5, 6]] = 10.0  # dominates any sigmoid difference

    top_scores, selected, scores = router(x, bias)

    assert not torch.equal(unbiased_sel.sort(-1).values, selected.sort(-1).values)
    assert torch.equal(selected.sort(-1).values, torch.tensor([[5, 6]]).expand(32, 2))
    torch.testing.assert_close(top_scores, scores.gather(-1, selected))
    assert top_scores.max() < 1.0  # raw sigmoid values, not biased ones


# --- experts ----------------------------------------------------------------------------


def _experts_reference(experts, x, counts):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        hidden = torch.nn.functional.silu(xe @ experts.w1[e].T) * (xe @ experts.w3[e].T)
        outs.append(hidden @ experts.w2[e].T)
        start += n
    return torch.cat(outs)


def _experts_pair(dtype=torch.float32):
    torch.manual_seed(0)
    grouped = GroupedExperts(DIM, INTER, num_experts=4, use_grouped_mm=True)
    grouped.init_weights(init_std=0.2)
    loop = GroupedExperts(DIM, INTER, num_experts=4, use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    return grouped.to(dtype), loop.to(dtype)


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 9, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_experts_handle_zero_token_experts(counts, use_grouped_mm):
    grouped, loop = _experts_pair()
    experts = grouped if use_grouped_mm else loop
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    out = experts(x, counts)
    torch.testing.assert_close(out, _experts_reference(experts, x, counts))
    (out * torch.randn_like(out)).sum().backward()
    for e in (counts == 0).nonzero().flatten().tolist():
        assert experts.w1.grad[e].abs().max() == 0


@pytest.mark.parametrize("align", [1, 16])  # 16: the row alignment used on CUDA
def test_grouped_and_loop_paths_agree_fp32(align):
    grouped, loop = _experts_pair()
    counts = torch.tensor([6, 0, 11, 3])
    x = torch.randn(20, DIM)
    grad_out = torch.randn(20, DIM)
    # The dispatchers hand the experts aligned groups and a padding tail.
    perm = sort_by_expert(torch.repeat_interleave(torch.arange(4), counts), 4, align=align)
    assert perm.src.shape[0] == 20 + 4 * (align - 1)

    def run(forward):
        xi = x.clone().requires_grad_()
        out = forward(xi)
        (out * grad_out).sum().backward()
        return out, xi.grad

    out_grouped, dx_grouped = run(lambda xi: unpermute(grouped(permute(xi, perm), perm.counts), perm))
    out_loop, dx_loop = run(lambda xi: loop(xi, counts))
    tight = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out_grouped, out_loop, **tight)
    torch.testing.assert_close(dx_grouped, dx_loop, **tight)
    for name in ("w1", "w2", "w3"):
        grad_grouped, grad_loop = getattr(grouped, name).grad, getattr(loop, name).grad
        torch.testing.assert_close(grad_grouped, grad_loop, **tight)


def test_grouped_and_loop_paths_agree_bf16():
    grouped, loop = _experts_pair(torch.bfloat16)
    counts = torch.tensor([6, 0, 11, 3])
    x = torch.randn(20, DIM, dtype=torch.bfloat16)
    out_grouped, out_loop = grouped(x, counts), loop(x, counts)
    assert out_grouped.dtype == torch.bfloat16
    torch.testing.assert_close(out_grouped, out_loop, rtol=2e-2, atol=2e-2)


# --- dispatcher -------------------------------------------------------------------------


def test_local_dispatcher_round_trip():
    torch.manual_seed(0)
    x = torch.randn(10, DIM, requires_grad=True)
    selected = torch.randint(0, 4, (10, 3))
    gates = torch.rand(10, 3)
    dispatcher = LocalTokenDispatcher(num_experts=4)

    routed, counts, ctx = dispatcher.dispatch(x, selected, gates)

    assert torch.equal(counts, torch.bincount(selected.flatten(), minlength=4))
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    # Rows sorted by expert, each row a copy of a token that chose that expert.
    assert routed.shape == (30, DIM)
    out = dispatcher.combine(routed * (1 + expert_of_row[:, None]), ctx, x.shape)
    expected = (x[:, None, :] * (gates * (1 + selected))[..., None]).sum(1)
    torch.testing.assert_close(out, expected)


# --- MoE block --------------------------------------------------------------------------


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_moe_forward_backward_shapes_and_counts(use_grouped_mm):
    torch.manual_seed(0)
    moe = _moe(use_grouped_mm=use_grouped_mm, num_shared_experts=2)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    out, aux = moe(x)
    assert out.shape == x.shape and aux.shape == () and aux.dtype == torch.float32
    assert aux.item() == 0
    out.square().sum().backward()
    assert x.grad.shape == x.shape
    for param in (moe.gate.weight, moe.experts.w1, moe.shared_experts.w2.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0
    assert moe.tokens_per_expert.sum().item() == 2 * 5 * 2

    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum().item() == 2 * 5 * 2


def test_moe_without_shared_experts_or_bias():
    moe = _moe(num_shared_experts=0, load_balance_coeff=None)
    assert moe.shared_experts is None and moe.expert_bias is None
    assert "expert_bias" not in moe.state_dict()
    out, _ = moe(torch.randn(1, 4, DIM))
    assert out.shape == (1, 4, DIM)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_moe_zero_token_experts(use_grouped_mm):
    torch.manual_seed(0)
    moe = _moe(use_grouped_mm=use_grouped_mm, score_func="sigmoid")
    with torch.no_grad():
        moe.expert_bias[[1, 6]] = 10.0  # every token picks experts 1 and 6
    x = torch.randn(2, 6, DIM)
    out, _ = moe(x)
    out.sum().backward()
    assert torch.equal(moe.tokens_per_expert.nonzero().flatten(), torch.tensor([1, 6]))
    assert moe.experts.w1.grad[0].abs().max() == 0 and moe.experts.w1.grad[1].abs().max() > 0


def test_seq_aux_loss():
    torch.manual_seed(0)
    moe = _moe(seq_aux_loss_alpha=1e-2, score_func="sigmoid")
    out, aux = moe(torch.randn(3, 7, DIM))
    assert torch.isfinite(aux) and aux.item() > 0
    aux.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    # Perfectly uniform routing and scores give alpha * 1.
    scores = torch.full((4, 8), 0.5)
    selected = torch.arange(8).view(4, 2)
    loss = moe._sequence_balance_loss(scores, selected, bsz=1, seqlen=4)
    torch.testing.assert_close(loss, torch.tensor(1e-2))


def test_moe_matches_hf_deepseek_v3():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=DIM, moe_intermediate_size=INTER, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    )
    hf = DeepseekV3MoE(config).float()
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.2)
    hf.gate.e_score_correction_bias.normal_(std=0.05)
    args = MoEArgs(
        num_experts=16, num_shared_experts=2, top_k=4, score_func="sigmoid", route_norm=True,
        route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
    )
    moe = MoE(DIM, INTER, args)
    with torch.no_grad():
        moe.gate.weight.copy_(hf.gate.weight)
        moe.expert_bias.copy_(hf.gate.e_score_correction_bias)
        moe.experts.w1.copy_(hf.experts.gate_up_proj[:, :INTER])
        moe.experts.w3.copy_(hf.experts.gate_up_proj[:, INTER:])
        moe.experts.w2.copy_(hf.experts.down_proj)
        moe.shared_experts.w1.weight.copy_(hf.shared_experts.gate_proj.weight)
        moe.shared_experts.w3.weight.copy_(hf.shared_experts.up_proj.weight)
        moe.shared_experts.w2.weight.copy_(hf.shared_experts.down_proj.weight)
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        expected = hf(x)
        for use_grouped_mm in (True, False):
            moe.experts.use_grouped_mm = use_grouped_mm
            out, _ = moe(x)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# --- aux-loss-free balancing ------------------------------------------------------------


def _imbalance(counts: torch.Tensor) -> float:
    return (counts.max() / counts.mean()).item()


def test_bias_update_moves_load_toward_uniform():
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        [_moe(score_func="sigmoid", load_balance_coeff=0.02), _moe(load_balance_coeff=0.02)]
    )
    # Skewed input: every token leans toward the experts that like a common direction.
    x = torch.randn(4, 16, DIM) + 3 * model[0].gate.weight[0].detach()
    moes = moe_modules(model)
    assert moes == [model[0], model[1]]
    bias_tensor = moes[0].expert_bias
    calls = []

    def reduce_counts(counts):
        calls.append(counts.clone())
        return counts

    history = []
    with torch.no_grad():
        for _ in range(30):
            for moe in moes:
                moe(x)
            history.append(_imbalance(moes[0].tokens_per_expert))
            stats = update_expert_bias(moes, reduce_counts)

    assert len(calls) == 30 and calls[0].shape == (16,)
    assert moes[0].expert_bias is bias_tensor
    assert moes[0].tokens_per_expert.sum() == 0
    assert set(stats) == {
        "moe/load_imbalance/layer_0", "moe/load_imbalance/layer_1",
        "moe/load_imbalance/max", "moe/load_imbalance/mean",
    }
    assert stats["moe/load_imbalance/layer_0"] == pytest.approx(history[-1])
    assert history[0] > 2.0
    assert min(history[-10:]) < 0.6 * history[0]


def test_bias_update_rule_and_reduce_hook():
    moe = _moe(load_balance_coeff=0.1)
    moe.tokens_per_expert.copy_(torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 0]))
    # The hook's result (global counts) drives the update, not the local counts.
    stats = update_expert_bias([moe], lambda c: c + torch.arange(8.0))
    global_counts = torch.tensor([4.0, 1, 2, 3, 4, 5, 6, 7])
    expected = 0.1 * torch.sign(global_counts.mean() - global_counts)
    torch.testing.assert_close(moe.expert_bias, expected)
    assert stats["moe/load_imbalance/max"] == pytest.approx(7 / global_counts.mean().item())
    assert update_expert_bias([]) == {}


def test_moe_without_bias_only_resets_counts():
    moe = _moe(load_balance_coeff=None)
    moe(torch.randn(1, 4, DIM))
    stats = update_expert_bias([moe])
    assert moe.tokens_per_expert.sum() == 0 and stats["moe/load_imbalance/layer_0"] >= 1.0
