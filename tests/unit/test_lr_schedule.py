import math

import pytest
import torch

from trainer.config import LRScheduler
from trainer.optim.lr_schedule import build_lr_scheduler, lr_factor


def factors(steps, **kw):
    args = dict(total_steps=steps, warmup_steps=0, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    args.update(kw)
    return [lr_factor(s, **args) for s in range(1, steps + 1)]


def test_warmup_is_linear_and_never_zero():
    f = factors(20, warmup_steps=4, decay_ratio=0.0)
    assert f[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert all(x == 1.0 for x in f[4:])


def test_wsd_stable_then_decay_to_min():
    f = factors(100, warmup_steps=10, decay_ratio=0.2, min_lr_factor=0.1)
    assert all(x == 1.0 for x in f[10:80])
    decay = f[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["linear", "cosine", "sqrt"])
def test_decay_shapes(kind):
    f = factors(11, warmup_steps=1, decay_type=kind)
    # Halfway through the 10 decay steps.
    mid = f[5]
    expected = {"linear": 0.5, "cosine": 0.5 * (1 + math.cos(math.pi * 0.5)), "sqrt": 1 - math.sqrt(0.5)}[kind]
    assert mid == pytest.approx(expected)
    assert f[-1] == pytest.approx(0.0)


def test_sqrt_decays_faster_than_linear_early_and_cosine_slower():
    lin = factors(101, warmup_steps=1, decay_type="linear")
    cos = factors(101, warmup_steps=1, decay_type="cosine")
    sq = factors(101, warmup_steps=1, decay_type="sqrt")
    assert sq[10] < lin[10] < cos[10]


def test_warmup_longer_than_run_is_clamped():
    f = factors(5, warmup_steps=50)
    assert f == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0)
    sched = build_lr_scheduler(opt, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2 / 3, 4 / 3, 2.0, 4 / 3, 2 / 3, 0.0])
