"""Activation checkpointing: a recomputation records no statistic, and every mode recomputes a
block as often as a backward is split, with the gradients of no checkpointing.

The split backward is the zero-bubble schedules' (trainer/parallel/pipeline_step.py): an input
pass, then a weight pass of one ``autograd.grad`` per parameter group, each a graph task of its
own and so a recomputation of every checkpointed block. Compared bit for bit with the same calls
on the unwrapped model: a recomputation runs the forward's ops on the same values.
"""

import dataclasses

import pytest
import torch

from models.common.forward_stats import forward_statistics
from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import EngramArgs, NgramHasher, TokenCompression
from models.moe import MoE
from trainer.config.activation_checkpoint import RECOMPUTE_MODULES
from trainer.parallel.activation_checkpoint import apply_activation_checkpointing

pytestmark = pytest.mark.numerics  # docs/numerics.md

ENGRAM = EngramArgs(layer_ids=(1,), max_ngram=3, heads_per_order=2, base_size=37, head_dim=4)
# Block 0 dense, blocks 1-2 MoE (block 1 with Engram), and an MoE MTP block.
ARGS = dataclasses.replace(
    get_flavor("debugmodel"), n_layers=3, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=16, mtp_depth=1, vocab_size=32, eos_id=1,
    engram=ENGRAM,
)


def _model(mode: str, recompute_modules=("deepseek",)) -> DeepSeekV3Model:
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    apply_activation_checkpointing(model, mode, recompute_modules=recompute_modules)
    for module in model.modules():  # QK-clip's recording, as its step hook arms it on a clip step
        if hasattr(module, "record_max_logit"):
            module.record_max_logit = torch.ones((), dtype=torch.bool)
            module.max_logit = torch.full((ARGS.n_heads,), float("-inf"))
    return model.train()


def _split_backward(model: DeepSeekV3Model) -> None:
    """A forward and its split backward: an input pass (the embedding output's gradient), then a
    weight pass in two `autograd.grad` calls."""
    tokens = torch.randint(2, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    engram_ids = NgramHasher(ENGRAM, TokenCompression(torch.arange(32) % 20, 20, pad_id=0))(tokens)
    h = model.embed(tokens).detach().requires_grad_()
    freqs_cis, attn_mask = model.rope_and_mask(tokens, None, None)
    out, aux = model.forward_blocks(h, freqs_cis, attn_mask, tokens, engram_ids)
    logits, mtp_logits, mtp_aux = model.forward_head(out, tokens.roll(-1, 1), freqs_cis, attn_mask)
    loss = sum(x.square().mean() for x in (logits, *mtp_logits)) + aux + mtp_aux
    torch.autograd.grad(loss, [h], retain_graph=True)
    params = [p for p in model.parameters() if p is not model.embed.weight]
    for group in (params[: len(params) // 2], params[len(params) // 2 :]):
        for p, grad in zip(group, torch.autograd.grad(loss, group, retain_graph=True, allow_unused=True)):
            p.grad = grad


def _stats(model: DeepSeekV3Model) -> list[torch.Tensor]:
    return [t.clone() for t in forward_statistics(model)]


# selective: full on every N-th block. modules: DeepSeek's set (the cheap parts), and every other
# part at once (the cheap parts' outputs then kept).
HEAVY_PARTS = tuple(part for part in RECOMPUTE_MODULES if part not in ("layernorm", "moe_act"))


@pytest.fixture(scope="module")
def reference_backward():
    """The model without checkpointing after `_split_backward`, once for every mode compared with
    it: its forward statistics, MoE token counts and gradients by name."""
    reference = _model("none")
    _split_backward(reference)
    counts = [m.tokens_per_expert.sum().item() for m in reference.modules() if isinstance(m, MoE)]
    return _stats(reference), counts, {n: p.grad for n, p in reference.named_parameters()}


@pytest.mark.parametrize("mode, parts", [("full", ()), ("op", ()), ("modules", ("deepseek",)), ("modules", HEAVY_PARTS)])
def test_a_recomputation_records_nothing_and_changes_no_gradient(mode, parts, reference_backward):
    want, counts, reference_grads = reference_backward
    checkpointed = _model(mode, parts)
    _split_backward(checkpointed)
    # Counts of 32 tokens x top-k in each of the 3 MoE blocks, Engram's gate sums over 32 tokens,
    # and a max logit of every head of the 4 attention layers.
    assert sorted(t.numel() for t in want) == sorted([ARGS.n_heads] * 4 + [3] + [ARGS.moe.num_experts] * 3)
    assert counts == [32 * ARGS.moe.top_k] * 3
    for got, expected in zip(_stats(checkpointed), want, strict=True):
        assert torch.equal(got, expected)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in checkpointed.named_parameters()}
    for name, grad in reference_grads.items():
        assert (grads[name] is None) == (grad is None), name
        if grad is not None:
            assert torch.equal(grads[name], grad), name

