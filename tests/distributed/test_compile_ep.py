"""Compiled expert parallelism over 2 gloo ranks: no recompile when a rank's experts receive 0, 1
or any number of rows (training and validation, under FSDP as in the Trainer), graph breaks only at
the dispatcher's two all-to-alls, and the eager numbers: losses and every gradient
(tests/distributed/compile_ep_worker.py sets the routing token by token)."""

import re

import compile_ep_worker
import pytest
import torch

from trainer.diagnostics import spawn_local
from trainer.parallel.fsdp import EXPERTS_IN_BLOCK_UNIT

pytestmark = pytest.mark.numerics  # docs/numerics.md

# Per compiled mode (training, then validation): the dense block, the MoE block's three pieces
# (before dispatch(), between the exchanges, after exchange_back()), and the loss (training only).
UNIQUE_GRAPHS = (1 + 3 + 1) + (1 + 3)
DISPATCHER_BREAKS = ["AllToAllTokenDispatcher.dispatch", "AllToAllTokenDispatcher.exchange_back"]
# Gradients, compiled vs eager, relative to the largest eager entry (fp32 reassociation: observed
# 1.2e-7 on CPU, torch 2.13).
GRAD_REL = 1e-5


def _break_site(reason: str) -> str:
    """The `torch.compiler.disable`d function a graph-break reason names, else the reason."""
    match = re.search(r"Skip inlining function <function (\S+) at", reason)
    return match.group(1) if match else reason


@pytest.mark.slow  # two ranks compile the model (inductor)
def test_compiled_ep_no_recompile_with_0_and_1_received_rows():
    results = dict(spawn_local(compile_ep_worker.run, 2, timeout=600))
    for rank, r in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"  # a RecompileError lands here
        where = f"rank {rank}"
        # Rank 1's experts received exactly the planned rows, 0 and 1 among them, after warm-up.
        assert all(planned == got for planned, got in r["received"]), (where, r["received"])
        assert {0, 1} <= {got for _, got in r["received"][1:]}, (where, r["received"])
        # Expert weights are ep DTensors read through ``to_local`` inside the compiled MoE block:
        # that adds no graph break, and the experts share their block's FSDP unit, whose hooks run
        # outside the compiled forward. Where FSDP2 has no mesh per parameter (torch < 2.13) the
        # experts are a unit of their own, whose hooks FSDP2 hides from dynamo: one break more.
        reasons = r["graph_breaks"]
        sites = [_break_site(reason) for reason in reasons]
        assert sorted(site for site in sites if site in DISPATCHER_BREAKS) == DISPATCHER_BREAKS, (where, sites)
        fsdp_hooks = [x for x, site in zip(reasons, sites) if site not in DISPATCHER_BREAKS and "fsdp" in x.lower()]
        assert len(fsdp_hooks) == (0 if EXPERTS_IN_BLOCK_UNIT else 1) and len(sites) == 2 + len(fsdp_hooks), (where, sites)
        if EXPERTS_IN_BLOCK_UNIT:  # the extra break of older torch splits the MoE pieces further
            assert r["unique_graphs"] == UNIQUE_GRAPHS, where
        torch.testing.assert_close(r["compiled_losses"], r["eager_losses"], rtol=0, atol=1e-4, msg=where)
        assert max(r["grad_differences"]) <= GRAD_REL, (where, r["grad_differences"])


def test_experts_as_their_own_fsdp_unit_match_the_unsharded_copy(two_ranks):
    """The experts as an FSDP unit of their own (torch 2.11's only layout, forced here on any
    torch): an eager training step gives the expert-parallel copy without FSDP's loss and
    gradients exactly (the only reduction is a sum of two ranks' gradients, one addition either
    way). In the fast tier's shared 2-rank launch."""
    results = dict(two_ranks["fsdp_experts_own_unit"])
    assert sorted(results) == [0, 1], results
    for rank, r in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"
        assert r["experts_own_unit"], rank
        assert r["loss"] == r["eager_loss"] and r["grad_difference"] == 0.0, (rank, r)
