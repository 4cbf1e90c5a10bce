"""The console line's step time and ETA, and scripts/plot_metrics.py on hand-written metrics files
(a real run's metrics, TensorBoard events and plot: tests/e2e/test_metrics_outputs.py)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.config import ConfigError, load_config
from trainer.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]


def load_plot_metrics():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metrics_cfg(**overrides):
    cfg = dict(enable_wandb=False, wandb_mode="disabled", jsonl_file="metrics.jsonl", enable_tensorboard=False)
    return SimpleNamespace(**{**cfg, **overrides})


def test_console_line_has_step_time_and_eta(tmp_path):
    metrics = MetricsLogger(metrics_cfg(), tmp_path, {}, total_steps=100)
    try:
        # Step 1 alone: its own step time for the 99 steps left.
        assert metrics._eta_s(1, 2.0, now=50.0) == 2.0 * 99
        # Then the wall clock since step 1 (validation and saves included): 30 s for 10 steps.
        assert metrics._eta_s(11, 1.0, now=80.0) == 3.0 * 89
        assert metrics._eta_s(0, None, now=90.0) is None
        line = metrics.format_line({"step": 11, "step_time_s": 1.234, "loss": 5.0}, eta_s=267.0)
        assert line.startswith("step  11/100 [ 11.0%]  1.23s/step  eta 0:04:27  loss 5.0000")
        metrics.log({"step": 12, "step_time_s": 0.5, "loss": 4.0})
        assert json.loads((tmp_path / "metrics.jsonl").read_text())["step_time_s"] == 0.5
    finally:
        metrics.close()


def test_tensorboard_without_its_package_is_a_config_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
    )
    assert not load_config([]).metrics.enable_tensorboard  # off by default: no package needed
    with pytest.raises(ConfigError, match=r"metrics.enable_tensorboard needs the tensorboard package: pip install"):
        load_config(["--metrics.enable_tensorboard"])


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_plot_overlays_runs_and_keeps_the_last_record_of_a_step(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    a = write_run(tmp_path / "a", [
        {"step": 0, "val_loss": 9.0},
        *({"step": s, "loss": 9.0 - s, "tokens_per_sec": 100.0 + s, "moe_imbalance": 1.5} for s in (1, 2, 3)),
        {"step": 2, "loss": 6.5, "tokens_per_sec": 90.0, "moe_imbalance": 1.4},  # resumed before step 2
        {"step": 3, "loss": 5.5, "val_loss": 6.0},
    ])
    b = write_run(tmp_path / "b", [{"step": s, "loss": 8.0 - s} for s in (1, 2)])  # no MoE, no validation
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics.main([str(a), str(b), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{a}: loss 3 points, val_loss 2 points, tokens_per_sec 3 points, moe_imbalance 3 points" in printed
    assert f"{b}: loss 2 points, val_loss 0 points" in printed
    assert out.read_bytes().startswith(b"\x89PNG")

    series = plot_metrics.read_series(a / "metrics.jsonl")
    assert series["loss"] == ([1, 2, 3], [8.0, 6.5, 5.5])
    assert series["val_loss"] == ([0, 3], [9.0, 6.0])
    fig = plot_metrics.plot({"a": series, "b": plot_metrics.read_series(b / "metrics.jsonl")}, out)
    loss_ax, val_ax, _, moe_ax = fig.axes[:4]
    assert [line.get_label() for line in loss_ax.get_lines()] == ["a", "b"]
    assert list(loss_ax.get_lines()[1].get_ydata()) == [7.0, 6.0]
    assert [line.get_label() for line in moe_ax.get_lines()] == ["a"]  # b has no MoE imbalance to draw
    assert list(val_ax.get_lines()[0].get_xdata()) == [0, 3]


def test_plot_names_a_folder_without_metrics(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    write_run(tmp_path / "dump" / "20261125-120000", [{"step": 1, "loss": 1.0}])
    assert plot_metrics.main([str(tmp_path / "dump"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'dump'} has no metrics.jsonl" in err
    assert f"e.g. {tmp_path / 'dump' / '20261125-120000'}" in err
    assert not (tmp_path / "x.png").exists()
