"""A newcomer's commands one after another in one working directory: the README's quickstart, its
configuration examples, a command that fails (a data file that is not there) and its corrected form. Each
succeeds without anything deleted, and each fresh run writes its own folder under the config's
job.dump_folder (./outputs/debug_model), whose metrics file holds that run's steps alone.

Every command gets the same short suffix (2 steps, a short sequence, one validation batch) to keep
the test to seconds; the suffix comes first, so the command's own options still win. The
CONFIG_FILE command and the failing one (refused by run_train.sh's pre-launch check) are launched
through run_train.sh (its pre-launch check, then its exec of `python -m trainer.train`); the
others, the quickstart among them, differ from the CONFIG_FILE command only in their options and
the config file (run_train.sh's default one, which `run_main` passes first as the script does), so
they run `trainer.train.main` in this process (tests/e2e/in_process.py): a launch would add the
~4 s import of torch and prove nothing more.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

from in_process import run_main

from trainer.run_folder import latest_run_folder

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--training.steps", "2", "--training.seq_len", "32", "--validation.steps", "1", "--no-job.print_config"]
# (environment or None for a run in this process, the command's options) in README order, the
# failing command and its correction.
COMMANDS = [
    (None, []),
    (None, ["--training.steps", "3", "--optimizer.lr=1e-3"]),
    (None, ["--no-validation.enable", "--metrics.log_freq", "1"]),
    ({"CONFIG_FILE": "my_config.toml"}, ["--training.mixed_precision_param", "bfloat16"]),
    ({}, ["--training.dataset", "json", "--training.dataset_path", "missing.jsonl"]),
    (None, ["--training.dataset", "json", "--training.dataset_path", "docs.jsonl"]),
]


def _command(tmp_path: Path, env: dict | None, options: list[str], capfd) -> subprocess.CompletedProcess:
    if env is None:
        code = run_main(tmp_path, *SHORT, *options)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(options, code, out, err)
    return subprocess.run(
        ["bash", str(REPO / "run_train.sh"), *SHORT, *options], cwd=tmp_path,
        env={**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=600,
    )


def test_readme_commands_rerun_in_one_folder(tmp_path, capfd):
    shutil.copy(REPO / "train_configs/debug_model.toml", tmp_path / "my_config.toml")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(60)))
    dump = tmp_path / "outputs" / "debug_model"
    seen = []
    for env, options in COMMANDS:
        proc = _command(tmp_path, env, options, capfd)
        out = proc.stdout + proc.stderr
        assert "Traceback" not in out, out[-3000:]
        if "missing.jsonl" in options:
            assert proc.returncode == 2 and "missing.jsonl" in proc.stderr, out[-3000:]
            continue
        assert proc.returncode == 0, (options, out[-3000:])
        run = latest_run_folder(dump)
        assert run not in seen and run.parent == dump, (run, seen)
        seen.append(run)
        # Where the run writes is the first thing it says.
        assert proc.stdout.splitlines()[0].endswith(f"run folder {run.resolve()} (a fresh run: a new folder under "
                                                    "job.dump_folder)"), proc.stdout[:500]
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        # This run's logged steps once each, from its first to its last: nothing of another run.
        assert steps == sorted(set(steps)) and [s for s in steps if s > 0][0] == 1, (options, steps)
        assert steps[-1] == (3 if "3" in options else 2), (options, steps)
        config = (run / "config.toml").read_text()
        assert ("lr = 0.001" in config) == ("--optimizer.lr=1e-3" in options)
        assert ('mixed_precision_param = "bfloat16"' in config) == ("bfloat16" in options)
    assert len(seen) == len(COMMANDS) - 1
