"""Worker of tests/distributed/test_moe_overlap_fast.py, in the fast tier's shared 2-rank spawn
(tests/distributed/conftest.py), without a Trainer (no tokenizer, data, optimizer or run folder):
on one of 2 gloo ranks, the overlapped step against the plain one, case ``ep``: ``MoEOverlapStep``
(trainer/parallel/moe_overlap.py) in ``dp_shard 2 x ep 2``; case ``dualpipev``: DualPipeV with its
OVERLAP_F_B actions interleaved (trainer/parallel/pipeline_overlap.py) in ``pp 2`` (``CASES``).

The debug model cut to a few blocks (MTP on), fp32, laid out and materialized as the Trainer does
(``parallelize_model``, ``materialize``); 2 micro-batches of 16-token rows (without pp one
(B_0, F_1) pair). Both step objects run the forward and backward of the same micro-batches from
the same weights; each rank reports both loss sums, the names of its local gradients (FSDP's
reduced shards, the ep shards of the experts) that differ and those of the MoE buffers (the
per-expert token counts the bias update reads) that differ, the OVERLAP_F_B pairs run
interleaved, and the job's own seconds.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

MICRO_BATCHES, SEQ_LEN = 2, 16


def _objective(out, targets, aux_scale: float, n_valid: torch.Tensor, n_valid_mtp: torch.Tensor, mtp_weight: float):
    """``Trainer.objective`` with the plain cross-entropy sum."""
    from trainer.loss import cross_entropy_sum

    loss = cross_entropy_sum(out.logits, targets.labels) / n_valid
    mtp = targets.mtp_loss_sum(out.mtp_logits) / n_valid_mtp
    return loss + out.aux_loss * aux_scale + mtp_weight * mtp, loss, mtp


def _run_step(model, step, micro, objective) -> dict:
    """One forward and backward of ``micro`` with ``step``: its loss sums, the local gradients, the
    buffers after it and its seconds; the gradients and buffers are then reset for the next run."""
    from trainer.distributed import local_tensor

    start = time.perf_counter()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with step.loss_context():
        totals = step.forward_backward(micro, objective, nullcontext)  # fp32: no autocast
    grads = {n: local_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    after = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    model.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {"losses": [t.item() for t in totals], "grads": grads, "buffers": after, "seconds": seconds}


# Per case: the layout's options, its data ranks, the debug model's blocks (one dense, the rest MoE)
# and the rows of each of the 2 micro-batches. DualPipeV: 4 stages ``Et*2|t|t|tL`` (every stage
# holds a MoE block, so both ranks interleave pairs), 4 pipeline micro-batches of one row, one
# schedule run per micro-batch.
CASES = {
    "ep": (("--parallelism.dp_shard", "2", "--parallelism.ep", "2"), 2, 3, 1),
    "dualpipev": (
        ("--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_layout", "Et*2|t|t|tL"),
        1,
        5,
        4,
    ),
}


def _build(case: str, world: int):
    """The config, model args, model (laid out and materialized as the Trainer does) and plain step
    object of ``case``. Under pp 2 on 2 ranks no rank is left for ep (it borrows from dp_shard inside
    a pipeline rank), so the MoE blocks get the all-to-all dispatcher over a group of one
    (``apply_expert_parallel`` on the meta model, before the layout), which the overlap needs to
    run its node schedule; the exchanges are then local, the interleave and the runtime's
    bookkeeping are those of ``pp 2 x ep 2``."""
    from models.deepseek_v3 import DeepSeekV3Model, get_flavor
    from trainer.config import load_config
    from trainer.parallel import ParallelDims, materialize, parallelize_model
    from trainer.parallel.expert_parallel import apply_expert_parallel

    options, data_ranks, n_layers, rows = CASES[case]
    cfg = load_config(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--model.use_grouped_mm",
            *options,
            "--training.device",
            "cpu",
            "--training.seq_len",
            str(SEQ_LEN),
            "--training.local_batch_size",
            str(rows),
            "--training.global_batch_size",
            str(rows * MICRO_BATCHES * data_ranks),
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    dims = ParallelDims.from_job(cfg, world)
    args = dataclasses.replace(get_flavor(cfg.model.flavor), n_layers=n_layers, max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    if not dims.ep_enabled:
        dims.build_meshes("cpu")
        apply_expert_parallel(model, dims.mesh("tp"))  # tp 1: this rank alone
    model, plain = parallelize_model(
        model, dims, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.quantize, cfg.engram, "cpu"
    )
    materialize(model, torch.device("cpu"), cfg.training.seed)
    return cfg, args, model.train(), plain, rows


def _overlap_step(plain):
    from trainer.parallel.moe_overlap import MoEOverlapStep
    from trainer.parallel.pipeline_step import PipelineStep

    if isinstance(plain, PipelineStep):
        activation = (plain.activation_shape, plain.activation_dtype)
        return PipelineStep(plain.model, plain.dims, plain.stages, activation, moe_overlap=True)
    return MoEOverlapStep(plain.model, plain.dims)


def run(rank: int, world: int, port: int, case: str, queue) -> None:
    start = time.perf_counter()  # the job's own cost in the shared spawn, its imports included
    from models.moe import moe_modules
    from trainer.diagnostics import init_local_gloo
    from trainer.parallel import pipeline_overlap

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    # The MoE block counts of the OVERLAP_F_B pairs DualPipeV ran interleaved (none without pp).
    pairs = []
    pair = pipeline_overlap.pair
    pipeline_overlap.pair = lambda b, f: pairs.append((len(b.moe_blocks), len(f.moe_blocks))) or pair(b, f)
    try:
        cfg, args, model, plain, rows = _build(case, world)
        overlap = _overlap_step(plain)
        g = torch.Generator().manual_seed(rank)
        batches = [
            tuple(torch.randint(args.vocab_size, (rows, SEQ_LEN), generator=g) for _ in range(2))
            for _ in range(MICRO_BATCHES)
        ]
        micro, n_valid, n_mtp = plain.prepare(batches, args.mtp_depth)
        objective = partial(_objective, n_valid=n_valid, n_valid_mtp=n_mtp, mtp_weight=cfg.model.mtp_loss_weight)
        ref = _run_step(model, plain, micro, objective)
        new = _run_step(model, overlap, micro, objective)
        queue.put(
            {
                "rank": rank,
                "moe_layers": len(moe_modules(model)),
                "pairs": sorted(set(pairs)),
                "plain_losses": ref["losses"],
                "overlap_losses": new["losses"],
                "grads": sorted(ref["grads"]),
                "same_grad_names": ref["grads"].keys() == new["grads"].keys(),
                "grads_differing": sorted(n for n, g in ref["grads"].items() if not torch.equal(g, new["grads"][n])),
                "buffers": sorted(ref["buffers"]),
                "buffers_differing": sorted(
                    n for n, b in ref["buffers"].items() if not torch.equal(b, new["buffers"][n])
                ),
                "step_seconds": {"plain": ref["seconds"], "overlap": new["seconds"]},
                "seconds": time.perf_counter() - start,
            }
        )
    finally:
        pipeline_overlap.pair = pair
        dist.destroy_process_group()
