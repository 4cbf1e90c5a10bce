"""What a real run (debugmodel, CPU, in process) leaves to look at: the console line with step time
and ETA, TensorBoard events holding the metrics file's values, and scripts/plot_metrics.py's PNG
of them."""

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.config import load_config
from trainer.outcome import run
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def test_tensorboard_events_and_plot_of_a_real_run(tmp_path):
    trainer = Trainer(load_config([
        "--config", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(tmp_path / "run"),
        "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--validation.freq", "2", "--validation.steps", "2", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "--job.print_config=false",
    ]))
    assert run(trainer) == 0
    run_dir = trainer.run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 2, 4]

    log = (run_dir / "train.log").read_text()
    assert f"step {STEPS}/{STEPS} [100.0%]  " in log and "s/step  eta 0:00:00  loss " in log

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    for key in ("loss", "val_loss", "grad_norm", "tokens_per_sec", "moe_imbalance", "step_time_s"):
        want = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key  # stored as float32

    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    png = tmp_path / "curves.png"
    # The dump folder the run was given: its newest (here: only) run is drawn.
    assert plot_metrics.main([str(tmp_path / "run"), "-o", str(png)]) == 0
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (880, 560)  # 11 x 7 inches at 80 dpi
        colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colors is not None and len(colors) > 50  # curves, text and axes, not a blank canvas
