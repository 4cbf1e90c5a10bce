"""Per-device memory estimate of a DeepSeek-V3 training layout, and the fit check before a run.

Model states follow this trainer's layout: FSDP2 shards non-expert weights over dp_shard x cp;
tensor parallelism splits attention heads, dense / shared-expert FFNs, embedding and head, while
`wqkv_a` (or `wkv_a`), norms and the router stay replicated over tp; routed experts are split over ep
and FSDP-sharded over (dp_shard x cp) / ep, and replicated over tp (docs/parallelism.md). fp32
master weights, fp32 gradients (FSDP reduces in fp32), AdamW's two moments (8 bytes per parameter
in fp32, 4 with `optimizer.state_dtype = "bfloat16"`); under `optimizer.name = "muon"` the block
matrices hold one momentum buffer instead (4 or 2 bytes), the rest AdamW's two moments.
Activations are estimates of the tensors autograd saves per token and layer
(listed in trainer/planning/activation_memory.py `layer_activation_bytes`), in bf16 (mixed precision bfloat16) or fp32;
`ac="full"` keeps each block's input plus one block's activations during recompute; `ac="modules"`
keeps what its per-op policy keeps (`block_activation_bytes`) plus one block's recomputed rest;
`ac="op"` is `modules` with the cheap parts (norms, the experts' SwiGLU) chosen, the same policy;
`ac="selective"` is `full` for every `selective_every`-th block of each pipeline rank (all its
stages' layers in order) and `none` for the rest.
The peak: gradients are freed at every step's end (`zero_grad(set_to_none=True)`) and allocated
during backward while the saved activations are released, so the total holds parameters,
optimizer states and the largest of (gradients + the embedding / head gradient temporaries),
(activations + logits + FSDP buffers + bf16 weight copies + the attention mask) and the late
backward (the first blocks': nearly all gradients, one block's activations and FSDP buffers, the
logits the step keeps through ``loss.backward()``, and under FSDP the root's unsharded embedding /
head and their unsharded gradients, in the compute dtype: the root is not resharded after forward).

Pipeline stages under FSDP (``pp > 1``, ``dp_shard x cp > 1``): torch's schedules reduce a stage's
gradients once per step (its ``REDUCE_GRAD``), so every unit of the rank's stages accumulates
unsharded fp32 gradients through the step, and every backward but the step's last runs with
``set_reshard_after_backward(False)``: from a stage's first backward on its parameters stay
unsharded in the compute dtype (the zero-bubble schedules, ``ZERO_BUBBLE_SCHEDULES``, from the first
forward on: ``reshard_after_forward=False``, the condition of their split backward): ZeRO-2 within
a step. Those parameters replace the all-gathered blocks of the FSDP buffers; one block's fp32
reduce-scatter buffer belongs to ``REDUCE_GRAD``, after the last backward. Both are counted outside
the forward / backward maximum, as are the stages' receive buffers, which torch allocates for every
micro-batch of the step up front, and the outputs of the in-flight micro-batches. A stage's
backward temporaries (the embedding and head gradients; in the compute dtype under FSDP, where the
fp32 ones are the accumulators) arise while the other in-flight micro-batches' activations and the
logits are held: the late-backward side; the micro-batches in flight follow each schedule's
warm-up (``_in_flight``; all measured by the dry run, trainer/dry_run.py). A rank that runs all
its forwards before its first backward (the schedule's ``warmup``: 1F1B's rank r at pp - r >=
micro-batches, GPipe, LoopedBFS) peaks either then, its stages sharded (one block gathered ahead,
the root unsharded) with no accumulator yet, or once the accumulators and unsharded stages exist,
with one micro-batch fewer in flight: the larger of the two.

A zero-bubble schedule with full activation checkpointing: the weight pass of a stage recomputes
each checkpointed block once (trainer/parallel/weight_pass.py `weight_pass`: torch's one
``autograd.grad`` per parameter group, sharing one recomputation) and keeps what it recomputed but
did not use until the stage's graph is freed at the pass's end. At that point the rank holds up to
one copy of the stage's activations: ``ZB_WEIGHT_PASS_RECOMPUTES`` (one) times the largest stage's
blocks without checkpointing, on top of the checkpointed in-flight micro-batches. What the weight
gradients use is freed as the pass goes, so this errs high (the debug model's ZBVZeroBubble rank 0
holds 0.6 of a copy by the dry run; torch's own weight pass, recomputing per group, held 4.0).

Late in a DualPipeV step a rank holds weight passes waiting (``weight_pass_drain``: r + 1 on pp
rank r, at most ``pp_max_deferred_weight_passes``), each the gradient at every use of a weight of
its stage (``weight_grad_output_bytes``), beside the micro-batches of its first stage still in
flight: a second candidate for the late backward (traced in benchmarks/RESULTS.md, "Waiting
weight passes").

On CUDA three more terms (docs/performance.md "Memory estimate"):
* bf16 compute weights: with bf16 mixed precision and no FSDP sharding, one bf16 copy of every
  non-embedding parameter lives through forward and backward (autocast's weight cache, or FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16)`` unsharded parameters at dp 1). With FSDP sharding
  the unsharded bf16 blocks are the FSDP buffers already counted.
* the caching allocator's rounding of each parameter-like tensor (parameter, gradient, two
  moments, bf16 copy): sizes round up to 512 bytes, and a tensor over 10 MiB gets a segment
  rounded up to 2 MiB that keeps the remainder when it is 1 MiB or less (not split off).
* the cuBLAS workspace: 32 MiB per stream (``CUBLAS_WORKSPACE_CONFIG`` default :4096:8 on Hopper).
Not modelled: CUDA context and NCCL buffers (outside torch's allocator), fragmentation between
steps, temporary buffers inside kernels. Checked against the debug flavor's measured peak on CPU
(tests/benchmarks/test_step_bench.py, within 15%); on CUDA through benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from models.deepseek_v3 import DeepSeekV3ModelArgs, get_flavor
from models.deepseek_v3.stats import stage_unit_costs
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.planning.activation_memory import (
    block_activation_bytes,
    checkpointed_blocks,
    layer_activation_bytes,
    recomputed_parts,
    weight_grad_output_bytes,
)

GiB = 1024**3
ACT_BYTES = {"bfloat16": 2, "float32": 4}  # activations follow training.mixed_precision_param
STATE_BYTES = {"params": 4, "grads": 4}  # fp32 master weights and gradients
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # per optimizer-state element
# A zero-bubble schedule with full activation checkpointing: the recomputed activations of a stage's
# weight pass, in units of that stage's blocks' activations without checkpointing: one recomputation
# of each block, all of it held (module docstring).
ZB_WEIGHT_PASS_RECOMPUTES = 1


def optimizer_state_bytes(local_params: float, local_muon_params: float, state_dtype: str) -> float:
    """Bytes of optimizer state: one momentum buffer per Muon parameter, AdamW's two moments for the rest."""
    element = STATE_DTYPE_BYTES[state_dtype]
    return (local_params - local_muon_params) * 2 * element + local_muon_params * element


