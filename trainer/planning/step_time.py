"""A step-time model of a DeepSeek-V3 training layout: what the layout planner ranks by
(scripts/plan_layout.py; the model and its constants are written out in docs/performance.md,
"Step-time model").

    step time = (compute + exposed in-stage communication) x (1 + pipeline bubble)
                + the data-parallel communication that the compute does not hide

* compute: the step's training FLOPs per GPU (``flops_per_token`` x the step's tokens / GPUs, plus
  the forward FLOPs that activation checkpointing recomputes, ``recompute_flops``: every block's
  under ``full``, the checkpointed blocks' under ``selective``, none under ``op``, the named parts'
  under ``modules``, once per backward pass that runs the block:
  twice where a zero-bubble schedule splits it, ``recomputes``) over ``peak_flops x compute_efficiency``;
* communication: for each collective, the bytes one GPU sends over the link its group crosses
  (NVLink inside a node, the network between nodes) at ``link bandwidth x comm_efficiency``.
  The expert all-to-all, tensor- and context-parallel collectives and the pipeline's
  point-to-point transfers sit on the critical path (exposed); FSDP's all-gathers and
  reduce-scatters and HSDP's all-reduce are prefetched or overlapped with the compute, up to
  ``fsdp_overlap`` of it;
* the bubble: the schedule's formula (``bubble_fraction``) with a backward split into input and
  weight gradients of ``backward_input_share`` and the rest;
* DualPipeV with ``moe_overlap``: its overlapped forward/backward pairs hide ``moe_overlap_hiding``
  (measured, benchmarks/RESULTS.md) of what they could, the lesser of the pairs' all-to-all and
  their compute (``overlapped_pairs``).

Ranks are laid out as the trainer lays them out (trainer/parallel/parallel_dims.py): tp fastest,
then cp, dp_shard, dp_replicate, pp; the expert grid reads the data ranks as [efsdp, ep] with ep
fastest. A group crosses nodes when its span of consecutive ranks is larger than a node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.deepseek_v3 import DeepSeekV3ModelArgs, count_params, flops_per_token
from models.deepseek_v3.stats import stage_unit_costs
from trainer.config.activation_checkpoint import recompute_module_set
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.planning.activation_memory import checkpointed_blocks


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
    """Share of the expert all-to-all hidden behind compute in every layout: none (torch's DualPipeV
    runs its overlapped forward/backward pairs one after the other, REFERENCES.md); what
    ``moe_overlap`` hides is ``moe_overlap_hiding``'s."""
    moe_overlap_hiding: float = 0.4
    """Share of the ideal that DualPipeV's pairs hide under ``moe_overlap`` (the ideal: each paired
    exchange hidden up to the other micro-batch's compute beside it). Measured on CPU with injected
    delays (benchmarks/RESULTS.md, "Hiding the MoE all-to-all under DualPipeV", runs 2 and 3, seq
    512): 0.39-0.46 by step times, 0.66-0.90 by the trace; the step times' lower end, as no GPU
    figure exists."""
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
    ac: str  # "none", "full", "modules" (the parts of ``recompute_modules``), "op" or "selective"
    ep_as_cp: bool = False  # the ep ranks split each sequence (cp is 1)
    recompute_modules: tuple[str, ...] = ("deepseek",)  # ``modules``' parts, names or sets as the config
    moe_overlap: bool = False  # ``[parallelism] moe_overlap`` (DualPipeV's pairs hide the all-to-all)
    selective_every: int = 2  # ``selective``: every N-th block a pp rank holds checkpointed

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
    and weight gradient on one stage, in units of F (B + W = 2, B = 2 ``b_share``). DualPipeV's
    F&B pair counts as F + B (torch runs it one after the other); what ``moe_overlap`` hides is
    taken off the all-to-all (``step_time``)."""
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
    """What the step-time model reads of a model at a sequence length. The counts build the model
    on the meta device (models/deepseek_v3/stats.py), most of a planner's time if done per layout."""

    flops_per_token: float
    params: int  # MTP included
    block_forward: tuple[float, ...]  # one forward of each main block, then of each MTP module's block
    costs: PipelineCosts  # the trainer's stage split reads them

    @classmethod
    def of(cls, args: DeepSeekV3ModelArgs, seq_len: int) -> ModelFigures:
        costs = stage_unit_costs(args, seq_len)
        # A block's training FLOPs are three forwards. An MTP module's block is a MoE block of the
        # main blocks' shape (models/deepseek_v3/mtp.py), as the last main block is.
        forward = tuple(c / 3 for c in costs["blocks"]) + (costs["blocks"][-1] / 3,) * args.mtp_depth
        params = count_params(args, include_mtp=args.mtp_depth > 0)[0]
        return cls(flops_per_token(args, seq_len), params, forward, PipelineCosts(**costs))

    @property
    def block_forward_flops(self) -> float:
        """One forward of every block, MTP's included: what ``full`` recomputes."""
        return sum(self.block_forward)


