"""Worker of tests/distributed/test_moe_overlap.py: the overlapped step (``[parallelism]
moe_overlap``, trainer/parallel/moe_overlap.py) against the plain one on the same Trainer, on one of
2 gloo ranks in ``dp_shard 2 x ep 2`` with 4 accumulated micro-batches (``run``), or DualPipeV
with its OVERLAP_F_B actions interleaved (trainer/parallel/pipeline_overlap.py) against plain
DualPipeV on one of 4 ranks in ``pp 2 x dp_shard 2 x ep 2`` (``run_dualpipev``); debug model, fp32.

From the same initial state (weights, MoE buffers, optimizer, LR schedule) each step object trains
two steps on the same batches; each rank reports both runs' per-step losses and the names of the
local gradients after step 1 (before clipping) that differ, and the overlapped run's step 2
collective sequence (trainer/diagnostics/collectives.py's ``CollectiveRecorder``: names, group sizes and shapes,
an all-to-all's row counts left out, in issue order) and host reads.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

STEPS = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state(trainer) -> dict:
    return {
        "tensors": [t.detach().clone() for t in (*trainer.model.parameters(), *trainer.model.buffers())],
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "lr": copy.deepcopy(trainer.lr_scheduler.state_dict()),
    }


def _restore(trainer, state: dict) -> None:
    with torch.no_grad():
        for t, saved in zip((*trainer.model.parameters(), *trainer.model.buffers()), state["tensors"], strict=True):
            t.copy_(saved)
    trainer.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    trainer.lr_scheduler.load_state_dict(copy.deepcopy(state["lr"]))


def _train(trainer, step_object, batches, last_step=nullcontext) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps with ``step_object``, the last inside ``last_step()``: the losses and the
    gradients right after step 1's backward."""
    trainer.parallel = step_object
    grads = {}
    forward_backward = step_object.forward_backward

    def recording(*args):
        totals = forward_backward(*args)
        if not grads:
            grads.update({n: _local(p.grad).clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return totals

    step_object.forward_backward = recording
    losses = []
    for step in range(1, STEPS + 1):
        trainer.step = step
        with last_step() if step == STEPS else nullcontext():
            losses.append(trainer.train_step(batches[step - 1])["loss"])
    del step_object.forward_backward
    return losses, grads


@contextmanager
def _collectives():
    """Records the collectives (``ops``, the dry run's recorder) and the host reads (``reads``) of
    what runs inside."""
    from trainer.diagnostics import CollectiveRecorder, HostReadCounter

    seen = {}
    reads = HostReadCounter("cpu")
    with CollectiveRecorder() as recorder, reads:
        yield seen
    seen["ops"] = [_collective(call) for call in recorder.calls]
    seen["reads"] = len(reads.reads)


def _collective(call) -> str:
    """A collective as every rank must issue it: the row counts of an all-to-all depend on this
    rank's routing, its row width and everything of the other collectives do not."""
    shapes = [shape[1:] for shape in call.shapes] if call.name.startswith("alltoall") else call.shapes
    return f"{call.name}/{call.group_size}{shapes}"


def _compare(trainer, plain, overlap) -> dict:
    """Both step objects' two steps from the same state, with the collectives and host reads of
    the second overlapped step (the first creates the optimizer state)."""
    batches = [trainer.next_microbatches()[0] for _ in range(STEPS)]
    start = _state(trainer)
    plain_losses, plain_grads = _train(trainer, plain, batches)
    _restore(trainer, start)
    recorded = {}

    @contextmanager
    def recording():
        with _collectives() as seen:
            yield
        recorded.update(seen)

    overlap_losses, overlap_grads = _train(trainer, overlap, batches, recording)
    return {
        "micro_batches": trainer.grad_accum_steps,
        "plain_losses": plain_losses,
        "overlap_losses": overlap_losses,
        # Compared here: tensors put on the queue die with the process that shared them.
        "grads": sorted(plain_grads),
        "grads_differing": sorted(n for n in plain_grads if not torch.equal(plain_grads[n], overlap_grads[n])),
        "same_grad_names": plain_grads.keys() == overlap_grads.keys(),
        "collectives": recorded["ops"],
        "host_reads": recorded["reads"],
    }


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)


def run(rank: int, world: int, port: int, workdir: str, queue) -> None:
    _init(rank, world, port)
    from models.moe import moe_modules
    from tests.helpers import step_trainer
    from trainer.parallel.moe_overlap import MoEOverlapStep

    trainer = step_trainer(
        Path(workdir), "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.device", "cpu",
        "--training.seq_len", "32", "--training.local_batch_size", "1", "--training.global_batch_size", "8",
        "--training.deterministic",
    )
    try:
        plain = trainer.parallel
        overlap = MoEOverlapStep(trainer.model, plain.dims)
        result = _compare(trainer, plain, overlap)
        queue.put({"rank": rank, "moe_layers": len(moe_modules(trainer.model)), **result})
    finally:
        trainer.close()


def run_dualpipev(rank: int, world: int, port: int, workdir: str, queue) -> None:
    """DualPipeV over 4 stages split ``Et*2|t*2|t|tL``: every stage holds MoE blocks (the cost
    split would leave stage 0 the dense block alone, and rank 0 no pair to interleave), and rank
    1's stages hold 2 and 1 (a pair's common layer, then the longer one's rest alone). 4 pipeline
    micro-batches of one row, one schedule run per step."""
    _init(rank, world, port)
    from tests.helpers import step_trainer
    from trainer.parallel import pipeline_overlap
    from trainer.parallel.pipeline_step import PipelineStep

    # Counts the OVERLAP_F_B actions run interleaved (not one half after the other).
    pairs = []
    pair = pipeline_overlap.pair
    pipeline_overlap.pair = lambda b, f: pairs.append((len(b.moe_blocks), len(f.moe_blocks))) or pair(b, f)

    trainer = step_trainer(
        Path(workdir), "--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_layout",
        "Et*2|t*2|t|tL", "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.device", "cpu",
        "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.global_batch_size", "8",
        "--training.deterministic",
    )
    try:
        plain = trainer.parallel
        overlap = PipelineStep(
            trainer.model, plain.dims, plain.stages, (plain.activation_shape, plain.activation_dtype), moe_overlap=True
        )
        result = _compare(trainer, plain, overlap)
        queue.put({"rank": rank, "pp_rank": plain.pp_mesh.get_local_rank(), "pairs": sorted(set(pairs)), **result})
    finally:
        trainer.close()