def _block_params(a: DeepSeekV3ModelArgs, moe: bool) -> dict[str, int]:
    """Parameters of one block split by how they are laid out: tp-split, tp-replicated, routed experts."""
    d, h = a.dim, a.n_heads
    split = h * a.v_head_dim * d + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)  # wo, wkv_b
    repl = _replicated_matrices(a) + a.kv_lora_rank + 2 * d  # wkv_a (wqkv_a), kv_norm, 2 norms
    if a.q_lora_rank == 0:
        split += d * h * a.qk_head_dim
    else:
        split += a.q_lora_rank * h * a.qk_head_dim
        repl += a.q_lora_rank
    experts = 0
    if moe:
        m = a.moe
        repl += m.num_experts * d  # router
        split += 3 * d * m.num_shared_experts * a.moe_inter_dim
        experts = m.num_experts * 3 * d * a.moe_inter_dim
    else:
        split += 3 * d * a.inter_dim
    return {"tp_split": split, "tp_replicated": repl, "experts": experts}


def _replicated_matrices(a: DeepSeekV3ModelArgs) -> int:
    """A block's tp-replicated matrix parameters (`wkv_a`, or `wqkv_a` with the query bottleneck):
    Muon's, unlike the other replicated parameters (norms, router)."""
    return a.dim * (a.kv_lora_rank + a.qk_rope_head_dim + a.q_lora_rank)


