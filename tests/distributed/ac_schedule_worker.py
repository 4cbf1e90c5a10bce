"""Worker of tests/distributed/test_ac_schedules.py: trains the debug model through the real
`Trainer` (its own loader, `Trainer.train`, metrics.jsonl) for each case in turn in one process
group, and puts rank 0's per-step loss, gradient norm and MoE load imbalance on the queue.

Every case is a list of command-line flags on top of `COMMON` (fp32, deterministic, global batch
8, seq_len 16, the bias update on, every step logged): the layouts give each data rank its rows of
the same global batches (trainer/data/datasets.py) and start from the same weights (the
layout-invariant init, trainer/parallel/weight_init.py), so each must train as one process does.

One launch of four ranks runs everything: first as two pairs side by side, each a 2-rank world
of its own (ranks 0-1 and 2-3, each pair on its own port) running its share of the 2-rank cases,
then as one 4-rank world. ``references`` maps a rank to the flags of a one-process run it trains
first (WORLD_SIZE 1), before its pair's process group starts, so the references run in the same
launch as the layouts. On 2 cores the two pairs also fill each other's pipeline bubbles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from trainer.diagnostics import set_torchrun_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
COMMON = [
    "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--no-job.print_config",
    "--training.steps", str(STEPS), "--training.seq_len", "16", "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32", "--training.deterministic", "--training.device", "cpu",
    "--metrics.log_freq", "1", "--no-validation.enable", "--lr_scheduler.warmup_steps", "5",
    "--lr_scheduler.decay_ratio", "0",
]


def train(flags: list[str], folder: Path) -> dict[int, dict] | None:
    """One run of ``flags``; on rank 0 its logged loss, grad_norm and moe_imbalance by step (None
    elsewhere)."""
    from trainer.config import load_config
    from trainer.run_folder import latest_run_folder
    from trainer.trainer import Trainer

    trainer = Trainer(load_config([*COMMON, "--job.dump_folder", str(folder), *flags]))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()  # the process group stays for the next case
    if int(os.environ.get("RANK", "0")) != 0 and os.environ["WORLD_SIZE"] != "1":
        return None
    records: dict[int, dict] = {}
    for line in (latest_run_folder(folder) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(
            {key: record[key] for key in ("loss", "grad_norm", "moe_imbalance") if key in record}
        )
    return records


def run(rank: int, world: int, port: int, pair_cases: list[dict[str, list[str]]], pair_ports: list[int],
        cases: dict[str, list[str]], references: dict[int, tuple[str, list[str]]], folder: str, queue) -> None:
    """On `world` = 4 ranks: ``references`` first (one process each), then pair ``rank // 2``'s
    cases ``pair_cases[rank // 2]`` on its 2 ranks (port ``pair_ports[rank // 2]``), then every case
    of ``cases`` on all ranks; puts ``(name, records)`` once per reference and case."""
    from trainer.distributed import destroy_distributed

    torch.set_num_threads(1)
    os.environ.update(WANDB_MODE="disabled", WORLD_SIZE="1")
    if rank in references:
        name, flags = references[rank]
        queue.put((name, train(flags, Path(folder) / name)))
    pair, pair_rank = divmod(rank, 2)
    for group_rank, group_world, group_port, group_cases in (
        (pair_rank, 2, pair_ports[pair], pair_cases[pair]),
        (rank, world, port, cases),
    ):
        set_torchrun_env(group_rank, group_world, group_port)
        try:
            for name, flags in group_cases.items():
                records = train(flags, Path(folder) / name)
                if group_rank == 0:
                    queue.put((name, records))
        finally:
            destroy_distributed()
