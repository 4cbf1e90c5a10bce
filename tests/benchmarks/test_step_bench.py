"""benchmarks/step_bench.py (the trainer's own step, variants, repeats, memory), the memory estimate
against the measured peak, and run_all's parsing."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_bench_and_memory_estimate_within_15_percent(tmp_path, capsys):
    step_bench = _load("step_bench")
    out = tmp_path / "r.json"
    result = step_bench.main(
        ["--seq-len", "128", "--batch-size", "2", "--steps", "1", "--repeats", "2", "--warmup", "1",
         "--variants", "eager,eager_float8", "--device", "cpu", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["variants"]) == ["eager"]
    assert "compute capability" in result["skipped"]["eager_float8"]
    r = result["variants"]["eager"]
    assert len(r["tokens_per_s_per_repeat"]) == 2 and r["speed_vs_first"] == 1.0
    assert r["tflops"] == pytest.approx(r["tokens_per_s"] * result["flops_per_token"] / 1e12)
    assert r["mfu_pct"] is None  # no known CPU peak
    # ... so the machine's own matmul speed, measured between the same steps, stands in for one.
    ref = result["reference_matmul_gflops_per_repeat"]
    assert len(ref) == 2 and min(ref) > 0
    assert r["pct_of_reference_matmul_per_repeat"] == pytest.approx(
        [100 * tps * result["flops_per_token"] / (g * 1e9) for tps, g in zip(r["tokens_per_s_per_repeat"], ref)]
    )
    # Every byte torch allocates in one step: at least parameters + AdamW states.
    assert r["peak_mem_mib"] * 2**20 > 12 * result["params_total"]
    # scripts/estimate_memory.py for the same debug-flavor config (fp32, no AC, one device).
    assert abs(r["estimate_vs_measured"] - 1) <= 0.15, (result["memory_estimate_mib"], r["peak_mem_mib"])
    printed = capsys.readouterr().out
    assert printed.startswith("{") and "| eager |" in printed and "skipped:" in printed
    assert "Machine speed during the run" in printed


def test_run_all_reads_each_output_kind(tmp_path):
    run_all = _load("run_all")
    result, md = run_all.parse("json_first", '{"a": 1}\n\n| t |\n', None)
    assert result == {"a": 1} and md == "| t |"
    (tmp_path / "cp.json").write_text('{"cp": 2}')
    assert run_all.parse("json_file", 'header\n{"cp": 2}\n', tmp_path / "cp.json") == ({"cp": 2}, "    header")
    text = "step time without Engram 489.0 ms | with Engram at layers [1, 3] (K=4, D_h=16) 366.0 ms | ratio 0.748\n"
    assert run_all.parse("engram_text", text, None)[0] == {"ms_without": 489.0, "ms_with": 366.0, "ratio": 0.748}


def test_model_overrides_reach_top_level_and_nested_fields():
    from models.deepseek_v3 import get_flavor
    from trainer.diagnostics import ModelOverrideError, apply_overrides

    base = get_flavor("16B")
    a = apply_overrides(base, ["n_layers=4", "moe.num_experts=16", "moe.route_norm=false", "rope_factor=2.5"])
    assert (a.n_layers, a.moe.num_experts, a.moe.route_norm, a.rope_factor) == (4, 16, False, 2.5)
    assert a.dim == base.dim and base.n_layers != 4  # the preset itself is untouched
    with pytest.raises(ModelOverrideError, match="unknown key.*n_layers"):
        apply_overrides(base, ["n_layer=4"])
    with pytest.raises(ModelOverrideError, match="moe.top_kk: unknown key; moe.\\* keys are: .*top_k"):
        apply_overrides(base, ["moe.top_kk=2"])
    with pytest.raises(ModelOverrideError, match="expected key=value"):
        apply_overrides(base, ["n_layers"])
    with pytest.raises(ModelOverrideError, match="no engram"):
        apply_overrides(base, ["engram.head_dim=8"])
    with pytest.raises(ModelOverrideError, match="top_k must be"):  # the dataclass's own validation
        apply_overrides(base, ["moe.top_k=1000"])


def test_profile_counters_trace_and_model_override(tmp_path, capsys):
    step_bench = _load("step_bench")
    result = step_bench.main(
        ["--seq-len", "32", "--batch-size", "1", "--steps", "1", "--repeats", "1", "--warmup", "1",
         "--variants", "eager", "--device", "cpu", "--model-override", "n_layers=2", "--model-override",
         "moe.top_k=1", "--profile", "--trace-dir", str(tmp_path)]
    )
    assert result["model_overrides"] == ["n_layers=2", "moe.top_k=1"]
    r = result["variants"]["eager"]
    (step,) = r["profile"]
    assert r["kernel_launches"] == step["kernel_launches"] > 100  # leaf aten ops of a whole train step
    assert step["host_syncs"] is None and r["host_reads"] == sum(step["host_reads_by_kind"].values())
    assert step["top_ops"] and step["top_ops"][0]["ms"] >= step["top_ops"][-1]["ms"]
    trace = json.loads((tmp_path / "eager_step0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    out = capsys.readouterr().out
    assert "Profile eager step 0: weight casts 0.0 MiB, kernel launches" in out  # fp32: nothing cast