def part_flops(args: DeepSeekV3ModelArgs, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of each ``recompute_modules`` part over every block (MTP's
    included), by what trainer/parallel/activation_checkpoint.py recomputes for it; the FLOPs
    convention of ``flops_per_token`` (2 per weight, the attention scores unhalved). ``layernorm``
    and ``moe_act`` are elementwise (no FLOPs in the convention); ``moe`` holds its shared experts."""
    m = args.moe
    blocks = args.n_layers + args.mtp_depth
    moe_blocks = args.n_layers - args.n_dense_layers + args.mtp_depth
    up = args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_b
    if args.q_lora_rank:
        up += args.q_lora_rank * args.n_heads * args.qk_head_dim  # wq_b (without a q latent, wq is no part)
    shared = 2 * 3 * args.dim * args.moe_inter_dim * m.num_shared_experts * moe_blocks
    return {
        "layernorm": 0.0,
        "mla_up_proj": 2 * up * blocks,
        "core_attn": 2 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len * blocks,
        "moe_act": 0.0,
        "mlp": 2 * 3 * args.dim * args.inter_dim * args.n_dense_layers,
        "shared_experts": shared,
        "moe": 2 * (args.dim * m.num_experts + 3 * args.dim * args.moe_inter_dim * m.top_k) * moe_blocks + shared,
    }


def _selective_blocks(args: DeepSeekV3ModelArgs, plan: Plan, figures: ModelFigures) -> list[int]:
    """The main blocks ``selective`` checkpoints: every ``selective_every``-th of each pp rank's,
    from its first, in the model's order (trainer/parallel/activation_checkpoint.py counts the
    blocks of the model a rank holds, all its stages' together; the estimator's own rule,
    trainer/planning/activation_memory.py ``checkpointed_blocks``); MTP's blocks never."""
    pipe = plan.pipeline
    held = [range(args.n_layers)]
    if pipe.enabled:
        specs = pipe.split(args.n_layers, args.mtp_depth, figures.costs)
        held = [sorted(i for s in pipe.rank_stages(specs, r) for i in s.layers) for r in range(pipe.pp)]
    chosen = (checkpointed_blocks("selective", len(layers), len(layers), plan.selective_every) for layers in held)
    return [i for layers, flags in zip(held, chosen) for i, flag in zip(layers, flags) if flag]


def recompute_flops(args: DeepSeekV3ModelArgs, plan: Plan, figures: ModelFigures) -> float:
    """Forward FLOPs per token that one recomputation of the checkpointed blocks runs: none without
    checkpointing, a whole forward of every block under ``full`` and of the checkpointed ones under
    ``selective``, none under ``op`` (it keeps every matmul's and attention's output and recomputes
    elementwise ops only), the chosen parts' under ``modules`` (``shared_experts`` counted once
    where ``moe`` is chosen too)."""
    if plan.ac in ("none", "op"):
        return 0.0
    if plan.ac == "full":
        return figures.block_forward_flops
    if plan.ac == "selective":
        return sum(figures.block_forward[i] for i in _selective_blocks(args, plan, figures))
    if plan.ac != "modules":
        raise ValueError(f"the step-time model times AC none, full, selective, op and modules, not {plan.ac!r}")
    parts = recompute_module_set(plan.recompute_modules)
    flops = part_flops(args, plan.seq_len)
    return sum(flops[p] for p in parts if not (p == "shared_experts" and "moe" in parts))


