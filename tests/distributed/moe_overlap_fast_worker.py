"""Worker of tests/distributed/test_moe_overlap_fast.py, in the fast tier's shared 2-rank spawn
(tests/distributed/conftest.py): the overlapped step (``MoEOverlapStep``,
trainer/parallel/moe_overlap.py) against the plain ``ParallelStep`` on one of 2 gloo ranks in
``dp_shard 2 x ep 2``, without a Trainer (no tokenizer, data, optimizer or run folder).

The debug model cut to one dense and two MoE blocks (MTP on), fp32, laid out and materialized as
the Trainer does (``parallelize_model``, ``materialize``); 2 micro-batches of one 16-token row
make one (B_0, F_1) pair. Both step objects run the forward and backward of the same micro-batches
from the same weights; each rank reports both loss sums, the names of its local gradients (FSDP's
reduced shards, the ep shards of the experts) that differ and those of the MoE buffers (the
per-expert token counts the bias update reads) that differ, and the job's own seconds.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

N_LAYERS, MICRO_BATCHES, SEQ_LEN = 3, 2, 16


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


def run(rank: int, world: int, port: int, queue) -> None:
    start = time.perf_counter()  # the job's own cost in the shared spawn, its imports included
    from models.deepseek_v3 import DeepSeekV3Model, get_flavor
    from models.moe import moe_modules
    from trainer.config import load_config
    from trainer.diagnostics import init_local_gloo
    from trainer.parallel import ParallelDims, materialize, parallelize_model
    from trainer.parallel.moe_overlap import MoEOverlapStep

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        cfg = load_config(
            [
                "--job.config_file",
                "train_configs/debug_model.toml",
                "--model.use_grouped_mm",
                "--parallelism.dp_shard",
                "2",
                "--parallelism.ep",
                "2",
                "--training.device",
                "cpu",
                "--training.seq_len",
                str(SEQ_LEN),
                "--training.local_batch_size",
                "1",
                "--training.global_batch_size",
                str(world * MICRO_BATCHES),
                "--training.mixed_precision_param",
                "float32",
            ]
        )
        dims = ParallelDims.from_job(cfg, world)
        args = dataclasses.replace(get_flavor(cfg.model.flavor), n_layers=N_LAYERS, max_seq_len=SEQ_LEN)
        with torch.device("meta"):
            model = DeepSeekV3Model(args)
        model, plain = parallelize_model(
            model, dims, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.quantize, cfg.engram, "cpu"
        )
        materialize(model, torch.device("cpu"), cfg.training.seed)
        model.train()
        overlap = MoEOverlapStep(model, plain.dims)

        g = torch.Generator().manual_seed(rank)
        batches = [
            tuple(torch.randint(args.vocab_size, (1, SEQ_LEN), generator=g) for _ in range(2))
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
        dist.destroy_process_group()
