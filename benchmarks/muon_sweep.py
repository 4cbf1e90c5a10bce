"""Muon vs AdamW on the bundled corpus: a learning-rate sweep of the debug model, final validation loss.

Each (optimizer, LR) pair is one `run_train.sh` run of `train_configs/debug_model.toml` (200 steps,
cosine schedule, validation every 50 steps) in its own run folder; the table lists the validation
loss at the last step. Runs go `--jobs` at a time (one thread each).

    python benchmarks/muon_sweep.py --out-dir outputs/muon_sweep --jobs 3
    python benchmarks/muon_sweep.py --out-dir outputs/muon_sweep --report-only   # table of finished runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("AdamW", "muon")
LRS = (3e-3, 6e-3, 1.2e-2)


def run_folder(out_dir: Path, name: str, lr: float) -> Path:
    return out_dir / f"{name}_lr{lr:g}"


def final_val_loss(folder: Path) -> float | None:
    metrics = folder / "metrics.jsonl"
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    losses = [r for r in records if "val_loss" in r]
    return losses[-1]["val_loss"] if losses and losses[-1]["step"] > 0 else None


def launch(folder: Path, name: str, lr: float, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(29600 + 10 * OPTIMIZERS.index(name) + LRS.index(lr)))
    cmd = [str(ROOT / "run_train.sh"), "--optimizer.name", name, "--optimizer.lr", str(lr),
           "--job.dump_folder", str(folder), *extra]
    log = open(folder.parent / f"{folder.name}.out", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/muon_sweep"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--report-only", action="store_true", help="only tabulate the runs already finished")
    parser.add_argument("extra", nargs="*", help="more run_train.sh overrides, after --")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    todo = [(n, lr) for n in OPTIMIZERS for lr in LRS if final_val_loss(run_folder(args.out_dir, n, lr)) is None]
    running: list[subprocess.Popen] = []
    while todo and not args.report_only:
        running = [p for p in running if p.poll() is None]
        if len(running) < args.jobs:
            name, lr = todo.pop(0)
            folder = run_folder(args.out_dir, name, lr)
            subprocess.run(["rm", "-rf", str(folder)], check=True)
            running.append(launch(folder, name, lr, args.extra))
        else:
            time.sleep(5)
    for p in running:
        p.wait()
    rows = ["| optimizer | lr | final val_loss (step 200) |", "|---|---|---|"]
    for name in OPTIMIZERS:
        for lr in LRS:
            loss = final_val_loss(run_folder(args.out_dir, name, lr))
            rows.append(f"| {name} | {lr:g} | {'not finished' if loss is None else f'{loss:.4f}'} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