def _dualpipev_counts(pp: int, microbatches: int) -> list[tuple[int, int]]:
    """Per rank of torch's DualPipeV (``ScheduleDualPipeV._calculate_single_rank_operations``, torch
    2.13; tests/unit/test_layout_planner.py counts its actions): its ``OVERLAP_F_B`` pairs and its
    split backwards (``BACKWARD_INPUT``, each with a later ``BACKWARD_WEIGHT``) of its 2 x
    ``microbatches``; the other backwards run whole. Rank r pairs in its main step (two a round,
    but the last rank's first) and in its step 5; it splits in its step 3, and in steps 6 and 7
    from the middle of step 6 on (stage 1 first on odd ranks)."""
    counts = []
    for r in range(pp):
        pairs = 2 * (microbatches - 2 * pp + r + 1) - (r == pp - 1) + (pp - r - 1)
        split = 2 * (pp - r - 1) + 2 * (r + 1 - (r + 1) // 2) - (r % 2 == 0)
        counts.append((pairs, split))
    return counts


def recomputes(pipeline: PipelinePlan) -> float:
    """Recomputations of a checkpointed block per micro-batch, averaged over the pipeline ranks:
    one per backward pass that runs the block. A split backward (input, then weight gradients)
    recomputes it for each (trainer/parallel/weight_pass.py ``weight_pass``: at most once more):
    every backward of ZBVZeroBubble and InterleavedZeroBubble, DualPipeV's split ones."""
    if not (pipeline.enabled and pipeline.zero_bubble):
        return 1.0
    if not pipeline.facts.moe_overlap:  # no OVERLAP_F_B pairs, whose backwards run whole: all split
        return 2.0
    counts = _dualpipev_counts(pipeline.pp, pipeline.pp_microbatches)
    return 1.0 + sum(split for _, split in counts) / len(counts) / (2 * pipeline.pp_microbatches)


def overlapped_pairs(pipeline: PipelinePlan) -> float:
    """Share of a rank's forwards (and of its backwards) that DualPipeV runs in overlapped pairs,
    averaged over the pipeline ranks; 0 under any other schedule."""
    if not pipeline.enabled or not pipeline.facts.moe_overlap:  # the schedules with OVERLAP_F_B actions
        return 0.0
    counts = _dualpipev_counts(pipeline.pp, pipeline.pp_microbatches)
    return sum(pairs for pairs, _ in counts) / len(counts) / (2 * pipeline.pp_microbatches)


def step_time(args: DeepSeekV3ModelArgs, plan: Plan, hw: Hardware, figures: ModelFigures | None = None) -> dict:
    """Seconds per optimizer step and its parts (compute, exposed communication, bubble);
    ``figures``: ``ModelFigures.of(args, plan.seq_len)`` where the caller times many layouts."""
    p, pipe = plan, plan.pipeline
    figures = figures or ModelFigures.of(args, p.seq_len)
    sequences = p.dp * p.local_batch_size * p.accumulation  # global batch
    tokens = sequences * p.seq_len
    rounds = recomputes(pipe) if p.ac != "none" else 0.0  # recomputations per micro-batch
    recompute = 1 + rounds * recompute_flops(args, p, figures) / figures.flops_per_token
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
    # Forward, backward and the recomputations of the blocks that repeat their exchanges: every
    # block under full, the checkpointed ones under selective (modules and op keep their outputs).
    repeated = {"full": 1.0}.get(p.ac, 0.0)
    if p.ac == "selective":
        repeated = len(_selective_blocks(args, p, figures)) / (args.n_layers + args.mtp_depth)
    passes = 2 + rounds * repeated
    # Dispatch and combine per pass: every (token, choice) row of dim in bf16, sent to its expert's rank.
    a2a_bytes = local_tokens / p.tp * args.moe.top_k * args.dim * 2
    ep = passes * 2 * moe_layers * _all_to_all_seconds(a2a_bytes, p.ep, span_ep, hw) * (1 - hw.ep_overlap)
    if p.moe_overlap and pipe.enabled and pipe.facts.moe_overlap:
        # The pairs' exchanges run beside the other micro-batch's compute: ideally hidden up to it.
        paired = overlapped_pairs(pipe)
        ep -= hw.moe_overlap_hiding * min(paired * ep, paired * compute)
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
