"""Gradient accumulation trains the same model as one big batch (fp32, CPU)."""

import pytest
import torch

from trainer.config import load_config
from trainer.trainer import Trainer

pytestmark = pytest.mark.numerics  # docs/numerics.md


def _trainer(tmp_path, name, local_batch):
    cfg = load_config(
        [
            "--job.dump_folder", str(tmp_path / name),
            "--model.flavor", "debugmodel",
            "--model.attn_mask_type", "block_causal",
            "--model.moe_aux_loss_alpha", "0.001",
            "--training.seq_len", "64",
            "--training.local_batch_size", str(local_batch),
            "--training.global_batch_size", "4",
            "--training.mixed_precision_param", "float32",
            "--training.deterministic",
            # Two steps: the first compares the accumulated gradients (loss, grad norm), the second
            # the update they gave (its loss) and the parameters and expert biases after it.
            "--training.steps", "2",
            "--no-validation.enable",
            "--no-job.print_config",
        ]
    )
    return Trainer(cfg)


def test_accumulated_micro_batches_equal_one_batch(tmp_path):
    big = _trainer(tmp_path, "big", 4)
    small = _trainer(tmp_path, "small", 2)
    assert (big.grad_accum_steps, small.grad_accum_steps) == (1, 2)
    for _ in range(2):
        a = big.train_step(big.next_microbatches()[0])
        b = small.train_step(small.next_microbatches()[0])
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
    for (name, p), q in zip(big.model.named_parameters(), small.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    for name, buf in big.model.named_buffers():
        if name.endswith("expert_bias"):
            torch.testing.assert_close(buf, dict(small.model.named_buffers())[name], msg=name)
    big.close()
    small.close()
