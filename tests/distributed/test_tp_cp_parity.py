"""Loss and gradient-norm parity of tensor / context / EP-as-CP layouts with one process.

Five steps of AdamW with gradient clipping (so a wrong gradient norm changes the update), fp32,
on the same data and seed; see tests/distributed/tp_cp_parity.py for the model and data.
Layouts: TP 2; FSDP 2 + CP 2 (world 4, half a sequence per device); EP-as-CP 2;
FSDP 2 + EP 2 + TP 2 (world 4: ep borrows the two FSDP ranks).
"""

import functools

import pytest

from tests.distributed import tp_cp_parity

REL_TOL = 1e-5  # measured: <= 3e-7 on losses and norms


@functools.cache
def _reference():
    return tp_cp_parity.run_reference()


# Each layout is its own launch (~1 min on 2 cores); the same layouts run through the Trainer in
# the default suite (test_parity.py), so this finer model (q_lora, random documents) is `slow`.
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(tp_cp_parity.LAYOUTS))
def test_layout_matches_single_process(layout):
    ref = _reference()
    got = tp_cp_parity.run_layout(layout)
    assert len(got) == len(ref) == tp_cp_parity.STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref)):
        assert loss == pytest.approx(ref_loss, rel=REL_TOL), f"{layout} step {step}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=REL_TOL), f"{layout} step {step}: grad norm {norm} vs {ref_norm}"
