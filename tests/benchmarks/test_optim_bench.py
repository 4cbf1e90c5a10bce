"""benchmarks/optim_bench.py at tiny sizes, so that it keeps running: the measured step on 1 process,
and the 671B NS FLOPs per rank computed by the optimizer's owner assignment."""

import sys
from pathlib import Path

import pytest

# Imported by name (not from a file spec), as its spawned ranks would import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import optim_bench  # noqa: E402


def test_measured_rows(tmp_path, capsys):
    world = 1  # in this process (several ranks: tests/distributed/test_muon_owners.py runs the owned step)
    rows = optim_bench.main(["--worlds", str(world), "--steps", "1", "--warmup", "1", "--model-override", "n_layers=2",
                             "--settings", "AdamW:float32,muon:float32", "--json", str(tmp_path / "rows.json")])
    adamw, muon = rows
    assert adamw["world"] == muon["world"] == world and adamw["ns_calls_max"] == 0
    assert muon["ns_calls_max"] > 0 and muon["ns_gflop_max"] > 0 and muon["host_reads"] == 0
    assert f"| {world} | muon | float32 |" in capsys.readouterr().out and (tmp_path / "rows.json").exists()


@pytest.mark.slow  # the 671B flavor built on the meta device: seconds
def test_671b_layouts_before_and_after():
    rows = {r["layout"]: r for r in optim_bench.flops_671b()}
    assert len(rows) == 3
    for r in rows.values():
        assert r["pooled_max"] <= r["local_max"] < r["before_max"] and r["matrices_local_max"] < r["matrices_before_max"] / 10
        # Every matrix once: the pooled work adds up to the model's NS, each matrix counted once.
        assert r["pooled_mean"] * 2048 == pytest.approx(r["once"])
    # Before, without PP every rank orthogonalises every non-expert matrix: about 1.7e15 FLOPs (issue 32).
    assert rows["FSDP 2048 x EP 64"]["matrices_before_max"] == pytest.approx(1.75e15, rel=0.05)
    # Experts pooled: with no pipeline stage to confine them, the busiest rank carries one `wo`
    # (7168 x 16384, 22.6 TFLOP), where experts left where held put 122 (efsdp 32 over 4 experts
    # per EP rank) and 243 TFLOP (HSDP's replicas) on a rank.
    for layout in ("FSDP 2048 x EP 64", "HSDP 16 x 128 (EP 64)"):
        assert rows[layout]["pooled_max"] == pytest.approx(22.6e12, rel=0.01)
        assert rows[layout]["expert_matrices_pooled"] == (58 + 1) * 3 * 256  # 58 MoE layers and MTP's block
