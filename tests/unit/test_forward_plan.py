"""The model's forward written once: run in pieces as the MoE overlap runs it (trainer/parallel/
moe_overlap.py), the forward plan (pre, blocks, head) and the MoE block's phases give the values and
gradients of `forward` bit for bit. Single process, local dispatcher: the overlap's own nodes need
the all-to-all, and tests/distributed/test_moe_overlap_fast.py checks them on 2 ranks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_v3 import DeepSeekV3Model, get_flavor

pytestmark = pytest.mark.numerics  # docs/numerics.md


def _model() -> DeepSeekV3Model:
    """The debug model shrunk: 1 dense block, 2 MoE blocks, MTP, shared experts, balance loss."""
    base = get_flavor("debugmodel")
    moe = dataclasses.replace(base.moe, seq_aux_loss_alpha=0.01)
    args = dataclasses.replace(
        base,
        vocab_size=256,
        dim=64,
        inter_dim=128,
        moe_inter_dim=64,
        n_layers=3,
        n_dense_layers=1,
        mtp_depth=1,
        max_seq_len=32,
        moe=moe,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.train()


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    mtp = F.cross_entropy(out.mtp_logits[0].flatten(0, 1), labels.roll(-1, 1).flatten())
    return ce + 0.3 * mtp + out.aux_loss


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


def _moe_block_in_nodes(block, x: torch.Tensor, rope) -> tuple:
    """One MoE block as the overlap's attention, experts and post nodes (each on detached inputs;
    the exchanges are the local dispatcher's identity): (output, balance loss, backward)."""
    moe, dispatcher = block.ffn, block.ffn.dispatcher
    x = _leaf(x)
    h, ffn_in = block.attention_part(x, *rope)
    routing = moe.route(ffn_in)
    send, ctx = dispatcher.dispatch_preprocess(routing.tokens, routing.selected_experts, routing.top_scores)
    shared = moe.shared(routing.tokens)
    aux = moe.balance_loss(routing)
    attn_out = [h, send, shared, routing.top_scores, aux]

    recv = _leaf(dispatcher.token_dispatch(send, ctx))
    back = dispatcher.combine_preprocess(moe.experts(*dispatcher.dispatch_postprocess(recv, ctx)), ctx)

    post_in = [_leaf(dispatcher.token_combine(back, ctx)), _leaf(h), _leaf(shared), _leaf(routing.top_scores)]
    combined = dispatcher.combine_postprocess(post_in[0], ctx, post_in[3])
    y = block.tail(post_in[1], moe.output(combined, post_in[2], routing.shape))

    def backward(grad_y: torch.Tensor, grad_aux: torch.Tensor) -> torch.Tensor:
        y.backward(grad_y)
        back.backward(post_in[0].grad)
        grads = [post_in[1].grad, recv.grad, post_in[2].grad, post_in[3].grad, grad_aux]
        torch.autograd.backward(attn_out, grads)
        return x.grad

    return y, aux, backward


def test_forward_in_detached_pieces_is_forward_bit_for_bit():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)

    loss = _loss(model(tokens, labels), labels)
    loss.backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")}
    model.zero_grad(set_to_none=True)
    for name, b in model.named_buffers():
        if name in counts:
            b.zero_()

    plan = model.forward_plan(tokens, labels)
    h, carried = plan.pre()
    dense = [block for block in plan.blocks if not block.moe_enabled]
    h0, aux = plan.run_blocks(h, dense)
    x, layers = h0, []
    for block in plan.blocks[len(dense) :]:
        x, layer_aux, backward = _moe_block_in_nodes(block, x, (plan.freqs_cis, plan.attn_mask))
        layers.append((layer_aux, backward))
    head_in = [_leaf(t) for t in (x, aux, *carried, *(layer_aux for layer_aux, _ in layers))]
    head_aux = head_in[1]
    for layer_aux in head_in[2 + len(carried) :]:
        head_aux = head_aux + layer_aux
    pieces_loss = _loss(plan.head(head_in[0], head_aux, head_in[2 : 2 + len(carried)]), labels)
    pieces_loss.backward()
    grad = head_in[0].grad
    for (_, backward), leaf in reversed(list(zip(layers, head_in[2 + len(carried) :], strict=True))):
        grad = backward(grad, leaf.grad)
    torch.autograd.backward([h0, *carried], [grad, *(t.grad for t in head_in[2 : 2 + len(carried)])])

    assert pieces_loss.item() == loss.item()
    pieces = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(pieces) == sorted(whole) and any("experts.w1" in n for n in whole)
    assert [n for n in whole if not torch.equal(whole[n], pieces[n])] == []
    assert all(torch.equal(b, counts[n]) for n, b in model.named_buffers() if n in counts)