def weight_pass_drain(plan: PipelinePlan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where pp rank ``rank`` keeps the most weight passes waiting, per stage of the rank (in stage
    order): (waiting weight passes, micro-batches still in flight), each one micro-batch's; None
    where no weight pass waits for long. DualPipeV's rank r ends its step 6 (torch's schedule,
    B1B0) with r + 1 input passes whose weight passes run in its step 8, alternating between its
    second and its first stage and ending on the first, while pp - r - 1 micro-batches of its
    first stage wait for their backward (step 7) and none of its second;
    ``pp_max_deferred_weight_passes`` keeps the newest of the waiting ones. ZBVZeroBubble and
    InterleavedZeroBubble run each weight pass soon after its input pass (not modelled: None)."""
    if plan.pp_schedule != "DualPipeV":
        return None
    waiting = min(rank + 1, plan.pp_microbatches)
    cap = plan.pp_max_deferred_weight_passes
    waiting = waiting if cap < 0 else min(waiting, cap)
    return ((waiting + 1) // 2, waiting // 2), (plan.pp - rank - 1, 0)


MiB = 1024**2
CUBLAS_WORKSPACE_BYTES = 32 * MiB  # per stream: CUBLAS_WORKSPACE_CONFIG default ":4096:8" (8 x 4 MiB)
_SMALL_ROUND = 512  # CUDA caching allocator: every size rounds up to 512 bytes
_LARGE_SEGMENT = 2 * MiB  # allocations over 10 MiB get segments rounded up to 2 MiB ...
_SPLIT_MIN = 1 * MiB  # ... whose remainder is split off only when larger than 1 MiB
_LARGE_ALLOC = 10 * MiB


def cuda_block_bytes(nbytes: float) -> int:
    """Bytes the CUDA caching allocator books for one fresh allocation of ``nbytes``."""
    rounded = max(_SMALL_ROUND, math.ceil(nbytes / _SMALL_ROUND) * _SMALL_ROUND)
    if rounded <= _LARGE_ALLOC:
        return rounded
    segment = math.ceil(rounded / _LARGE_SEGMENT) * _LARGE_SEGMENT
    return segment if segment - rounded <= _SPLIT_MIN else rounded


def _block_tensor_numels(a: DeepSeekV3ModelArgs, moe: bool) -> list[int]:
    """Element counts of one block's parameter tensors, unsharded (for the allocator rounding)."""
    d, h = a.dim, a.n_heads
    t = [d, d, a.kv_lora_rank, a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim), h * a.v_head_dim * d]
    if a.q_lora_rank == 0:  # wq, wkv_a
        t += [d * h * a.qk_head_dim, d * (a.kv_lora_rank + a.qk_rope_head_dim)]
    else:  # wqkv_a (wq_a and wkv_a stacked: one tensor), q_norm, wq_b
        t += [d * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim), a.q_lora_rank, a.q_lora_rank * h * a.qk_head_dim]
    if moe:
        m = a.moe
        t += [m.num_experts * d] + [m.num_experts * d * a.moe_inter_dim] * 3
        t += [d * m.num_shared_experts * a.moe_inter_dim] * 3 if m.num_shared_experts else []
    else:
        t += [d * a.inter_dim] * 3
    return t


def estimate(
    flavor: str, dp_shard: int, ep: int, tp: int, cp: int, seq_len: int, local_batch_size: int, ac: str,
    mixed_precision: str = "bfloat16", model_args: DeepSeekV3ModelArgs | None = None, device_type: str = "cuda",
    block_causal_sdpa: bool = False, pipeline: PipelinePlan | None = None, optimizer: str = "AdamW",
    state_dtype: str = "float32", stage_costs: PipelineCosts | None = None, ep_as_cp: bool = False,
    recompute_modules: tuple[str, ...] = ("deepseek",), selective_every: int = 2, cache: EstimateCache | None = None,
) -> dict:
    """Peak bytes per device (GiB, by term). ``model_args`` replaces the flavor's preset (e.g. the
    trainer's, with the tokenizer's vocabulary); ``device_type`` "cuda" adds the CUDA terms;
    ``block_causal_sdpa``: the sdpa backend's dense [B, 1, S, S] block-causal mask; ``optimizer``
    and ``state_dtype``: ``[optimizer] name`` and ``state_dtype``.

    With a ``pipeline`` of ``pp`` > 1 the stages are split as the trainer splits them (by training
    FLOPs, unless ``pp_layout``); every pipeline rank holds its stages' blocks (the first the embedding, the
    last the head, MTP and, without a V schedule, an embedding replica) and keeps the activations
    of the micro-batches its schedule keeps in flight (``_in_flight``); a
    zero-bubble schedule under FSDP adds its unsharded stages (module docstring). The estimate is
    the fullest rank's, with every rank's total in ``gib_per_pp_rank``. ``stage_costs``: the
    model's ``stage_unit_costs`` at ``seq_len`` when the caller has them (the layout planner
    estimates many layouts of one model; computing them builds the model on the meta device).
    ``ep_as_cp``: the ep ranks split each sequence as ``cp`` ranks would (``cp`` is then 1).
    ``recompute_modules``: the parts ``ac="modules"`` recomputes (names or sets, as the config);
    ``selective_every``: ``ac="selective"`` checkpoints every N-th layer of each pipeline rank.
    ``cache``: an ``EstimateCache`` of this model (``model_args``) that many estimates share."""
    a = model_args or get_flavor(flavor)
    if cache is not None and cache.model_args is not a:
        raise ValueError("estimate: the cache belongs to another model; pass the cache's model_args")
    plan = pipeline or PipelinePlan()
    pp = plan.pp
    fsdp = dp_shard * cp
    if ep_as_cp:
        cp = ep  # the sequence split from here on; FSDP keeps dp_shard x 1
    if seq_len % (2 * cp) and cp > 1:
        raise ValueError(f"seq_len must be a multiple of 2 x the context degree = {2 * cp}")
    if fsdp % ep:
        raise ValueError(f"ep={ep} must divide dp_shard x cp = {fsdp}")
    layout = {"dp_shard": dp_shard, "cp": fsdp // dp_shard, "tp": tp, "ep": ep, "ep_as_cp": ep_as_cp,
              "efsdp": fsdp // ep, "pp": pp, "gpus": pp * fsdp * tp, "seq_len": seq_len, "local_batch_size": local_batch_size, "ac": ac,
              "mixed_precision": mixed_precision, "device_type": device_type}
    share = dict(fsdp=fsdp, ep=ep, tp=tp, cp=cp, seq_len=seq_len, ac=ac, mixed_precision=mixed_precision,
                 device_type=device_type, block_causal_sdpa=block_causal_sdpa, optimizer=optimizer,
                 state_dtype=state_dtype, parts=recomputed_parts(ac, recompute_modules), selective_every=selective_every,
                 cache=cache)
    if pp == 1:
        result = _estimate_share(a, list(range(a.n_layers)), True, True, True, local_batch_size, 1, **share)
        return {"flavor": flavor, "layout": layout, **result}
    micro = plan.pp_microbatches
    if local_batch_size % micro:
        raise ValueError(f"pp_microbatches={micro} must divide local_batch_size={local_batch_size}")
    ranks, shares = [], {}
    for key, (layers, embed, last, in_flight, stages) in _memo(cache, _pipeline_ranks, a, plan, seq_len, stage_costs):
        if key not in shares:
            shares[key] = _estimate_share(a, layers, embed, last, last, local_batch_size // micro, in_flight, **stages,
                                          **share)
        ranks.append(shares[key])
    worst = max(ranks, key=lambda r: r["gib"]["total"])
    layout.update(pp_schedule=plan.pp_schedule, pp_stages_per_rank=plan.pp_stages_per_rank, pp_microbatches=micro)
    return {
        "flavor": flavor, "layout": layout, **worst,
        "gib_per_pp_rank": [r["gib"]["total"] for r in ranks],
    }


