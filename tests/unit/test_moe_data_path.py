"""The MoE data path on one device: no atomic scatters, no host reads, the reference numbers.

The debug model's MoE (fp32, grouped-mm path) is run forward and backward under
`torch.profiler` (ops counted by name) and a `TorchFunctionMode` that counts every Python-level
read of a device value. Its outputs and gradients are compared with a straightforward
per-token loop written here.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import models.moe.dispatcher as dispatcher_module
from models.deepseek_v3 import DeepSeekV3ModelArgs
from models.moe import MoE
from models.moe.permutation import permute, sort_by_expert, unpermute
from trainer.diagnostics import HostReadCounter

pytestmark = pytest.mark.numerics  # docs/numerics.md

ATOMIC_OPS = ("aten::index_add", "aten::index_put", "aten::scatter_add")


def _debug_moe(seed: int = 0, **overrides) -> MoE:
    args = DeepSeekV3ModelArgs()
    moe_args = args.moe if not overrides else type(args.moe)(**{**vars(args.moe), **overrides})
    torch.manual_seed(seed)
    moe = MoE(args.dim, args.moe_inter_dim, moe_args)
    moe.init_weights(init_std=0.02)
    with torch.no_grad():
        # A non-zero bias, so that it shifts the choice but not the gate values.
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, moe_args.num_experts))
    return moe.train()


def _inputs(moe: MoE, bsz: int = 2, seqlen: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dim = moe.gate.weight.shape[1]
    return torch.randn(bsz, seqlen, dim, generator=g), torch.randn(bsz, seqlen, dim, generator=g)


def _forward_backward(moe: MoE, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out, aux = moe(x)
    ((out * grad_out).sum() + aux).backward()
    return out.detach(), x.grad


def _reference(moe: MoE, x: torch.Tensor, grad_out: torch.Tensor):
    """The MoE written as a loop over tokens and their choices (same router, same weights)."""
    x = x.clone().requires_grad_()
    tokens = x.reshape(-1, x.shape[-1])
    top_scores, selected, _ = moe.gate(tokens, moe.expert_bias)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[t])
        for k in range(selected.shape[1]):
            e = selected[t, k]
            y = F.linear(F.silu(F.linear(tokens[t], w1[e])) * F.linear(tokens[t], w3[e]), w2[e])
            acc = acc + y * top_scores[t, k]
        rows.append(acc)
    out = torch.stack(rows) + moe.shared_experts(tokens)
    out = out.view_as(x)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


def _grads(moe: MoE) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in moe.named_parameters()}


def _op_counts(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def _atomic(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith(ATOMIC_OPS)}


def test_profiler_probes_can_fail():
    """A plain `index_select`'s backward is an `index_add`; a bare `.item()` is outside any
    grouped mm."""
    x = torch.randn(6, 4, requires_grad=True)
    counts = _op_counts(lambda: x.index_select(0, torch.tensor([0, 0, 3])).sum().backward())
    assert _atomic(counts).get("aten::index_add_", 0) + _atomic(counts).get("aten::index_add", 0) > 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.sum().item()
    assert _items_outside_grouped_mm(prof) == 1


def test_host_read_counter_sees_the_loop_path():
    """The counter can fail: the per-expert loop reads its split sizes with `.tolist()`."""
    moe = _debug_moe(use_grouped_mm=False)
    x, grad_out = _inputs(moe)
    with HostReadCounter("cpu") as counter:
        _forward_backward(moe, x, grad_out)
    assert "tolist" in counter.reads


def _items_outside_grouped_mm(prof) -> int:
    """`aten::item` calls not made by a `_grouped_mm` kernel. The CPU kernel loops over the
    groups and reads each offset inside C++; the CUDA kernel reads them on the device."""
    outside = 0
    for event in prof.events():
        if event.name != "aten::item":
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != "aten::_grouped_mm":
            parent = parent.cpu_parent
        outside += parent is None
    return outside


def test_grouped_mm_path_has_no_atomics_and_no_host_reads():
    moe = _debug_moe()
    x, grad_out = _inputs(moe)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward_backward(moe, x, grad_out)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_grouped_mm", 0) >= 6  # 3 forward + their backward: the path ran
    assert _atomic(counts) == {}, _atomic(counts)
    assert _items_outside_grouped_mm(prof) == 0

    moe.zero_grad()
    with HostReadCounter("cpu") as counter:
        _forward_backward(moe, x, grad_out)
    assert counter.reads == []


@pytest.mark.parametrize("align", [1, 16])  # 16: the CUDA group alignment, with padding rows
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_matches_the_per_token_loop(use_grouped_mm, align, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "group_align", lambda x: align)
    moe = _debug_moe(use_grouped_mm=use_grouped_mm)
    x, grad_out = _inputs(moe, bsz=2, seqlen=24)
    out, dx = _forward_backward(moe, x, grad_out)
    grads = _grads(moe)
    moe.zero_grad()
    ref_out, ref_dx = _reference(moe, x, grad_out)
    ref_grads = _grads(moe)
    tight = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, ref_out, **tight)
    torch.testing.assert_close(dx, ref_dx, **tight)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tight, msg=name)


@pytest.mark.parametrize("align", [1, 4])
def test_permutation_round_trip_and_padding(align):
    """Aligned groups start at multiples of `align`; the K copies of a token sum in backward;
    padding rows get no gradient."""
    torch.manual_seed(0)
    num_tokens, top_k, num_experts = 7, 3, 5
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    perm = sort_by_expert(experts.reshape(-1), num_experts, top_k, align)
    ends = torch.cumsum(perm.counts, 0)
    assert (perm.counts % align == 0).all() and perm.src.shape[0] == num_tokens * top_k + num_experts * (align - 1)
    assert torch.equal(torch.sort(perm.dest).values, perm.dest.unique())  # injective
    # Each real row sits inside its expert's group.
    expert_of_row = torch.searchsorted(ends, perm.dest, right=True)
    assert torch.equal(expert_of_row, experts.reshape(-1))

    x = torch.randn(num_tokens, 4, requires_grad=True)
    rows = permute(x, perm)
    weights = torch.randn(rows.shape[0], 1)
    per_slot = unpermute(rows * weights, perm)
    expected = x.repeat_interleave(top_k, dim=0) * weights[perm.dest]
    torch.testing.assert_close(per_slot, expected)
    per_slot.sum().backward()
    torch.testing.assert_close(x.grad, weights[perm.dest].view(num_tokens, top_k).sum(1, keepdim=True).expand(-1, 4))


@pytest.mark.parametrize("align", [1, 16])
def test_permutation_of_no_rows(align):
    """An expert-parallel rank can receive no token at all; with CUDA's alignment its buffer is
    still padding rows only: zeros forward, an empty gradient backward."""
    x = torch.zeros(0, 4, requires_grad=True)
    perm = sort_by_expert(torch.zeros(0, dtype=torch.int64), 3, 1, align)
    rows = permute(x, perm)
    assert rows.shape == (perm.src.shape[0], 4) and not rows.any()
    assert unpermute(rows, perm).shape == (0, 4)
    rows.sum().backward()
    assert x.grad.shape == (0, 4)
