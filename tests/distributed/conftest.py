"""The fast tier's 2-rank checks share one spawn of two gloo ranks (`two_ranks`).

Starting a rank imports torch and the model code (seconds each on 2 cores), more than most of
these checks take, so the ranks start once per session and run each worker in turn, each in a
process group of its own (`spawn_local_jobs`): the EP dispatcher against one process
(test_moe_ep.py), torch 2.11's FSDP
layout of the routed experts against the unsharded copy (test_compile_ep.py), the overlapped MoE steps against the plain ones, with and without pp (test_moe_overlap_fast.py),
context-parallel MLA (test_cp_attention.py), Engram's sharded tables at world
sizes 2 and 1 (test_engram_parallel.py) and the EP step's device reads (test_step_sync_ep.py). A
selection of one of those modules runs them all (about a launch's cost more than it alone).
The 4-rank checks share one spawn of four ranks the same way (`four_ranks`), the jobs of the
selected tests only (`selected`).
"""

import compile_ep_worker
import cp_attention_worker
import engram_worker
import moe_ep_worker
import moe_overlap_fast_worker
import muon_owner_worker
import pytest
import step_sync_worker

from trainer.diagnostics import free_port, spawn_local_jobs


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> dict[str, list]:
    """Job name -> what its worker queued, one item per rank."""
    workdir = tmp_path_factory.mktemp("step_sync_ep")
    jobs = {
        "moe_ep": (moe_ep_worker.run, ()),
        "moe_overlap": (moe_overlap_fast_worker.run, ("ep",)),
        "moe_overlap_dualpipev": (moe_overlap_fast_worker.run, ("dualpipev",)),
        "fsdp_experts_own_unit": (compile_ep_worker.run_own_unit, ()),
        "cp_attention": (cp_attention_worker.run, (cp_attention_worker.CASES,)),
        # Precompute on and off: off changes the exchanges, not the sharding the world sizes vary.
        "engram": (engram_worker.run, ((True, False),)),
        # The unsharded tables, rank 0 alone in a group of one (rank 1 goes on to the next job).
        "engram_world_1": (engram_worker.run, ((True,),), 1),
        # Last: a Trainer, which sets the rank's environment (MASTER_PORT, RANK) and its logging.
        "step_sync_ep": (step_sync_worker.run, (str(workdir),)),
    }
    return spawn_local_jobs(jobs, 2, timeout=600)


@pytest.fixture(scope="session")
def selected(request):
    """``selected("test_x.py::test_y")``: whether this session runs that test (any of its
    parameters). A spawn of ranks shared by fast and slow tests (a job each) leaves out the jobs
    of deselected tests: the fast tier (``-m "not slow"``) then pays for its own jobs only."""
    names = {item.nodeid.split("[")[0].rsplit("/", 1)[-1] for item in request.session.items}
    return lambda test: test in names


@pytest.fixture(scope="session")
def four_ranks(selected, tmp_path_factory) -> dict[str, list]:
    """Job name -> what its worker queued, one item per rank: the selected tests' 4-rank checks in
    one spawn of four gloo ranks, as `two_ranks` does for 2: Engram's sharded tables at world
    size 4 (test_engram_parallel.py), the Muon owners' exchange in each placement (fast tier) and
    in the trainer's layouts (slow; test_muon_owners.py)."""
    jobs = {}
    if selected("test_engram_parallel.py::test_sharded_matches_unsharded"):
        jobs["engram_world_4"] = (engram_worker.run, ((True,),))
    if selected("test_muon_owners.py::test_every_placement_gives_one_process_weights_bitwise"):
        jobs["muon_placements"] = (muon_owner_worker.run_placements, ())
    if selected("test_muon_owners.py::test_each_matrix_is_orthogonalised_once"):
        # Last: Trainers, which set the rank's environment (MASTER_PORT, RANK) and its logging.
        ports = [free_port() for _ in list(muon_owner_worker.LAYOUTS)[1:]]
        jobs["muon_layouts"] = (muon_owner_worker.run, (str(tmp_path_factory.mktemp("muon_owners")), ports))
    return spawn_local_jobs(jobs, 4, timeout=900)