def _pipeline_ranks(
    a: DeepSeekV3ModelArgs, plan: PipelinePlan, seq_len: int, stage_costs: PipelineCosts | None
) -> list[tuple[tuple, tuple]]:
    """Per pp rank of ``plan``: the key of its share (ranks with equal keys share one estimate) and
    the arguments of ``_estimate_share`` that its stages give (layers, embedding, head and MTP,
    micro-batches in flight, and the pipeline's keywords)."""
    pp, micro = plan.pp, plan.pp_microbatches
    specs = plan.split(a.n_layers, a.mtp_depth, stage_costs or PipelineCosts(**stage_unit_costs(a, seq_len)))
    ranks = []
    for rank in range(pp):
        mine = plan.rank_stages(specs, rank)
        first, last = any(s.first for s in mine), any(s.last for s in mine)
        layers, in_flight = [i for s in mine for i in s.layers], _in_flight(plan, rank)
        stage_blocks = [len(s.layers) + (a.mtp_depth if s.last else 0) for s in mine]
        stage_io = (sum(not s.first for s in mine) + sum(not s.last for s in mine), sum(not s.last for s in mine))
        # `_estimate_share` reads the blocks by kind only: ranks with the same kinds, ends, stages and
        # in-flight count (a zero-bubble or V schedule's middle ranks) share one estimate.
        # The first stage's input pass does not run (torch: no input gradient), so its waiting weight
        # pass holds its graph, the in-flight activations, and no output gradients.
        drain = weight_pass_drain(plan, rank)
        warmup = plan.facts.warmup
        forwards_first = warmup is not None and warmup(pp, micro, plan.pp_stages_per_rank, rank) >= micro
        if drain:
            drain = (tuple(0 if s.first else n for s, n in zip(mine, drain[0])), drain[1])
        key = (tuple(i >= a.n_dense_layers for i in layers), first, last, in_flight, tuple(stage_blocks), stage_io,
               drain, forwards_first)
        stages = dict(pipelined=True, zero_bubble=plan.zero_bubble, stage_blocks=stage_blocks, stage_io=stage_io,
                      micro=micro, drain=drain, forwards_first=forwards_first)
        ranks.append((key, (layers, first or (last and a.mtp_depth > 0), last, in_flight, stages)))
    return ranks


def _in_flight(plan: PipelinePlan, rank: int) -> float:
    """Micro-batches whose activations pp rank ``rank`` holds at once, in units of all its stages'
    (a looped schedule's stage chunk is 1/v of them): the schedule's ``in_flight``
    (trainer/config/schedules.py, from torch's warm-up of each schedule)."""
    return plan.facts.in_flight(plan.pp, plan.pp_microbatches, plan.pp_stages_per_rank, rank)


