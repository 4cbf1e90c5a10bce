"""benchmarks/moe_bench.py and its `--model-override` parser."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from models.deepseek_v3 import get_flavor
from trainer.diagnostics import model_overrides

_spec = importlib.util.spec_from_file_location("moe_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "moe_bench.py")
moe_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_bench)


def test_overrides_reach_model_and_moe_fields():
    args = model_overrides.apply_overrides(
        get_flavor("16B"), ["n_layers=4", "dim=1024", "moe.top_k=4", "moe.use_grouped_mm=false", "init_std=0.01"]
    )
    assert (args.n_layers, args.dim, args.init_std) == (4, 1024, 0.01)
    assert (args.moe.top_k, args.moe.use_grouped_mm) == (4, False)
    assert args.moe.num_experts == get_flavor("16B").moe.num_experts


@pytest.mark.parametrize(
    "override, message",
    [
        ("layers=4", "layers: unknown key"),
        ("moe.n_layers=4", "moe.n_layers: unknown key"),
        ("n_layers=four", "n_layers=four"),
        ("n_layers", "expected key=value"),
        ("moe.top_k=99", "top_k must be in"),  # the dataclass's own validation
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        model_overrides.apply_overrides(get_flavor("debugmodel"), [override])


def test_bench_reports_the_ratio_with_overrides(monkeypatch, capsys):
    argv = ["moe_bench.py", "--tokens", "32", "--rounds", "1", "--warmup", "0", "--device", "cpu",
            "--model-override", "dim=64", "--model-override", "moe.num_experts=4", "--model-override", "moe.num_expert_groups=2"]
    monkeypatch.setattr(sys, "argv", argv)
    moe_bench.main()
    report = json.loads(capsys.readouterr().out.split("\n\n")[0])
    assert report["dim"] == 64 and report["experts"] == 4
    assert report["model_overrides"] == ["dim=64", "moe.num_experts=4", "moe.num_expert_groups=2"]
    ratios = {r["variant"]: r["ratio_to_ideal"] for r in report["results"]}
    assert ratios["dense_same_active_flops"] == 1.0 and ratios["moe_grouped_mm"] > 0


def test_bench_rejects_an_unknown_override(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["moe_bench.py", "--device", "cpu", "--model-override", "nope=1"])
    with pytest.raises(SystemExit):
        moe_bench.main()


def test_bench_compile_flag_compiles_every_variant(monkeypatch, capsys):
    compiled = []
    monkeypatch.setattr(moe_bench.torch, "compile", lambda fn: compiled.append(fn) or fn)
    argv = ["moe_bench.py", "--tokens", "32", "--rounds", "1", "--warmup", "0", "--device", "cpu",
            "--model-override", "dim=64", "--compile"]
    monkeypatch.setattr(sys, "argv", argv)
    moe_bench.main()
    report = json.loads(capsys.readouterr().out.split("\n\n")[0])
    assert report["compile"] is True and len(compiled) == 3
