"""Engram checkpoints through the trainer's pieces (parallelize_model, build_optimizer,
CheckpointManager / DCP) reshard to another embedding-parallel degree and continue with the same
loss: saved at degree 2 on 4 ranks (2 shards x 2 replicas, whose table grads are summed) with the
tables' Adam state offloaded to the CPU, resumed at degree 4 on 4 ranks (state on the device) and
at degree 1 on 2 ranks (whole tables on each rank, offloaded again). FSDP2 and EP 2 throughout.
Steps 3 and 4 after the resume must give the losses and gradient norms of the uninterrupted run;
step 4 also depends on the restored Adam moments. The three layouts split each step's tokens
differently, so equal losses and norms also check the sharded lookups, the gradient sums and the
count of each table row in the norm against each other."""

import engram_worker
import pytest

from trainer.diagnostics import spawn_local_jobs

pytestmark = pytest.mark.numerics  # docs/numerics.md


def _by_phase(results: list, phases: int) -> list[dict]:
    """A job's results ((rank, [one per phase]) each) as one {rank: result} per phase."""
    by_rank = dict(results)
    for rank, r in by_rank.items():
        assert isinstance(r, list), f"rank {rank}: {r}"
    return [{rank: r[i] for rank, r in by_rank.items()} for i in range(phases)]


@pytest.mark.slow  # 4 and 2 ranks with FSDP and EP
def test_save_at_degree_2_resume_at_4_and_1_same_losses(tmp_path):
    ckpt = str(tmp_path / "run")
    # One spawn of 4 ranks, two jobs in turn ((degree, mode, offload) phases each): the save and
    # the resume at degree 4 on all 4 ranks, then the resume at degree 1 on ranks 0 and 1. Each
    # phase builds its model, optimizer and checkpointer from scratch in a process group of its
    # own, and the resumes get their state from the files alone.
    jobs = {
        "world4": (engram_worker.run_checkpoint, ([(2, "save", True), (4, "load", False)], ckpt), 4),
        "world2": (engram_worker.run_checkpoint, ([(1, "load", True)], ckpt), 2),
    }
    out = spawn_local_jobs(jobs, 4)
    saved, resumed_4 = _by_phase(out["world4"], 2)
    (resumed_1,) = _by_phase(out["world2"], 1)
    losses, norms = saved[0]["losses"], saved[0]["grad_norms"]
    for world, degree, resumed in ((4, 4, resumed_4), (2, 1, resumed_1)):
        num_rows = resumed[0]["num_rows"]
        # Each rank holds ~1/degree of every table's rows, and `world / degree` ranks each shard.
        assert sum(r["table_rows"] for r in resumed.values()) == num_rows * world // degree
        for r in resumed.values():
            assert r["table_rows"] <= num_rows / degree + len(engram_worker.ENGRAM.layer_ids), (degree, r)
            for a, b in zip(r["losses"], losses):
                assert abs(a - b) <= 1e-5 * abs(b), (degree, r["losses"], losses)
            # Each table row counted once in the global gradient norm, whatever holds it.
            for a, b in zip(r["grad_norms"], norms):
                assert abs(a - b) <= 1e-5 * abs(b), (degree, r["grad_norms"], norms)