def _estimate_share(
    a: DeepSeekV3ModelArgs, layers: list[int], embed: bool, head: bool, mtp: bool, rows: int, in_flight: float, *,
    fsdp: int, ep: int, tp: int, cp: int, seq_len: int, ac: str, mixed_precision: str, device_type: str,
    block_causal_sdpa: bool, optimizer: str, state_dtype: str, parts: tuple[str, ...] = (), selective_every: int = 2,
    pipelined: bool = False,
    zero_bubble: bool = False,
    stage_blocks: list[int] | None = None, stage_io: tuple[int, int] = (0, 0), micro: int = 1,
    drain: tuple[tuple[int, ...], tuple[int, ...]] | None = None, forwards_first: bool = False,
    cache: EstimateCache | None = None,
) -> dict:
    """One device's estimate when it holds ``layers`` (and the embedding / the head / the MTP
    modules where set), running micro-batches of ``rows`` sequences, ``in_flight`` of them at once;
    ``pipelined``: they are pipeline stages (fp32 gradient accumulators through the step under FSDP);
    ``zero_bubble``: of a zero-bubble schedule (their parameters unsharded through the step too);
    ``stage_blocks``: how many of the blocks (then MTP modules) each of those stages runs, in order;
    ``stage_io``: how many activation-sized buffers its stages receive per micro-batch (the input of a
    stage not first, the output gradient of one not last), and how many of them are not last (their
    output stays until its backward); ``micro``: the step's micro-batches; ``drain``: per stage,
    the weight passes waiting and the micro-batches in flight where most wait (`weight_pass_drain`);
    ``forwards_first``: the rank runs all its forwards before its first backward (the schedule's
    ``warmup``), so its stages are sharded and hold no accumulator while its activations are most:
    the peak is the larger of that moment and the backward's, one micro-batch fewer in flight."""
    act_bytes = ACT_BYTES[mixed_precision]
    n_mtp = a.mtp_depth if mtp else 0
    kinds = [i >= a.n_dense_layers for i in layers] + [True] * n_mtp
    held = _memo(cache, _rank_states, a, tuple(kinds), embed, head, n_mtp, fsdp, ep, tp, pipelined, mixed_precision,
                 device_type, optimizer, state_dtype)
    total_model, local, states, embed_head, stage_params, unsharded, transient, backward_tmp, copies, rounding = held
    # torch's pipeline stage runs every backward but the step's last with
    # ``set_reshard_after_backward(False)`` (its ``backward_maybe_with_nosync``): from a stage's first
    # backward on, its parameters stay unsharded in the compute dtype until ``REDUCE_GRAD``, under
    # every schedule; the zero-bubble ones from the first forward on.
    unsharded_stages = stage_params > 0

    tokens = rows * seq_len / cp  # local tokens per micro-batch
    fp32_norms = device_type == "cpu" and act_bytes < 4
    layer_bytes = {
        moe: _memo(cache, layer_activation_bytes, a, moe, tp, cp, act_bytes, device_type == "cpu") * tokens
        for moe in set(kinds)
    }
    per_layer = [layer_bytes[k] for k in kinds]
    # What each block keeps through the step, and what its recomputation brings back (the rest of
    # its no-checkpointing activations): one block's at a time in its backward.
    bounds = list(itertools.accumulate(stage_blocks or [len(per_layer)], initial=0))
    checkpointed = checkpointed_blocks(ac, len(kinds), len(layers), selective_every)
    kept_bytes = {
        moe: _memo(cache, block_activation_bytes, a, moe, "modules" if parts else "full", parts, tp, cp, act_bytes, fp32_norms)
        * tokens
        for moe in set(kinds)
    }
    kept = [kept_bytes[k] if c else saved for k, c, saved in zip(kinds, checkpointed, per_layer)]
    # (full's recomputation counted whole, as before the per-op modes: its kept input is small.)
    recomputed = [(saved if not parts else saved - k) if c else 0.0 for saved, k, c in zip(per_layer, kept, checkpointed)]
    block_recompute = max(recomputed, default=0.0)
    extra = block_recompute
    if zero_bubble:
        # The weight pass recomputes a checkpointed stage once (module docstring): the largest
        # stage's checkpointed blocks, ZB_WEIGHT_PASS_RECOMPUTES times.
        extra += ZB_WEIGHT_PASS_RECOMPUTES * max(sum(recomputed[i:j]) for i, j in zip(bounds, bounds[1:]))
    act = sum(kept) * in_flight + extra
    # Once gradients exist: every micro-batch in flight, or one fewer when the first backward
    # follows the step's last forward (its backward has freed a whole micro-batch by the time every
    # stage's accumulators exist).
    grads_act = sum(kept) * (in_flight - 1) + extra if forwards_first else act
    drain_act = 0.0
    if drain:
        # Late in the backward: each waiting weight pass holds its stage's blocks' weight-output
        # gradients (`weight_grad_output_bytes`) beside the micro-batches still in flight, while an
        # input pass recomputes one block, or a weight pass its stage (then one fewer waits).
        grad_out = {moe: _memo(cache, weight_grad_output_bytes, a, moe, tp, act_bytes) * tokens for moe in set(kinds)}
        waiting = sum(n * sum(grad_out[k] for k in kinds[i:j]) for n, i, j in zip(drain[0], bounds, bounds[1:]))
        passes = [sum(grad_out[k] for k in kinds[i:j]) for n, i, j in zip(drain[0], bounds, bounds[1:]) if n]
        in_flight_held = sum(n * sum(kept[i:j]) for n, i, j in zip(drain[1], bounds, bounds[1:]))
        drain_act = in_flight_held + max(block_recompute + waiting, extra - block_recompute + waiting - min(passes, default=0.0))
    # Logits, their fp32 log-softmax in the loss and its fp32 gradient, per head use (main + MTP).
    logits = (1 + n_mtp) * tokens * a.vocab_size / tp * (act_bytes + 4 + 4) if head else 0.0
    if head and fp32_norms:  # the final norm and each MTP module's three outside its block
        logits += (1 + 3 * n_mtp) * tokens * a.dim / tp * 2 * 4
    # The bool mask, and the additive mask in the compute dtype that each sdpa call derives from it
    # and saves for its backward (one per attention held: every block's, or under full AC the one
    # block recomputed).
    attention_calls = (len(kinds) - sum(checkpointed)) * in_flight + (1 if any(checkpointed) else 0)
    mask = rows * (seq_len / cp) * seq_len * (in_flight + act_bytes * attention_calls) if block_causal_sdpa else 0.0
    activations = {"layers": act / GiB, "logits_and_loss": logits / GiB, "attention_mask": mask / GiB}
    cuda = device_type == "cuda"
    # Without pipelining, the late backward (the first blocks' backward): nearly every sharded
    # gradient exists while one block's activations, its FSDP buffers and what the whole backward
    # keeps are live. The step keeps the model's output, so every head use's logits, in the compute
    # dtype, through ``loss.backward()`` (trainer/parallel/step.py). The FSDP root (embedding,
    # head, final norm) is not resharded after forward (trainer/parallel/fsdp.py), and its
    # unsharded gradients wait for its reduce-scatter at the end of backward: both in the compute
    # dtype. Measured by the 671B FSDP 256 dry run (docs/performance.md).
    # A pipeline stage's late backward: its in-flight micro-batches' activations, the logits and
    # its embedding / head gradient temporaries (its root's parameters are in stage_unsharded_params).
    held_logits = (1 + n_mtp) * tokens * a.vocab_size / tp * act_bytes if head else 0.0
    if pipelined:
        late_backward = held_logits + backward_tmp * GiB + max(grads_act, drain_act)
    else:
        root_unsharded = 2 * embed_head / tp * act_bytes if fsdp > 1 else 0.0
        late_backward = held_logits + root_unsharded + max(per_layer, default=0.0)
    # torch's pipeline stage allocates its receive buffers for every micro-batch of the step up front
    # (the inputs of a stage not first, the output gradients of one not last), and the schedule keeps
    # each in-flight micro-batch's stage output until its backward.
    received, not_last = stage_io
    pipeline_buffers = (received * micro + not_last * in_flight) * tokens * a.dim / tp * act_bytes
    # Before a forwards-first rank's first backward: its activations, with FSDP gathering one block
    # ahead (two blocks in the compute dtype) and the stage's root (embedding, head) left unsharded
    # after its forward, as without pipelining.
    before_backward = 0.0
    if forwards_first and stage_params:
        before_backward = act + logits + unsharded * 2 * act_bytes + embed_head / tp * act_bytes
    result = {
        "params_total_B": total_model / 1e9,
        "params_per_gpu_B": local / 1e9,
        "gib": {
            **states, "backward_temporaries": backward_tmp, "fsdp_unsharded_block": transient, **activations,
            "stage_unsharded_params": stage_params * act_bytes / GiB if unsharded_stages else 0.0,
            "stage_grad_accumulators": stage_params * 4 / GiB,
            "late_backward": late_backward / GiB, "pipeline_buffers": pipeline_buffers / GiB,
            "before_first_backward": before_backward / GiB,
            "bf16_weight_copies": copies / GiB, "allocator_rounding": rounding / GiB,
            "cublas_workspace": CUBLAS_WORKSPACE_BYTES / GiB if cuda else 0.0,
        },
    }
    result["gib"]["total"] = _total(result["gib"], pipelined, unsharded_stages, forwards_first, grads_act / GiB)
    return result


