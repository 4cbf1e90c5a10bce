"""Checkpoint/resume of real training runs (debugmodel, seq_len 64, fp32, deterministic, CPU).

- exact resume: a run killed by SIGKILL in the middle of an async save (of step 10), resumed
  from its last complete checkpoint (step 5), gives bit-identical losses for steps 6-10 to an
  uninterrupted 10-step run. All runs inject a NaN
  at step 2, so the same test shows the step is skipped and training goes on, and that the
  skip counter and LR schedule survive the resume.
- SIGTERM: run_train.sh exits 0 with a checkpoint at its last step.
- too many non-finite steps: the run stops with exit code 3, saves nothing broken and names the
  checkpoint it saved before as the one a rerun resumes from.
- damaged checkpoint: the newest checkpoint's shard gets 4 KiB of flipped bytes (same size) and
  its `COMPLETE` marker is cut off, so the marker no longer records the checksums that would
  catch the shard; the rerun reports the marker by name, resumes from the one before, and repeats
  the uninterrupted run's losses bit for bit. Then a weight turned inf after an optimizer step:
  the next save is refused, exit code 3, the message names the checkpoint the run verified, and
  that checkpoint stays (keep_latest_k = 1 would have pruned it).
- tampered checkpoint: the newest checkpoint's `.metadata`, and a non-tensor entry of the one
  before, replaced by pickles that create a file when unpickled, the markers' checksums updated to
  match: each rerun (the default resume, then `load_step` of the older one) exits 2 with one line
  naming the file, without falling back to another checkpoint, and the file is never created;
  so does a 2-process run_train.sh (an FSDP resume), with one line per rank.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import flip_bytes, tamper_entry, tamper_metadata
from trainer.checkpoint import COMPLETE, list_checkpoints
from trainer.config import load_config
from trainer.outcome import run
from trainer.train import main
from trainer.trainer import Trainer

pytestmark = pytest.mark.numerics  # docs/numerics.md

REPO = Path(__file__).resolve().parents[2]
STEPS = 10  # checkpoints at STEPS / 2 and STEPS: 10 straight vs 5, kill, resume, 5 more
BASE = [
    "--config", str(REPO / "train_configs/debug_model.toml"),
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--training.deterministic",
    "--no-validation.enable", "--metrics.log_freq", "1", "--job.print_config=false",
]
COMMON = [*BASE, "--training.debug_inject_nan_step", "2"]

# Runs the trainer with a DCP writer that SIGKILLs the process once the data of the last step is on
# disk but before DCP writes its .metadata: the worst moment of an async save.
KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    from trainer.config import load_config
    from trainer.trainer import Trainer

    class DieMidSave(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(load_config(sys.argv[1:]))
    trainer.checkpointer.storage_writer_factory = (
        lambda path: DieMidSave(str(path)) if path.name == "step-%d.tmp" else dcp.FileSystemWriter(str(path))
    )
    trainer.train()
    """
    % STEPS
)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a resumed run appends, so the last record of a step wins."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def run_in_process(*args: str) -> Trainer:
    trainer = Trainer(load_config([*COMMON, *args]))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Trainer:
    """The uninterrupted run, checkpointed at STEPS / 2 and STEPS: the reference of the SIGKILL
    resume and the source of the damaged-checkpoint test's folder (one run for both; a sync save
    changes no loss)."""
    run_dir = tmp_path_factory.mktemp("resume") / "straight"
    return run_in_process("--job.dump_folder", str(run_dir), "--checkpoint.enable", "--checkpoint.interval",
                          str(STEPS // 2), "--checkpoint.keep_latest_k", "0")


def test_exact_resume_after_sigkill_during_async_save(tmp_path, reference):
    ref_losses = losses(reference.run_dir)
    assert math.isnan(ref_losses[2]), "step 2 carries the injected NaN"
    assert all(math.isfinite(ref_losses[s]) for s in ref_losses if s != 2)
    assert reference.nonfinite.total == 1
    assert all(torch.isfinite(p).all() for p in reference.model.parameters())
    assert "optimizer step skipped" in (reference.run_dir / "train.log").read_text()

    killed = tmp_path / "killed"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS // 2), "--checkpoint.async_mode", "async"]
    # The same intra-op thread count as the in-process runs: CPU reductions split by thread.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, *COMMON, "--job.dump_folder", str(killed), *ckpt],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    folder = killed / "checkpoint"
    assert [c.step for c in list_checkpoints(folder)] == [STEPS // 2]
    partial = folder / f"step-{STEPS}.tmp"
    assert any(partial.glob("*.distcp")) and not (partial / COMPLETE).exists()

    resumed = run_in_process("--job.dump_folder", str(killed), *ckpt)
    log = (killed / "train.log").read_text()
    assert f"resumed from {folder / f'step-{STEPS // 2}'}" in log
    got = losses(killed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == ref_losses[step] or (math.isnan(got[step]) and math.isnan(ref_losses[step])), step
    assert resumed.nonfinite.total == 1  # the skip before the checkpoint was restored
    for (name, p), q in zip(reference.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert [c.step for c in list_checkpoints(folder)] == [STEPS, STEPS // 2]


def test_sigterm_saves_and_exits_zero(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "NGPU": "1"}
    proc = subprocess.Popen(
        ["bash", str(REPO / "run_train.sh"), *BASE, "--training.steps", "1000", "--job.dump_folder", str(run_dir),
         "--checkpoint.enable", "--checkpoint.interval", "1000"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    last = max(losses(run_dir))
    assert 1 <= last < 1000
    assert [c.step for c in list_checkpoints(run_dir / "checkpoint")] == [last]
    assert f"stopped at step {last} (received SIGTERM)" in out


def test_repeated_nan_stops_without_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    rc = main([*COMMON, "--job.dump_folder", str(run_dir), "--training.steps", "2", "--training.max_skipped_steps", "1",
               "--checkpoint.enable", "--checkpoint.interval", "1"])
    assert rc == 3
    assert [c.step for c in list_checkpoints(run_dir / "checkpoint")] == [1]
    log = (run_dir / "train.log").read_text()
    assert "1 consecutive steps with a non-finite loss" in log
    assert f"the newest good checkpoint is {run_dir / 'checkpoint' / 'step-1'} (saved by this run;" in log


def test_damaged_checkpoint_is_skipped_and_nonfinite_state_never_saved(tmp_path, reference):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    ckpt = ["--job.dump_folder", str(run_dir), "--checkpoint.enable", "--checkpoint.interval", str(STEPS // 2),
            "--checkpoint.keep_latest_k", "0"]
    shutil.copytree(reference.run_dir, run_dir)  # its checkpoints at STEPS / 2 and STEPS
    straight = losses(run_dir)
    assert sorted(straight) == list(range(1, STEPS + 1))
    shard = next((folder / f"step-{STEPS}").glob("*.distcp"))
    size = shard.stat().st_size
    flip_bytes(shard)
    assert shard.stat().st_size == size
    marker = folder / f"step-{STEPS}" / COMPLETE
    marker.write_text(marker.read_text()[:100])

    records_before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert main([*COMMON, *ckpt]) == 0
    log = (run_dir / "train.log").read_text()
    assert (f"checkpoint step-{STEPS} is corrupt or partial ({marker} is damaged: not the JSON its save wrote "
            in log)
    assert f"falling back to step-{STEPS // 2}" in log and "records no checksums" not in log
    assert f"resumed from {folder / f'step-{STEPS // 2}'}" in log
    rerun = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[records_before:]]
    assert [r["step"] for r in rerun] == list(range(STEPS // 2 + 1, STEPS + 1))
    for r in rerun:
        assert r["loss"] == straight[r["step"]], r["step"]

    newest = folder / f"step-{STEPS}"
    marker = (newest / COMPLETE).read_text()
    trainer = Trainer(load_config([*COMMON, *ckpt, "--training.steps", str(STEPS + 2), "--checkpoint.interval", "1",
                                   "--checkpoint.keep_latest_k", "1"]))
    assert trainer.step == STEPS

    def blow_up(optimizer, args, kwargs):
        with torch.no_grad():
            trainer.model.embed.weight[3, 5] = math.inf

    trainer.optimizer.register_step_post_hook(blow_up)
    assert run(trainer) == 3
    log = (run_dir / "train.log").read_text()
    assert f"step {STEPS + 1}: NaN or inf in" in log and "model.embed.weight" in log
    assert (f"NaN or inf; no checkpoint saved; the newest good checkpoint is {newest} (its checksums verified when "
            "this run resumed from it;") in log
    assert [c.step for c in list_checkpoints(folder)] == [STEPS, STEPS // 2]
    assert (newest / COMPLETE).read_text() == marker
    assert not list(folder.glob(f"step-{STEPS + 1}*"))


def test_tampered_checkpoint_stops_the_run_with_exit_2(tmp_path, reference, capsys):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoint"
    shutil.copytree(reference.run_dir, run_dir)
    sentinel = tmp_path / "ran"
    tamper_metadata(folder / f"step-{STEPS}", sentinel)
    shard = tamper_entry(folder / f"step-{STEPS // 2}", "train_state.step", sentinel)
    ckpt = ["--job.dump_folder", str(run_dir), "--checkpoint.enable"]
    log_before = len((run_dir / "train.log").read_text())
    capsys.readouterr()
    for extra, file in (([], folder / f"step-{STEPS}" / ".metadata"), (["--checkpoint.load_step", str(STEPS // 2)], shard)):
        assert main([*COMMON, *ckpt, *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {file} holds "), lines
        assert "remove the checkpoint" in lines[0]
    assert not sentinel.exists()
    assert "resumed from" not in (run_dir / "train.log").read_text()[log_before:]


def test_tampered_checkpoint_stops_every_rank(tmp_path, reference):
    """The refusal of an entry inside DCP's collective read reaches every rank of an FSDP resume:
    run_train.sh exits 2 with one line per rank naming the file, no hang, no traceback."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    sentinel = tmp_path / "ran"
    shard = tamper_entry(run_dir / "checkpoint" / f"step-{STEPS}", "train_state.step", sentinel)
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "MASTER_PORT": "", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), *COMMON, "--training.local_batch_size", "1", "--job.dump_folder",
         str(run_dir), "--checkpoint.enable"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    assert len(lines) == 2 and all(f"{shard} holds in its entry train_state.step the global" in line for line in lines)
    assert not sentinel.exists()
