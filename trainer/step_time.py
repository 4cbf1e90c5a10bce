"""A step-time model of a DeepSeek-V3 training layout: what the layout planner ranks by
(scripts/plan_layout.py; the model and its constants are written out in docs/performance.md,
"Step-time model").

    step time = (compute + exposed in-stage communication) x (1 + pipeline bubble)
                + the data-parallel communication that the compute does not hide

* compute: the step's training FLOPs per GPU (``flops_per_token`` x the step's tokens / GPUs, plus
  one more forward under full activation checkpointing) over ``peak_flops x compute_efficiency``;
* communication: for each collective, the bytes one GPU sends over the link its group crosses
  (NVLink inside a node, the network between nodes) at ``link bandwidth x comm_efficiency``.
  The expert all-to-all, tensor- and context-parallel collectives and the pipeline's
  point-to-point transfers sit on the critical path (exposed); FSDP's all-gathers and
  reduce-scatters and HSDP's all-reduce are prefetched or overlapped with the compute, up to
  ``fsdp_overlap`` of it;
* the bubble: the schedule's formula (``bubble_fraction``) with a backward split into input and
  weight gradients of ``backward_input_share`` and the rest.

Ranks are laid out as the trainer lays them out (trainer/parallel/parallel_dims.py): tp fastest,
then cp, dp_shard, dp_replicate, pp; the expert grid reads the data ranks as [efsdp, ep] with ep
fastest. A group crosses nodes when its span of consecutive ranks is larger than a node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.deepseek_v3 import DeepSeekV3ModelArgs, count_params, flops_per_token
from trainer.config.pipeline_layout import PipelinePlan


@dataclass(frozen=True)
class Hardware:
    """The constants of the step-time model, each overridable (``--set name=value``)."""

    peak_flops: float = 989e12
    """bf16 dense peak FLOP/s of one GPU: H100 SXM and H800 datasheets (989 TFLOP/s)."""
    compute_efficiency: float = 0.55
    """Share of the peak the step's compute reaches: between the 0.80 of a large bf16 matmul measured
    on an H100 (790 of 989 TFLOP/s, ../shared/design/REFERENCES.md) and the 0.33-0.39 MFU of
    Llama-3.1-8B on 8 H100 (torchtitan), which includes its exposed communication."""
    nvlink_bytes_per_s: float = 450e9
    """Per GPU and direction inside a node: NVLink 4 on H100 SXM, 900 GB/s both ways (NVIDIA)."""
    network_bytes_per_s: float = 50e9
    """Per GPU between nodes: one 400 Gb/s InfiniBand NDR adapter per GPU (DeepSeek-V3 report's
    H800 cluster; the common H100 DGX SuperPOD layout)."""
    comm_efficiency: float = 0.7
    """Share of a link's bandwidth a collective achieves (NCCL's bus bandwidth on large messages
    is 70-85% of the link's; assumed, not measured here)."""
    fsdp_overlap: float = 1.0
    """Share of the compute FSDP's prefetched all-gathers and overlapped reduce-scatters can hide
    behind (FSDP2 prefetches one block ahead)."""
    ep_overlap: float = 0.0
    """Share of the expert all-to-all hidden behind compute: none in this trainer (torch's
    DualPipeV runs overlapped forward/backward pairs one after the other, REFERENCES.md)."""
    backward_input_share: float = 0.6
    """Share of a backward that is the input gradient (the zero-bubble schedules' B; the rest is the
    weight gradient W): a linear layer's backward is two GEMMs of the forward's size (0.5), and
    attention's score and value products have input gradients only (assumed 0.6 over a block)."""
    gpus_per_node: int = 8

    def with_overrides(self, pairs: list[str]) -> Hardware:
        """``["name=value", ...]`` applied; ValueError naming an unknown constant."""
        fields = {f.name: f.type for f in dataclasses.fields(self)}
        changes = {}
        for pair in pairs:
            name, _, value = pair.partition("=")
            if name not in fields:
                raise ValueError(f"unknown step-time constant {name!r}; the constants: {', '.join(fields)}")
            changes[name] = int(value) if name == "gpus_per_node" else float(value)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Plan:
    """One layout to time: the degrees of ``[parallelism]``, its pipeline (``PipelinePlan``, the
    one reader of the ``pp*`` options; ``PipelinePlan()`` without pp) and the batch shape."""

    gpus: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    pipeline: PipelinePlan
    local_batch_size: int  # sequences per data rank per schedule run (or forward, without pp)
    accumulation: int  # schedule runs (or forwards) per optimizer step
    seq_len: int
    ac: str  # "none", "full" or "modules" (DeepSeek's set: norms, MLA up-projections, MoE activation)
    ep_as_cp: bool = False  # the ep ranks split each sequence (cp is 1)

    @property
    def pp(self) -> int:
        return self.pipeline.pp

    @property
    def context(self) -> int:
        """Ranks that split one sequence (``Layout.context_degree``)."""
        return self.ep if self.ep_as_cp else self.cp

    @property
    def dp(self) -> int:
        """Ranks that read different sequences (``Layout.dp_degree``)."""
        return self.dp_replicate * (self.dp_shard // self.ep if self.ep_as_cp else self.dp_shard)

    def field(self, name: str):
        """A field by its config name: the ``pp*`` ones are the pipeline's."""
        return getattr(self.pipeline if name.startswith("pp") else self, name)


def bubble_fraction(pipeline: PipelinePlan, b_share: float) -> float:
    """Idle time over useful time of one run of ``pipeline``'s schedule: the schedule's ``bubble``
    formula (trainer/config/schedules.py) with F, B, W one micro-batch's forward, input gradient
    and weight gradient on one stage, in units of F (B + W = 2, B = 2 ``b_share``)."""
    if not pipeline.enabled:
        return 0.0
    f, b = 1.0, 2.0 * b_share
    w = 2.0 - b
    return pipeline.facts.bubble(pipeline.pp, pipeline.pp_stages_per_rank, pipeline.pp_microbatches, f, b, w)


def _ring_seconds(nbytes: float, group: int, span: int, hw: Hardware) -> float:
    """One GPU's time to all-gather or reduce-scatter a ``nbytes`` buffer over a ring of ``group``
    GPUs whose consecutive members are ``span / group`` ranks apart: it sends (g - 1)/g of it, over
    the network when the group spans more than a node (the ring's slowest hop sets its pace)."""
    if group <= 1:
        return 0.0
    link = hw.network_bytes_per_s if span > hw.gpus_per_node else hw.nvlink_bytes_per_s
    return nbytes * (group - 1) / group / (link * hw.comm_efficiency)


def _all_to_all_seconds(nbytes: float, group: int, span: int, hw: Hardware) -> float:
    """One GPU sending ``nbytes`` spread evenly over a group of ``group``: the share for GPUs of its
    own node goes over NVLink, the rest over the network, both at once."""
    if group <= 1:
        return 0.0
    in_node = min(group, max(1, hw.gpus_per_node * group // span)) if span > hw.gpus_per_node else group
    local = nbytes * (in_node - 1) / group / (hw.nvlink_bytes_per_s * hw.comm_efficiency)
    remote = nbytes * (group - in_node) / group / (hw.network_bytes_per_s * hw.comm_efficiency)
    return max(local, remote)


@dataclass(frozen=True)
class ModelFigures:
    """What the step-time model reads of a model at a sequence length. Both counts build the model
    on the meta device (models/deepseek_v3/stats.py), most of a planner's time if done per layout."""

    flops_per_token: float
    params: int  # MTP included

    @classmethod
    def of(cls, args: DeepSeekV3ModelArgs, seq_len: int) -> ModelFigures:
        return cls(flops_per_token(args, seq_len), count_params(args, include_mtp=args.mtp_depth > 0)[0])


def _up_projection_flops(args: DeepSeekV3ModelArgs) -> float:
    """FLOPs per token that ``modules`` with DeepSeek's set adds in backward: every block's MLA
    up-projections (``wq_b``, ``wkv_b``) once more; the norms and the experts' activation it also
    recomputes are elementwise, and its all-to-alls are kept, not repeated."""
    per_block = args.q_lora_rank * args.n_heads * args.qk_head_dim
    per_block += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return 2 * per_block * (args.n_layers + args.mtp_depth)


def step_time(args: DeepSeekV3ModelArgs, plan: Plan, hw: Hardware, figures: ModelFigures | None = None) -> dict:
    """Seconds per optimizer step and its parts (compute, exposed communication, bubble);
    ``figures``: ``ModelFigures.of(args, plan.seq_len)`` where the caller times many layouts."""
    p, pipe = plan, plan.pipeline
    figures = figures or ModelFigures.of(args, p.seq_len)
    sequences = p.dp * p.local_batch_size * p.accumulation  # global batch
    tokens = sequences * p.seq_len
    recompute = {"full": 4 / 3, "modules": 1 + _up_projection_flops(args) / figures.flops_per_token}.get(p.ac, 1.0)
    flops = figures.flops_per_token * tokens * recompute / p.gpus
    compute = flops / (hw.peak_flops * hw.compute_efficiency)

    total = figures.params
    experts = (args.n_layers - args.n_dense_layers + args.mtp_depth) * args.moe.num_experts * 3 * args.dim * args.moe_inter_dim
    dense = total - experts
    # Spans in consecutive ranks: tp innermost, then cp, dp_shard, dp_replicate, pp.
    span_tp, span_cp = p.tp, p.tp * p.cp
    span_fsdp = p.tp * p.cp * p.dp_shard
    span_ep = p.tp * p.ep  # the expert grid [dp_replicate, efsdp, ep, tp]: ep right after tp
    efsdp = p.dp_shard * p.cp // p.ep
    span_efsdp = span_fsdp
    span_replicate = span_fsdp * p.dp_replicate

    # This GPU's share of the model (a pipeline stage's), as FSDP gathers it: bf16 up, fp32 down.
    stage_dense = dense / p.pp / p.tp
    stage_experts = experts / p.pp / p.ep
    gathers = (2 if p.ac == "none" else 3) * p.accumulation  # forward, backward (and the recompute's)
    if pipe.enabled and pipe.zero_bubble:
        gathers = 1  # the zero-bubble stages stay unsharded through the step
    fsdp = gathers * (_ring_seconds(stage_dense * 2, p.dp_shard * p.cp, span_fsdp, hw)
                      + _ring_seconds(stage_experts * 2, efsdp, span_efsdp, hw))
    fsdp += _ring_seconds(stage_dense * 4, p.dp_shard * p.cp, span_fsdp, hw)
    fsdp += _ring_seconds(stage_experts * 4, efsdp, span_efsdp, hw)
    # HSDP: each shard's fp32 gradient all-reduced over the replicas (a ring all-reduce: two passes).
    shard_grads = (stage_dense / (p.dp_shard * p.cp) + stage_experts / efsdp) * 4
    replicate = 2 * _ring_seconds(shard_grads, p.dp_replicate, span_replicate, hw)
    dp_comm = fsdp + replicate
    exposed_dp = max(0.0, dp_comm - hw.fsdp_overlap * compute)

    # Per GPU and step: the tokens its stage sees, every micro-batch of every run.
    local_tokens = p.local_batch_size * p.accumulation * p.seq_len / p.context
    moe_layers = (args.n_layers - args.n_dense_layers + args.mtp_depth) / p.pp
    all_layers = (args.n_layers + args.mtp_depth) / p.pp
    passes = 3 if p.ac == "full" else 2  # forward, backward (and the recompute's forward)
    # Dispatch and combine per pass: every (token, choice) row of dim in bf16, sent to its expert's rank.
    a2a_bytes = local_tokens / p.tp * args.moe.top_k * args.dim * 2
    ep = passes * 2 * moe_layers * _all_to_all_seconds(a2a_bytes, p.ep, span_ep, hw) * (1 - hw.ep_overlap)
    # Sequence-parallel TP: an all-gather and a reduce-scatter of the block's input per attention and FFN.
    tp = passes * 4 * all_layers * _ring_seconds(local_tokens * args.dim * 2, p.tp, span_tp, hw)
    # Context parallel (cp, or the ep ranks under ep_as_cp): MLA's compressed latent and rope key
    # of every rank's tokens, all-gathered per block in bf16 (its backward a reduce-scatter of the
    # same size; trainer/parallel/context_parallel.py), over the group that splits the sequence.
    latent = local_tokens * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    context_span = span_ep if p.ep_as_cp else span_cp
    cp = passes * all_layers * _ring_seconds(latent * p.context, p.context, context_span, hw)
    # Pipeline: each chunk's activations forward and their gradient back, per stage boundary held.
    act = local_tokens / p.tp * args.dim * 2
    pp = 2 * pipe.pp_stages_per_rank * act / (hw.network_bytes_per_s * hw.comm_efficiency) if pipe.enabled else 0.0
    in_stage = compute + ep + tp + cp + pp
    bubble = in_stage * bubble_fraction(pipe, hw.backward_input_share)
    seconds = in_stage + bubble + exposed_dp
    comm = ep + tp + cp + pp + exposed_dp
    return {
        "seconds": seconds, "compute_s": compute, "comm_s": comm, "bubble_s": bubble,
        "comm_share": comm / seconds, "bubble_share": bubble / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / p.gpus,
        "mfu": flops / recompute / seconds / hw.peak_flops,
        "exposed": {"ep_all_to_all": ep, "tp": tp, "cp": cp, "pp_p2p": pp, "fsdp_hsdp": exposed_dp},
    }