def _total(g: dict[str, float], pipelined: bool, unsharded_stages: bool, forwards_first: bool, grads_act_gib: float) -> float:
    """A rank's peak GiB from its terms ``g`` (``_estimate_share``): what it holds through the step,
    the CUDA terms, and the largest of its moments (module docstring): the gradients, the forward,
    the late backward and, for a rank that runs its forwards first, the moment before its first
    backward (``grads_act_gib``: its activations once the first backward has freed one micro-batch).
    ``unsharded_stages``: pipeline stages under FSDP, unsharded through the step."""
    forward = g["fsdp_unsharded_block"] + g["bf16_weight_copies"] + g["layers"] + g["logits_and_loss"]
    held = g["params"] + g["optimizer"] + g["stage_unsharded_params"] + g["stage_grad_accumulators"]
    held += g["pipeline_buffers"]
    if pipelined and unsharded_stages:
        # A stage's backward (its embedding / head gradient temporaries) runs while the other
        # in-flight micro-batches' activations are held: the two add up (the dry run's peak). The
        # stages stay unsharded through their backwards, so no block is gathered or reduced then:
        # the fp32 reduce-scatter buffers belong to REDUCE_GRAD, after the last backward.
        forward -= g["fsdp_unsharded_block"]
        late = g["late_backward"] + g["bf16_weight_copies"] + g["attention_mask"]
        peak = max(g["grads"] + g["fsdp_unsharded_block"], forward + g["attention_mask"], late)
        if forwards_first:
            # The stages' unsharded copies and accumulators come with the first backward, which
            # has freed a micro-batch's activations (`grads_act`) by the time they are whole.
            stage = g["stage_unsharded_params"] + g["stage_grad_accumulators"]
            before = g["before_first_backward"] + g["bf16_weight_copies"] + g["attention_mask"]
            after = forward - g["layers"] + grads_act_gib + g["attention_mask"]
            held -= stage
            peak = max(before, stage + max(g["grads"] + g["fsdp_unsharded_block"], after, late))
    elif pipelined:
        peak = g["backward_temporaries"] + max(g["grads"], forward + g["attention_mask"])
    else:
        late = g["grads"] + g["late_backward"] + g["fsdp_unsharded_block"] + g["bf16_weight_copies"] + g["attention_mask"]
        peak = max(g["grads"] + g["backward_temporaries"], forward + g["attention_mask"], late)
    return held + g["allocator_rounding"] + g["cublas_workspace"] + peak


