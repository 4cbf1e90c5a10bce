"""Hiding the expert-parallel all-to-all behind compute: the backward of one micro-batch and the
forward of the next, interleaved node by node (Megatron-Core's "1F1B all-to-all overlap",
single-threaded).

Each MoE block of a micro-batch runs as five schedule nodes, each with detached inputs; a node's
backward runs autograd from its outputs with the gradients it is given and hands back its inputs'
gradients. Each node calls the block's phases (models/moe/moe.py, models/moe/dispatcher.py, the
block's in models/deepseek_v3/model.py), the ones ``TransformerBlock.forward`` and ``MoE.forward``
compose:

    attention   the block's ``attention_part``, ``MoE.route``, ``dispatch_preprocess`` (the
                exchange plan: the counts' all-to-all and the layer's one host read of the split
                sizes; the send permutation), ``MoE.shared``, ``MoE.balance_loss``
    dispatch    the token all-to-all (backward: the inverse all-to-all of the gradient)
    experts     ``dispatch_postprocess``, the routed experts, ``combine_preprocess``
    combine     the all-to-all back (backward: the inverse all-to-all of the gradient)
    post        ``combine_postprocess``, ``MoE.output`` and the block's ``tail``

The exchanges are asynchronous (``AllToAllTokenDispatcher.start_exchange``) and waited for by the
node that consumes them, in forward and in backward. ``pair`` runs micro-batch i's backward and
micro-batch i+1's forward layer by layer (forward layer j beside backward layer L-1-j) so that
every exchange has a compute node of the other micro-batch beside it:

    combine backward   <->  attention forward
    dispatch forward   <->  experts backward
    dispatch backward  <->  experts forward
    combine forward    <->  attention backward (and the next layer's post backward)

Two schedules pair micro-batches so: ``MoEOverlapStep`` below, the accumulated micro-batches of a
step without PP, and DualPipeV's ``OVERLAP_F_B`` actions, one pipeline stage's forward beside
another's backward (trainer/parallel/pipeline_overlap.py, ``StageNodes``), where the two runs
may hold different numbers of MoE blocks: ``pair`` interleaves their common number and runs the
longer one's rest alone.

The rest of a micro-batch's forward runs outside the interleave, as two nodes of the forward plan
(``ForwardPlan``, models/deepseek_v3/model.py) that the model and a pipeline stage each give once:
its pre part with the dense blocks, and its head (with MTP, whose MoE exchanges synchronously). The
model stays single-device and the math is written once: the nodes call the model's phases (the
attention node takes the shared experts and the balance loss, which depend only on the routing) and
run only the exchanges themselves, so every micro-batch's values and gradients are bitwise those of
the plain step.

Collective order: every rank runs this same fixed schedule (no branch on data or timing), and
the schedule keeps **one exchange in flight at a time** on the ep group (``ExchangeLane``): a new
exchange, and the counts' all-to-all of an attention node, first wait for the one in flight. So
the ep group sees one sequence of collectives, identical on every rank, as Megatron's single
communication stream does (FSDP's reduce-scatters, on their own groups, come at fixed points of
the same schedule); one exchange beside one compute node is all the schedule above can hide
anyway. Separate groups per direction would let a forward and a backward exchange run at once, at
the cost of a second communicator per ep group and an order argument across two groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.autograd.profiler import record_function

from models.deepseek_v3 import ModelOutput
from models.deepseek_v3.model import ForwardPlan
from models.moe import MoE
from trainer.parallel.expert_parallel import AllToAllTokenDispatcher, PendingExchange
from trainer.parallel.fsdp import ManualReduction, cast_forward_inputs, gathered_through_step
from trainer.parallel.step import MicroBatch, ParallelStep


def detached_leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A node's input: cut from the producing node's graph, gradient kept here."""
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


def backward_root(t: torch.Tensor) -> GradientEdge | None:
    """What a node keeps of an output that an exchange sends away, to run its backward from: the
    output's gradient edge, which unlike the tensor leaves its storage to be freed once sent (as the
    plain step frees it); None where no gradient flows."""
    return get_gradient_edge(t) if t.requires_grad else None


