"""Loss-parity worker: trains the debug model for a few steps under several parallel layouts in
one process group and returns each layout's losses and gradient norms.

`run` is a `trainer.diagnostics.spawn_local_jobs` job: test_parity.py runs one job per world
size (2 and 4) in one spawn of 4 ranks, so each rank imports torch once for both.

Every layout runs the real ``Trainer`` (meta build -> parallelize -> weights -> train_step), fp32,
deterministic, from the same weights (the layout-invariant init, trainer/parallel/weight_init.py).

Identical data: every rank builds the *global* batch of each step from the same single-process
loader (dp world 1, batch = global batch) and keeps rows ``[dp_rank * local : (dp_rank + 1) *
local]``, the rows the trainer's own loader gives it (trainer/data/datasets.py; that loader's
parity is tested through run_train.sh in tests/e2e/test_layout_parity.py). The single-process
reference reads the same global batches whole, so all layouts see the same tokens per step.

``reference`` also runs the single-process layout on rank 0 before the process group starts.
``tp_cp_layouts`` runs tests/distributed/tp_cp_parity.py's layouts (a q_lora model trained by
hand) in the same process group afterwards, under "tp_cp/<layout>": one job instead of one each.
With 4 ranks it also runs tests/distributed/qk_clip_tp.py's QK-clip check (TP 2 x FSDP 2).
Adding a layout (TP, CP, ...): one entry in ``LAYOUTS`` with its ``[parallelism]`` overrides and
its world size; the pytest side (test_parity.py) lists which layouts it runs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# world size, [parallelism] overrides (dp_shard inferred when absent)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "fsdp_2_ep_2": (2, {"ep": 2}),
    "fsdp_4_ep_2": (4, {"ep": 2}),
    "hsdp_2x2_ep_2": (4, {"dp_replicate": 2, "ep": 2}),
    "fsdp_2_ac_op": (2, {}),
    "fsdp_2_ep_2_ac_full": (2, {"ep": 2}),
}
EXTRA = {
    "fsdp_2_ac_op": ["--activation_checkpoint.mode", "op"],
    "fsdp_2_ep_2_ac_full": ["--activation_checkpoint.mode", "full"],
}

GLOBAL_BATCH = 4
SEQ_LEN = 64
STEPS = 5


def _config(layout: str, dump: str):
    from trainer.config import load_config
    from trainer.parallel.parallel_dims import ParallelDims

    world, overrides = LAYOUTS[layout]
    argv = [
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", dump,
        "--no-job.print_config",
        "--training.steps", str(STEPS),
        "--training.seq_len", str(SEQ_LEN),
        "--training.global_batch_size", str(GLOBAL_BATCH),
        "--training.device", "cpu",
        "--training.deterministic",
        "--no-validation.enable",
        "--lr_scheduler.warmup_steps", "2",
    ]
    dims = ParallelDims(
        dp_replicate=overrides.get("dp_replicate", 1), dp_shard=overrides.get("dp_shard", -1),
        cp=overrides.get("cp", 1), tp=overrides.get("tp", 1), ep=overrides.get("ep", 1),
        ep_as_cp=bool(overrides.get("ep_as_cp", False)), world_size=world,
    )
    argv += ["--training.local_batch_size", str(GLOBAL_BATCH // dims.dp_degree)]
    for key, value in overrides.items():
        argv += [f"--parallelism.{key}", str(value)]
    argv += EXTRA.get(layout, [])
    return load_config(argv)


def _global_batches(trainer, n: int):
    from trainer.data import build_dataloader

    t = trainer.cfg.training
    loader = build_dataloader(
        tokenizer=trainer.tokenizer, dataset=t.dataset, dataset_path=None, seq_len=t.seq_len,
        batch_size=GLOBAL_BATCH, dp_rank=0, dp_world_size=1, split="train", seed=t.seed, infinite=True,
    )
    it = iter(loader)
    return [next(it) for _ in range(n)]


def run_layout(layout: str, workdir: str) -> dict:
    from trainer.trainer import Trainer

    trainer = Trainer(_config(layout, os.path.join(workdir, layout)))
    try:
        local = trainer.cfg.training.local_batch_size
        lo = trainer.dp_rank * local
        losses, norms = [], []
        for inputs, labels in _global_batches(trainer, STEPS):
            trainer.step += 1
            stats = trainer.train_step([(inputs[lo : lo + local], labels[lo : lo + local])])
            losses.append(stats["loss"])
            norms.append(stats["grad_norm"])
        return {"loss": losses, "grad_norm": norms, "dp_world": trainer.dp_world}
    finally:
        trainer.metrics.close()


def check_init(layout: str, workdir: str) -> dict:
    """The layout-invariant init: every parameter of the layout's Trainer, gathered whole, equals
    the same seed's single-process init; the experts are DTensors sharded on "ep" (FSDP on top:
    with efsdp > 1 as ``_StridedShard``) and the two ep ranks' halves differ."""
    from torch.distributed.tensor import DTensor, Shard

    from models.deepseek_v3.model import DeepSeekV3Model
    from trainer.parallel.weight_init import init_model_weights
    from trainer.trainer import Trainer

    trainer = Trainer(_config(layout, os.path.join(workdir, "init")))
    try:
        with torch.device("meta"):
            reference = DeepSeekV3Model(trainer.model_args)
        reference.to_empty(device="cpu")
        init_model_weights(reference, trainer.cfg.training.seed)
        want = dict(reference.named_parameters())
        same = True
        for name, param in trainer.model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            same &= bool(torch.equal(full.detach(), want[name].detach()))
        param = trainer.model.layers["1"].ffn.experts.w1
        w1 = param.full_tensor()
        half = w1.shape[0] // 2
        return {
            "matches_single_process": same,
            "ranks_differ": not torch.equal(w1[:half], w1[half:]),
            "ep_sharded": isinstance(param, DTensor) and isinstance(param.placements[-1], Shard)
            and param.device_mesh.mesh_dim_names[-1] == "ep",
        }
    finally:
        trainer.metrics.close()


def run(
    rank: int, nproc: int, port: int, layouts: list[str], tp_cp_layouts: list[str], reference: bool, queue
) -> None:
    """Puts (rank, results by layout) on `queue`; rank 0's also hold the reference's."""
    from trainer.diagnostics import set_torchrun_env

    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        if reference and rank == 0:
            os.environ["WORLD_SIZE"] = "1"
            results["single"] = run_layout("single", workdir)
        set_torchrun_env(rank, nproc, port)
        for layout in layouts:
            if LAYOUTS[layout][0] != nproc:
                raise ValueError(f"layout {layout} needs {LAYOUTS[layout][0]} ranks, not {nproc}")
            results[layout] = run_layout(layout, workdir)
        for layout in ("fsdp_2_ep_2", "fsdp_4_ep_2"):  # efsdp 1 and 2
            if LAYOUTS[layout][0] == nproc and any("ep_2" in x for x in layouts):
                results[f"init_{layout}"] = check_init(layout, workdir)
    if tp_cp_layouts:
        from tests.distributed import tp_cp_parity

        for layout in tp_cp_layouts:
            results[f"tp_cp/{layout}"] = tp_cp_parity.train_layout(layout)
    if nproc == 4:
        from tests.distributed import qk_clip_tp

        results["qk_clip_tp2_fsdp2"] = qk_clip_tp.check()
    from trainer.distributed import destroy_distributed

    destroy_distributed()
    queue.put((rank, results))
