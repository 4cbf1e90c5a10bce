"""bf16 on one process: FSDP2's mixed precision casts every weight once per step (not at every
use, as autocast alone does, `training.one_process_cast = "autocast"`), while master weights,
gradients and optimizer state stay fp32."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from trainer.config import load_config
from trainer.diagnostics import weight_cast_bytes
from trainer.trainer import Trainer


def _trainer(tmp_path, precision: str, local_batch: int = 2, cast: str = "fsdp") -> Trainer:
    cfg = load_config(
        [
            "--job.config_file", "train_configs/debug_model.toml",
            "--job.dump_folder", str(tmp_path / f"{precision}_{cast}"),
            "--training.one_process_cast", cast,
            "--training.seq_len", "32",
            "--training.local_batch_size", str(local_batch),
            "--training.global_batch_size", "2",
            "--training.mixed_precision_param", precision,
            "--training.steps", "2",
            "--no-validation.enable",
            "--no-job.print_config",
        ]
    )
    return Trainer(cfg)


def _step_cast_bytes(trainer: Trainer) -> tuple[int, dict]:
    trainer.step = 1
    batches, _ = trainer.next_microbatches()
    stats = {}
    return weight_cast_bytes(trainer.model, lambda: stats.update(trainer.train_step(batches))), stats


@pytest.fixture(scope="module")
def bf16_step(tmp_path_factory):
    """The FSDP-cast bf16 trainer with 2 micro-batches of one row, after one step: it, the step's
    cast bytes and stats (shared by the two tests that read that step)."""
    trainer = _trainer(tmp_path_factory.mktemp("bf16"), "bfloat16", local_batch=1)
    try:
        cast, stats = _step_cast_bytes(trainer)
        yield trainer, cast, stats
    finally:
        trainer.close()


def test_bf16_casts_each_weight_once_per_step_and_keeps_fp32_state(bf16_step):
    trainer, cast, stats = bf16_step  # 2 micro-batches: still one cast
    assert trainer.grad_accum_steps == 2
    params = list(trainer.model.parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    assert cast == sum(2 * p.numel() for p in params)
    assert stats["loss"] > 0
    state = [s for s in trainer.optimizer.state.values() if "exp_avg" in s]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state)
    assert all(p.grad is None for p in params)  # zeroed after the step; grads were fp32


def test_fp32_run_is_not_wrapped_and_casts_nothing(tmp_path):
    trainer = _trainer(tmp_path, "float32")
    try:
        assert not any(isinstance(p, DTensor) for p in trainer.model.parameters())
        assert _step_cast_bytes(trainer)[0] == 0
    finally:
        trainer.close()


def test_one_process_cast_autocast_is_not_wrapped_and_casts_at_every_use(tmp_path, bf16_step):
    _, fsdp_cast, fsdp_stats = bf16_step
    autocast = _trainer(tmp_path, "bfloat16", 1, cast="autocast")
    try:
        params = list(autocast.model.parameters())
        assert not any(isinstance(p, DTensor) for p in params)
        cast, stats = _step_cast_bytes(autocast)
        assert cast > fsdp_cast  # each of the 2 micro-batches casts the weights it uses again
        # Same weights and batches, both computing in bf16: the policies differ only in rounding.
        assert abs(stats["loss"] - fsdp_stats["loss"]) < 1e-2 * fsdp_stats["loss"]
    finally:
        autocast.close()