def node_backward(outputs: Sequence, grads: Sequence, inputs: Sequence) -> list[torch.Tensor | None]:
    """Autograd from a node's outputs (tensors or ``backward_root`` edges) with their gradients;
    the gradients of its input leaves."""
    pairs = [
        (out, grad) for out, grad in zip(outputs, grads, strict=True)
        if out is not None and grad is not None and (isinstance(out, GradientEdge) or out.requires_grad)
    ]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return [None if leaf is None else leaf.grad for leaf in inputs]


class _Slot:
    """One exchange of the lane: its rows once waited for."""

    __slots__ = ("pending", "rows")

    def __init__(self, pending: PendingExchange):
        self.pending = pending
        self.rows = None

    def result(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = self.pending.wait()
            self.pending = None
        return self.rows


class ExchangeLane:
    """The overlapped schedule's exchanges on the ep group, one in flight at a time (module doc)."""

    def __init__(self):
        self.in_flight: _Slot | None = None

    def start(self, dispatcher: AllToAllTokenDispatcher, rows, output_splits, input_splits) -> _Slot:
        self.drain()
        self.in_flight = _Slot(dispatcher.start_exchange(rows, output_splits, input_splits))
        return self.in_flight

    def drain(self) -> None:
        """Waits for the exchange in flight (before any other collective on the group)."""
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None


class MoELayerNodes:
    """One MoE block of one micro-batch as schedule nodes (module doc), forward then backward."""

    def __init__(self, block, rope, autocast: Callable, lane: ExchangeLane):
        self.block = block
        self.moe: MoE = block.ffn
        self.rope = rope  # (freqs_cis, attn_mask) of the micro-batch
        self.autocast = autocast
        self.lane = lane

    # Forward.
    def attention(self, x: torch.Tensor) -> None:
        block, moe = self.block, self.moe
        with record_function("moe_overlap.attention.forward"), self.autocast():
            self.x = detached_leaf(x)
            x, *rope = cast_forward_inputs(block, self.x, *self.rope)
            h, ffn_in = block.attention_part(x, *rope)
            routing = moe.route(ffn_in)
            self.shape = routing.shape
            # The shared experts stay after the permutation, where MoE.forward has them: run
            # before it (beside the exchange in flight) they change the order in which autograd
            # sums the tokens' gradients, and the result's last bits.
            self.lane.drain()  # the plan's counts all-to-all shares the group with the exchanges
            send_rows, self.ctx = moe.dispatcher.dispatch_preprocess(
                routing.tokens, routing.selected_experts, routing.top_scores
            )
            shared = moe.shared(routing.tokens)
            aux = moe.balance_loss(routing)
        self.attn_out = [h, send_rows, shared, routing.top_scores, aux]

    def dispatch(self) -> None:
        ctx = self.ctx
        send_rows = self.attn_out[1]
        self.sends_grad = send_rows.requires_grad
        self.dispatched = self.lane.start(self.moe.dispatcher, send_rows.detach(), ctx.output_splits, ctx.input_splits)
        self.attn_out[1] = backward_root(send_rows)

    def experts(self) -> None:
        recv_rows = self.dispatched.result()
        dispatcher = self.moe.dispatcher
        with record_function("moe_overlap.experts.forward"), self.autocast():
            self.recv_rows = recv_rows.requires_grad_(self.sends_grad)
            routed_x, num_tokens_per_expert = dispatcher.dispatch_postprocess(self.recv_rows, self.ctx)
            routed_out = self.moe.experts(routed_x, num_tokens_per_expert)
            self.back_rows = dispatcher.combine_preprocess(routed_out, self.ctx)
        self.dispatched = None

    def combine(self) -> None:
        ctx = self.ctx
        back_rows = self.back_rows
        self.combined = self.lane.start(self.moe.dispatcher, back_rows.detach(), ctx.input_splits, ctx.output_splits)
        self.back_rows = backward_root(back_rows)

    def post(self) -> torch.Tensor:
        """The block's output (the next node's input)."""
        h, _, shared, top_scores, _ = self.attn_out
        back = self.combined.result()
        moe = self.moe
        with record_function("moe_overlap.post.forward"), self.autocast():
            self.post_in = (
                back.requires_grad_(self.back_rows is not None),
                detached_leaf(h), detached_leaf(shared), detached_leaf(top_scores),
            )
            back, h, shared, top_scores = self.post_in
            out = moe.dispatcher.combine_postprocess(back, self.ctx, top_scores)
            self.y = self.block.tail(h, moe.output(out, shared, self.shape))
        self.combined = None
        return self.y

    # Backward, in reverse; ``aux_grad`` is the gradient of the block's balance loss (from the head).
    def post_backward(self, grad_y: torch.Tensor, aux_grad: torch.Tensor | None) -> None:
        with record_function("moe_overlap.post.backward"):
            self.post_grads = node_backward([self.y], [grad_y], self.post_in)
        self.aux_grad = aux_grad
        self.y = self.post_in = None

    def combine_backward(self) -> None:
        ctx = self.ctx
        grad_back = self.post_grads[0]
        self.combined = self.lane.start(self.moe.dispatcher, grad_back, ctx.output_splits, ctx.input_splits)

    def experts_backward(self) -> None:
        grad_back = self.combined.result()
        with record_function("moe_overlap.experts.backward"):
            (self.grad_recv,) = node_backward([self.back_rows], [grad_back], [self.recv_rows])
        self.combined = self.back_rows = self.recv_rows = None

    def dispatch_backward(self) -> None:
        ctx = self.ctx
        self.dispatched = self.lane.start(self.moe.dispatcher, self.grad_recv, ctx.input_splits, ctx.output_splits)
        self.grad_recv = None

    def attention_backward(self) -> torch.Tensor | None:
        """The gradient of the block's input."""
        grad_send = self.dispatched.result()
        _, grad_h, grad_shared, grad_top = self.post_grads
        with record_function("moe_overlap.attention.backward"):
            (grad_x,) = node_backward(self.attn_out, [grad_h, grad_send, grad_shared, grad_top, self.aux_grad], [self.x])
        self.dispatched = self.attn_out = self.post_grads = self.x = None
        return grad_x


def check_overlap_blocks(blocks: Sequence) -> None:
    """Refuses blocks the node schedule cannot run (``ValueError``): MoE blocks before dense ones,
    MoE without the all-to-all dispatcher, Engram blocks."""
    moe = [block.moe_enabled for block in blocks]
    if not any(moe) or moe.index(True) + sum(moe) != len(blocks):
        raise ValueError("moe_overlap needs the MoE blocks to follow the dense ones, with at least one MoE block")
    for block in blocks:
        if block.moe_enabled and not isinstance(block.ffn.dispatcher, AllToAllTokenDispatcher):
            raise ValueError("moe_overlap needs expert parallelism (the all-to-all dispatcher): set parallelism.ep > 1")
        if getattr(block, "engram", None) is not None:
            raise ValueError("moe_overlap does not run Engram blocks; drop engram.enable or parallelism.moe_overlap")


class NodeRun:
    """One micro-batch through a forward plan (``ForwardPlan``, models/deepseek_v3/model.py, which
    the model and a pipeline stage each give): the plan's pre part with the blocks before the first
    MoE block as one node ("pre"), each MoE block (``moe_blocks``) as ``MoELayerNodes``, the plan's
    head as one node, each with detached inputs. Subclasses say what the head's outputs become
    (``finish_forward``): the whole model with its loss (``MicroBatchNodes``, the step without PP)
    or one pipeline stage's outputs (trainer/parallel/pipeline_overlap.py, ``StageNodes``). The
    head's backward starts from ``loss`` where set, else from ``out`` with ``output_grads``."""

    def __init__(self, plan: ForwardPlan, autocast: Callable, lane: ExchangeLane, reduction: ManualReduction):
        self.plan, self.autocast, self.lane, self.reduction = plan, autocast, lane, reduction
        first_moe = next(i for i, block in enumerate(plan.blocks) if block.moe_enabled)
        self.dense, self.moe_blocks = plan.blocks[:first_moe], plan.blocks[first_moe:]
        self.loss = self.out = self.output_grads = None

    def finish_forward(self, out):
        """What the head node's forward returns, from the plan's head outputs ``out`` (inside the
        node, under its autocast)."""
        raise NotImplementedError

    def finish_backward(self) -> None:
        """After the pre node's backward (the plan is then dropped)."""

    # Forward.
    def forward_pre(self) -> None:
        """Sets ``h0`` (the first MoE block's input) and ``layers`` (the ``MoELayerNodes``)."""
        with record_function("moe_overlap.pre.forward"), self.autocast():
            h, self.carried = self.plan.pre()
            self.h0, self.aux0 = self.plan.run_blocks(h, self.dense)
        rope = (self.plan.freqs_cis, self.plan.attn_mask)
        self.layers = [MoELayerNodes(block, rope, self.autocast, self.lane) for block in self.moe_blocks]

    def forward_head(self):
        """Runs after the last MoE block's ``post``; what it returns, ``pair`` returns."""
        self.lane.drain()  # MTP's MoE exchanges synchronously
        with record_function("moe_overlap.head.forward"), self.autocast():
            self.head_in = [detached_leaf(t) for t in (self.layers[-1].y, self.aux0, *self.carried)]
            self.head_in += [detached_leaf(layer.attn_out[4]) for layer in self.layers]
            h, aux, *rest = self.head_in
            carried, auxes = rest[: len(self.carried)], rest[len(self.carried) :]
            # The balance losses summed in the order of the plan's run_blocks.
            for layer_aux in auxes:
                aux = aux + layer_aux
            return self.finish_forward(self.plan.head(h, aux, carried))

    def forward_layer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """MoE block ``index`` alone; its output."""
        layer = self.layers[index]
        layer.attention(x)
        layer.dispatch()
        layer.experts()
        layer.combine()
        return layer.post()

    def forward_alone(self):
        self.forward_pre()
        x = self.h0
        for j in range(len(self.layers)):
            x = self.forward_layer(j, x)
        return self.forward_head()

    # Backward.
    def backward_head(self) -> None:
        """Sets ``grad`` (the last MoE block's output gradient) and ``aux_grads`` (each MoE
        block's balance-loss gradient)."""
        self.lane.drain()  # MTP's MoE backward exchanges synchronously
        with record_function("moe_overlap.head.backward"):
            if self.loss is not None:  # the loss's own gradient, as torch's stage_backward takes it
                grads = node_backward([self.loss], [torch.ones_like(self.loss)], self.head_in)
            else:
                grads = node_backward(self.out, self.output_grads, self.head_in)
        depths = len(self.carried)
        self.grad, self.carried_grads, self.aux_grads = grads[0], grads[2 : 2 + depths], grads[2 + depths :]
        self.loss = self.out = self.output_grads = self.head_in = None

    def backward_pre(self) -> None:
        """The pre part's backward from ``grad`` (the first MoE block's input gradient)."""
        with record_function("moe_overlap.pre.backward"):
            node_backward([self.h0, *self.carried], [self.grad, *self.carried_grads], [])
        self.finish_backward()
        self.h0 = self.aux0 = self.grad = self.layers = self.carried = self.carried_grads = self.plan = None

    def backward_layer_end(self, layer: MoELayerNodes) -> None:
        """The block's input gradient; its FSDP unit's gradients are complete: reduced now."""
        self.grad = layer.attention_backward()
        self.reduction.unit_done(layer.block)

    def backward_layer_start(self, layer_index: int) -> MoELayerNodes:
        layer = self.layers[layer_index]
        layer.post_backward(self.grad, self.aux_grads[layer_index])
        layer.combine_backward()
        return layer

    def backward_layer(self, index: int) -> None:
        """MoE block ``index``'s backward alone."""
        layer = self.backward_layer_start(index)
        layer.experts_backward()
        layer.dispatch_backward()
        self.backward_layer_end(layer)

    def backward_alone(self) -> None:
        self.backward_head()
        for i in reversed(range(len(self.layers))):
            self.backward_layer(i)
        self.backward_pre()


class MicroBatchNodes(NodeRun):
    """One micro-batch through the model's plan, the head with the loss; ``objective`` and
    ``aux_scale`` as in ``ParallelStep.forward_backward``."""

    def __init__(
        self, model, mb: MicroBatch, objective: Callable, aux_scale: float, autocast: Callable, lane, reduction
    ):
        super().__init__(model.forward_plan(mb.inputs, mb.labels, **mb.model_kwargs), autocast, lane, reduction)
        self.targets, self.objective, self.aux_scale = mb.targets, objective, aux_scale

    def finish_forward(self, out: ModelOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss; returns its cross-entropy and MTP terms (detached)."""
        self.loss, ce, mtp = self.objective(out, self.targets, self.aux_scale)
        return ce.detach(), mtp.detach()


def pair(b: NodeRun, f: NodeRun):
    """``b``'s backward beside ``f``'s forward, MoE layer by MoE layer (module doc), over their
    common number of MoE layers; the rest of the longer one's layers run alone after. Returns
    ``f.forward_head()``'s result. The same order on every rank: it depends only on the layer
    counts."""
    f.forward_pre()
    b.backward_head()
    nf, nb = len(f.layers), len(b.layers)
    common = min(nf, nb)
    x = f.h0
    for j in range(common):
        fl = f.layers[j]
        bl = b.backward_layer_start(nb - 1 - j)  # post backward, combine backward starts
        if j > 0:
            x = f.layers[j - 1].post()
        fl.attention(x)  # beside the combine backward
        fl.dispatch()
        bl.experts_backward()  # beside the dispatch forward
        bl.dispatch_backward()
        fl.experts()  # beside the dispatch backward
        fl.combine()
        b.backward_layer_end(bl)  # beside the combine forward
    if common:
        x = f.layers[common - 1].post()
    for j in range(common, nf):
        x = f.forward_layer(j, x)
    for i in reversed(range(nb - common)):
        b.backward_layer(i)
    out = f.forward_head()
    b.backward_pre()
    return out


class MoEOverlapStep(ParallelStep):
    """``ParallelStep`` whose micro-batches run as (B_i, F_{i+1}) pairs under expert parallelism
    (``[parallelism] moe_overlap``): micro-batch 0's forward alone, then the pairs, then the last
    backward alone (Megatron's ``combined_1f1b_schedule_for_no_pipelining``). Two micro-batches'
    activations are alive at once. Under FSDP every unit stays gathered through the step and its
    gradients are reduced once per micro-batch as the plain step's hooks do: a block's right after
    its attention backward, the rest at the micro-batch's end (``gathered_through_step``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_overlap_blocks(list(self.model.layers.values()))

    def forward_backward(self, micro: list[MicroBatch], objective: Callable, autocast: Callable) -> tuple:
        device = micro[0].labels.device
        loss_total = torch.zeros((), device=device)
        mtp_total = torch.zeros((), device=device)
        lane = ExchangeLane()

        def add(terms):
            nonlocal loss_total, mtp_total
            loss_total += self.value(terms[0])
            mtp_total += self.value(terms[1])

        with gathered_through_step(self.model) as reduction:
            aux_scale = self.aux_scale(len(micro))
            nodes = [MicroBatchNodes(self.model, mb, objective, aux_scale, autocast, lane, reduction) for mb in micro]
            add(nodes[0].forward_alone())
            for b, f in zip(nodes, nodes[1:]):
                add(pair(b, f))
                reduction.micro_batch_done()
            nodes[-1].backward_alone()
            reduction.micro_batch_done()
        return loss_total, mtp_total
