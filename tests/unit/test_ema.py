"""trainer/optim/ema.py: the average after N steps against an explicit loop (bitwise: the same CPU
``lerp_`` calls) and against the textbook formula in float64 (a bound from the rounding), the
deferred update and its flush, the validation swap, and the `[ema]` config checks.
Checkpoints: tests/unit/test_checkpoint.py (single process) and tests/e2e/test_resume_fsdp.py (FSDP 2)."""

import pytest
import torch
from torch import nn

from trainer.config import ConfigError, load_config
from trainer.config.check import main as check_main
from trainer.optim.ema import ParameterEMA

U = 2.0**-24  # fp32 unit roundoff


def model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(dtype)


def run_steps(net: nn.Module, ema: ParameterEMA, steps: range, skipped: set[int], gen: torch.Generator):
    """The hook calls of a training step around a stand-in optimizer step (a random move)."""
    for step in steps:
        ema.before_forward(step)
        ema.before_optimizer(step in skipped)
        if step not in skipped:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype))
        ema.after_optimizer(stepped=step not in skipped)


def test_average_is_the_explicit_loop_bitwise_and_the_formula_within_the_rounding_bound():
    net, decay, every, steps, skipped = model(), 0.9, 2, 40, {6, 7}
    ema = ParameterEMA(net, decay, every)
    ref = [p.detach().clone() for p in net.parameters()]
    exact = [p.detach().double() for p in net.parameters()]
    gen, updates, top = torch.Generator().manual_seed(1), 0, max(p.abs().max().item() for p in ref)
    for step in range(1, steps + 1):
        run_steps(net, ema, range(step, step + 1), skipped, gen)
        if step == steps:  # the last update is owed until something reads the average
            assert all(torch.equal(a, r) for a, r in zip(ema.averages, ref))
        if step in skipped or step % every:
            continue
        updates += 1
        for i, p in enumerate(net.parameters()):
            ref[i] = torch.lerp(ref[i], p.detach(), 1 - decay)
            exact[i] = decay * exact[i] + (1 - decay) * p.detach().double()
            top = max(top, p.abs().max().item())
    ema.flush()
    assert updates == 19  # the 20 even steps of 1..40 less step 6 (skipped)
    for avg, r, e in zip(ema.averages, ref, exact):
        assert torch.equal(avg, r)
        # Each lerp rounds the difference, the product, the sum and the weight (4 u M, M >= every
        # |weight| and |average|, the average being a convex combination of weights); the exact map
        # contracts by decay <= 1, so the errors of N updates add at most N times.
        assert (avg.double() - e).abs().max().item() <= 4 * updates * U * top


def test_low_precision_weights_average_in_fp32_and_the_swap_gives_them_back_bit_for_bit():
    net = model(torch.bfloat16)
    before = [p.detach().clone() for p in net.parameters()]
    ema = ParameterEMA(net, 0.5, 1)
    assert all(a.dtype == torch.float32 and torch.equal(a, b.float()) for a, b in zip(ema.averages, before))
    run_steps(net, ema, range(1, 4), set(), torch.Generator().manual_seed(2))
    trained = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped_in():
            for p, avg in zip(net.parameters(), ema.averages):
                assert torch.equal(p, avg.bfloat16())
            assert any(not torch.equal(p, t) for p, t in zip(net.parameters(), trained))
            raise RuntimeError("inside")  # an error in the validation still restores the weights
    assert all(torch.equal(p, t) for p, t in zip(net.parameters(), trained))


def test_restart_and_load_drop_an_owed_update():
    net = model()
    ema = ParameterEMA(net, 0.5, 1)
    run_steps(net, ema, range(1, 3), set(), torch.Generator().manual_seed(3))
    assert ema.pending
    ema.restart()  # from the current weights, the owed update dropped
    ema.flush()
    assert all(torch.equal(a, p) for a, p in zip(ema.averages, net.parameters()))
    named = dict(net.named_parameters())
    assert set(ema.state_dict(named)) == set(named)
    with pytest.raises(KeyError, match="0.weight"):
        ema.state_dict({})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ema.decay", "1"], "ema.decay must be in (0, 1)"),
        (["--ema.decay", "0"], "ema.decay must be in (0, 1)"),
        (["--ema.decay", "nan"], "ema.decay must be in (0, 1)"),
        (["--ema.update_every", "0"], "ema.update_every must be >= 1"),
    ],
)
def test_bad_settings_are_one_line_before_launch(args, message, capsys):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(["--ema.enable", *args])
    assert check_main(["--world-size", "1", "--ema.enable", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_settings_without_their_switch_are_warned_about():
    assert "ema.decay = 0.99 is ignored: ema.enable is false." in load_config(["--ema.decay", "0.99"]).warnings()
    cfg = load_config(["--ema.enable", "--ema.validate", "--no-validation.enable"])
    assert "ema.validate = true is ignored: validation.enable is false." in cfg.warnings()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path (side-stream copy, worker lerp) needs CUDA")
def test_gpu_path_gives_the_cpu_lerp_bitwise():
    net = model().cuda()
    ema = ParameterEMA(net, 0.9, 1)
    assert all(a.is_pinned() and b.is_pinned() for a, b in zip(ema.averages, ema.staging))
    ref = [p.detach().cpu() for p in net.parameters()]
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 6):
        ema.before_forward(step)  # the copy of step - 1's weights is in flight ...
        ema.before_optimizer(False)  # ... and the weights' next write waits for it on the device
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen).cuda())
        ema.after_optimizer(stepped=True)
        ref = [torch.lerp(r, p.detach().cpu(), 0.1) for r, p in zip(ref, net.parameters())]
    ema.flush()
    assert all(torch.equal(a, r) for a, r in zip(ema.averages, ref))
    ema.close()
