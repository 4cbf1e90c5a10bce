"""Long commands show their progress on stderr (trainer/progress.py, issue 48): off a terminal a
plain line every PLAIN_EVERY_S seconds and one at the end, while stdout (the planner's table) is
what it was. The dry run's phase lines: tests/distributed/test_dry_run.py (`_dry_command`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import trainer.progress

PLANNER = Path(__file__).resolve().parents[2] / "scripts" / "plan_layout.py"


def _planner():
    spec = importlib.util.spec_from_file_location("plan_layout", PLANNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_planner_reports_progress_on_stderr_and_leaves_stdout_alone(capsys, monkeypatch):
    argv = ["--flavor", "debugmodel", "--gpus", "4", "--gpu-memory", "80", "--seq-len", "32", "--global-batch", "8",
            "--top", "3"]
    planner = _planner()
    monkeypatch.setattr(trainer.progress, "PLAIN_EVERY_S", float("inf"))
    assert planner.main(argv) == 0
    quiet = capsys.readouterr()
    monkeypatch.setattr(trainer.progress, "PLAIN_EVERY_S", 0.0)  # a line per group of layouts estimated
    assert planner.main(argv) == 0
    chatty = capsys.readouterr()
    assert chatty.out == quiet.out and chatty.out.startswith("debugmodel on 4 GPUs") and "plan:" not in chatty.out
    lines = chatty.err.splitlines()
    total = int(lines[-1].split("/")[1].split()[0])
    assert lines[0] == "plan: listing the layouts of debugmodel on 4 GPUs ..."
    done = [int(line.split("estimated: ")[1].split("/")[0]) for line in lines[1:-1]]
    assert len(done) > 1 and done == sorted(set(done)) and done[-1] == total, lines[:3]
    assert "about" in lines[1] and "s left" in lines[1], lines[:3]
    assert lines[-1].startswith(f"plan: layouts estimated: {total}/{total} (100%), fit ") and "done in" in lines[-1]
    assert len(quiet.err.splitlines()) == 2  # the listing line and the final line
