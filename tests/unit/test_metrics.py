"""The console line's step time and ETA, and scripts/plot_metrics.py on hand-written metrics files
(a real run's metrics, TensorBoard events and plot: tests/e2e/test_metrics_outputs.py)."""

import importlib.util
import json
import os
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


def test_a_resumed_run_starts_a_new_line_after_a_cut_off_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # killed mid-write
    metrics = MetricsLogger(metrics_cfg(), tmp_path, {}, total_steps=3)
    try:
        metrics.log({"step": 2, "loss": 1.5})
    finally:
        metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 2, "lo' and json.loads(lines[2])["loss"] == 1.5


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


def test_plot_draws_the_newest_run_of_a_dump_folder_and_names_it(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    dump = tmp_path / "dump"
    write_run(dump / "20261125-120000", [{"step": 1, "loss": 1.0}])
    newest = write_run(dump / "20261125-120000-2", [{"step": s, "loss": 2.0} for s in (1, 2)])
    out = tmp_path / "x.png"
    assert plot_metrics.main([str(dump), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{dump}: a dump folder; drawing its newest run, {newest}" in printed
    assert f"{newest}: loss 2 points" in printed and out.read_bytes().startswith(b"\x89PNG")


def test_plot_names_a_folder_without_metrics(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    write_run(tmp_path / "sweep" / "lr1e-3", [{"step": 1, "loss": 1.0}])  # not a timestamped run folder
    assert plot_metrics.main([str(tmp_path / "sweep"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sweep'} has no metrics.jsonl" in err
    assert f"e.g. {tmp_path / 'sweep' / 'lr1e-3'}" in err
    assert not (tmp_path / "x.png").exists()


def test_plot_skips_a_cut_off_line_with_a_warning(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    run = write_run(tmp_path / "run", [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)])
    text = (run / "metrics.jsonl").read_text()
    # Killed while writing step 4, resumed from step 2 (the resumed run appends after the cut),
    # then killed again while writing step 3.
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "lo' + '{"step": 3, "loss": 1.5}\n{"step": 3, "loss": 1')
    assert plot_metrics.main([str(run), "-o", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {run / 'metrics.jsonl'}: skipped 2 line(s)")
    assert "(line 4, 5;" in err and "Traceback" not in err
    assert plot_metrics.read_series(run / "metrics.jsonl")["loss"] == ([1, 2, 3], [4.0, 3.0, 2.0])

    (run / "metrics.jsonl").write_text("not json\n")
    assert plot_metrics.main([str(run), "-o", str(tmp_path / "y.png")]) == 2
    assert "holds no metrics records" in capsys.readouterr().err


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write into: read-only by mode, or, for root (whom modes do
    not stop), sysfs, where nobody can create a file."""
    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


@pytest.mark.parametrize("where", ["unwritable", "under a file", "unknown suffix"])
def test_plot_checks_the_output_before_drawing(tmp_path, capsys, monkeypatch, where):
    plot_metrics = load_plot_metrics()
    run = write_run(tmp_path / "run", [{"step": 1, "loss": 1.0}])
    (tmp_path / "notes.txt").write_text("a file")
    out, says = {
        "unwritable": (unwritable_folder(tmp_path) / "curves.png", "cannot write"),
        "under a file": (tmp_path / "notes.txt" / "plots" / "curves.png", f"{tmp_path / 'notes.txt'} is a file"),
        "unknown suffix": (tmp_path / "curves.pnj", "matplotlib cannot write .pnj files; use one of"),
    }[where]

    def no_drawing(*args):
        raise AssertionError("drew before checking the output")

    monkeypatch.setattr(plot_metrics, "plot", no_drawing)
    assert plot_metrics.main([str(run), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: -o {out}: ") and says in lines[0], captured.err
    assert captured.out == "" and not out.exists()


def test_plot_into_a_folder_writes_curves_png_there(tmp_path, capsys):
    plot_metrics = load_plot_metrics()
    run = write_run(tmp_path / "run", [{"step": 1, "loss": 1.0}])
    existing = tmp_path / "plots"
    existing.mkdir()
    for given, written in (
        (str(existing), existing / "curves.png"),
        (f"{tmp_path / 'new'}{os.sep}", tmp_path / "new" / "curves.png"),  # a trailing / names a folder
        (str(tmp_path / "bare"), tmp_path / "bare.png"),  # no suffix: PNG, and the message says so
    ):
        assert plot_metrics.main([str(run), "-o", given]) == 0
        assert f"wrote {written}" in capsys.readouterr().out
        assert written.read_bytes().startswith(b"\x89PNG")