class _RankStates(NamedTuple):
    """What one rank holds whatever its batch (``_rank_states``); bytes unless GiB."""

    total_model: int  # the model's parameters
    local: float  # this rank's parameters
    states: dict[str, float]  # GiB of its fp32 parameters, gradients and optimizer states
    embed_head: int  # the embedding / head parameters it holds
    stage_params: float  # its pipeline stages' parameters as FSDP gathers them (0 without)
    unsharded: float  # its largest block's parameters as FSDP gathers them
    transient: float  # GiB of FSDP's gathered block and reduce buffer
    backward_tmp: float  # GiB of the embedding / head gradient temporaries
    copies: float  # the bf16 weight copies without FSDP sharding
    rounding: float  # the CUDA allocator's rounding of the parameter-like tensors


def _rank_states(
    a: DeepSeekV3ModelArgs, kinds: tuple[bool, ...], embed: bool, head: bool, n_mtp: int, fsdp: int, ep: int, tp: int,
    pipelined: bool, mixed_precision: str, device_type: str, optimizer: str, state_dtype: str,
) -> _RankStates:
    """The terms of ``_estimate_share`` that its batch does not change, for the blocks of ``kinds``
    (MoE or not, MTP's last): the layouts of one set of degrees and one pipeline split repeat them."""
    act_bytes = ACT_BYTES[mixed_precision]
    efsdp = fsdp // ep
    # A block's figures depend only on its kind (dense or MoE): computed once per kind and looked up
    # per block (the layout planner estimates tens of thousands of layouts), summed in the same order.
    by_kind = {moe: _block_params(a, moe=moe) for moe in (False, True)}
    blocks = [by_kind[k] for k in kinds]
    # A tied head is the embedding: counted once where both are held.
    n_vocab_mats = (1 if a.tie_embeddings and embed and head else int(embed) + int(head))
    embed_head = n_vocab_mats * a.vocab_size * a.dim
    n_blocks = a.n_layers + a.mtp_depth
    dense_blocks = min(a.n_dense_layers, n_blocks)  # integer counts: the same sum in any order
    total_model = sum(by_kind[False].values()) * dense_blocks + sum(by_kind[True].values()) * (n_blocks - dense_blocks)
    total_model += (1 if a.tie_embeddings else 2) * a.vocab_size * a.dim
    total_model += a.mtp_depth * (2 * a.dim * a.dim + 3 * a.dim) + a.dim

    split = sum(b["tp_split"] for b in blocks) + embed_head + n_mtp * 2 * a.dim * a.dim
    repl = sum(b["tp_replicated"] for b in blocks) + (a.dim if head else 0) + n_mtp * 3 * a.dim
    experts = sum(b["experts"] for b in blocks)
    total = split + repl + experts
    local = split / (tp * fsdp) + repl / fsdp + experts / (ep * efsdp)
    states = {k: local * v / GiB for k, v in STATE_BYTES.items()}
    muon_local = 0.0
    if optimizer == "muon":  # every block matrix and expert; embedding, head, norms, routers stay AdamW
        muon_local = (split - embed_head) / (tp * fsdp) + experts / (ep * efsdp)
        muon_local += len(blocks) * _replicated_matrices(a) / fsdp
    states["optimizer"] = optimizer_state_bytes(local, muon_local, state_dtype) / GiB

    # Pipeline stages under FSDP: everything this rank holds, gathered over the FSDP ranks (still
    # split over tp and ep), as fp32 gradient accumulators and, zero-bubble, in the compute dtype.
    stage_params = split / tp + repl + experts / ep if pipelined and fsdp > 1 else 0.0
    # FSDP all-gathers one block ahead: the current and the prefetched block unsharded in the
    # param dtype (already in stage_params when the stages stay unsharded), and the block being
    # reduced holds its fp32 unsharded gradient. Without sharding (one data rank) there is no
    # FSDP wrap and no such buffer.
    biggest = max(blocks, key=lambda b: b["tp_split"] + b["experts"]) if blocks else None
    unsharded = biggest["tp_split"] / tp + biggest["tp_replicated"] + biggest["experts"] / ep if blocks else 0.0
    gathered = 0 if stage_params > 0 else 2 * act_bytes
    transient = unsharded * (gathered + 4) / GiB if fsdp > 1 else 0.0
    # At the end of backward, while (nearly) all gradients are live: the embedding's dense
    # vocab x dim gradient and the head's weight gradient pass through fp32 temporaries
    # (measured on CPU with MemTracker for the debug flavor: 2-3 such buffers).
    # Pipeline stages under FSDP: the fp32 gradients are the accumulators (stage_grad_accumulators);
    # what passes is FSDP's unsharded gradient, in the compute dtype.
    backward_tmp = n_vocab_mats * a.vocab_size * a.dim / tp * (act_bytes if stage_params else 4) / GiB
    cuda = device_type == "cuda"
    embedding_local = a.vocab_size * a.dim / (tp * fsdp) if embed else 0.0
    copies = (local - embedding_local) * 2 if cuda and mixed_precision == "bfloat16" and fsdp == 1 else 0.0
    rounding = 0.0
    if cuda:
        scale = local / total  # each tensor's local share, as the layout splits it on average
        numels_of = {moe: _block_tensor_numels(a, moe) for moe in set(kinds)}
        numels = [n for k in kinds for n in numels_of[k]] + [a.vocab_size * a.dim] * n_vocab_mats
        numels += [a.dim] if head else []
        per_copy = [(4, 4), (2, 1 if copies else 0)]  # (bytes per element, tensors): fp32 param, grad, m, v; bf16 copy
        # Each distinct size's terms once (the blocks repeat a few sizes), added in the order of `numels`.
        terms = {
            n: [count * (cuda_block_bytes(n * scale * nbytes) - n * scale * nbytes) for nbytes, count in per_copy]
            for n in set(numels)
        }
        rounding = sum(itertools.chain.from_iterable(map(terms.__getitem__, numels)))
    return _RankStates(total_model, local, states, embed_head, stage_params, unsharded, transient, backward_tmp,
                       copies, rounding)


class EstimateCache:
    """Figures that the estimates of one model repeat, computed once per key: a rank's states
    (``_rank_states``), the per-token activation figures of a block kind, a pipeline's ranks. The
    layout planner builds one per group of layouts and passes it to ``estimate`` (``cache``); each
    key holds every argument of the figure but the model, which the cache is bound to, so an
    estimate is the same with or without it (tests/unit/test_layout_planner.py)."""

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        self.model_args = model_args
        self.figures: dict[tuple, object] = {}


def _memo(cache: EstimateCache | None, fn, a: DeepSeekV3ModelArgs, *args):
    """``fn(a, *args)``, looked up in ``cache`` where given."""
    if cache is None:
        return fn(a, *args)
    key = (fn, *args)
    value = cache.figures.get(key)
    if value is None:
        value = cache.figures[key] = fn(a, *args)
    return value
