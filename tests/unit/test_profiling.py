"""[profiling]: traces for chosen steps, rank filter, CUDA memory snapshots (wiring), step breakdown."""

import json

import pytest
import torch

from trainer.config import Profiling, load_config
from trainer.profiling import Profiler, StepBreakdown
from trainer.trainer import Trainer


def test_trace_and_step_breakdown_in_a_training_run(tmp_path):
    cfg = load_config(
        [
            "--job.dump_folder", str(tmp_path),
            "--training.seq_len", "32",
            "--training.local_batch_size", "2",
            "--training.steps", "3",
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1",
            "--no-validation.enable",
            "--no-job.print_config",
            "--profiling.enable_profiling",
            "--profiling.profile_start_step", "2",
            "--profiling.profile_steps", "1",
            "--profiling.step_breakdown",
            "--profiling.memory_snapshot_step", "2",
        ]
    )
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    # Exactly the chosen step is traced, as a Chrome trace holding the step's ops.
    run_dir = trainer.run_dir
    traces = list((run_dir / "profile_traces").iterdir())
    assert [p.name for p in traces] == ["rank0_steps2-2.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") or "aten::addmm" in e.get("name", "") for e in events)
    # On CPU the snapshot request is refused with the reason, not silently dropped.
    assert "skipped on cpu" in (run_dir / "train.log").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        phases = [r[f"time/{k}_ms"] for k in ("data_wait", "forward_backward", "reduce_clip", "optimizer")]
        assert all(v >= 0 for v in phases) and r["time/forward_backward_ms"] > 0
        # The phases partition the step: their sum is the step time (tokens / tokens per s).
        step_ms = 1000 * 2 * 32 / r["tokens_per_sec"]
        assert 0.7 * step_ms < sum(phases) <= 1.01 * step_ms


def test_rank_filter_writes_nothing_on_other_ranks(tmp_path):
    prof = Profiler(Profiling(enable_profiling=True, profile_start_step=1, ranks=[1]), tmp_path, torch.device("cpu"))
    prof.step_begin(1)
    torch.ones(2).sum()
    prof.step_end(1)
    prof.close()
    assert not (tmp_path / "profile_traces").exists()


def test_cuda_memory_snapshots_on_step_and_oom(tmp_path, monkeypatch):
    """The allocator calls are CUDA-only; record what the profiler asks of them."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    pcfg = Profiling(memory_snapshot_step=2, memory_snapshot_on_oom=True)
    prof = Profiler(pcfg, tmp_path, torch.device("cuda"))
    for step in (1, 2, 3):
        prof.step_end(step)
    prof.on_oom(3)
    prof.close()
    folder = tmp_path / "profile_traces"
    assert calls == [
        ("record", {"max_entries": 100_000}),
        ("dump", str(folder / "rank0_memory_step2.pickle")),
        ("dump", str(folder / "rank0_oom_step3.pickle")),
        ("record", {"enabled": None}),
    ]


def test_breakdown_disabled_is_free_and_empty():
    b = StepBreakdown(False, torch.device("cpu"))
    b.begin(0.5)
    b.mark("optimizer")
    assert b.window_record() == {}


@pytest.mark.parametrize("argv", [["--profiling.profile_steps", "0"], ["--profiling.memory_snapshot_step", "0"]])
def test_bad_profiling_options(argv):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="profiling"):
        load_config(argv)


def test_profile_step_counts_host_reads_and_leaf_ops(tmp_path):
    from trainer.diagnostics import profile_step

    x = torch.tensor([1.0, -2.0, 3.0])

    def step():
        y = x * 2
        y.sum().item()
        y.tolist()
        int(y[0])
        bool(y[1] > 0)
        y[y > 0].sum()
        torch.nonzero(y)
        torch.ones(2, device="meta").sum()  # another device: not a host read of this one

    r = profile_step(step, torch.device("cpu"), tmp_path / "t.json")
    assert r["host_reads_by_kind"] == {"item": 1, "tolist": 1, "__int__": 1, "__bool__": 1, "bool_index": 1,
                                       "nonzero": 1}
    assert r["host_reads"] == 6 and r["host_syncs"] is None
    assert r["scalar_reads_aten"] == 3  # item, int(), bool(): the reads that go through aten
    assert r["kernel_launches"] >= 8 and "CPU proxy" in r["kernel_launch_counter"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert profile_step(step, torch.device("cpu"), count_python_reads=False)["host_reads"] is None
