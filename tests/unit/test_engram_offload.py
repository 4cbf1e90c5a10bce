"""`engram.offload_optimizer_state`: the tables' Adam state lives on the CPU, updates match."""

import dataclasses

import pytest
import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import EngramArgs, NgramHasher, TokenCompression, engram_table_params
from trainer.config import load_config
from trainer.optim.build import build_optimizer
from trainer.optim.lr_schedule import build_lr_scheduler

pytestmark = pytest.mark.numerics  # docs/numerics.md

ENGRAM = EngramArgs(layer_ids=(0, 1), max_ngram=3, heads_per_order=2, base_size=37, head_dim=4)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _setup(offload: bool, device: str):
    cfg = load_config([
        "--engram.enable", "--engram.layer_ids", "0,1", f"--engram.offload_optimizer_state={offload}",
        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2", "--optimizer.implementation", "for-loop",
    ])
    args = dataclasses.replace(get_flavor("debugmodel"), n_layers=2, dim=32, inter_dim=64, moe_inter_dim=16,
                               n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                               v_head_dim=8, max_seq_len=16, mtp_depth=0, vocab_size=32, eos_id=1, engram=ENGRAM)
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepSeekV3Model(args)
        model.init_weights()
    opt, hooks = build_optimizer(model, cfg.optimizer, cfg.engram)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, total_steps=4)
    return model, opt, sched, hooks


def _train(model, opt, sched, hooks, device, steps=3, seed=3):
    comp = TokenCompression(lookup=torch.arange(32) % 20, num_compressed=20, pad_id=0)
    hasher = NgramHasher(ENGRAM, comp).to(device)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 12, (2, 16), generator=g).to(device)
        out = model(tokens, engram_ids=hasher(tokens))
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        for hook in hooks:  # the trainer's step: the hooks (the offloaded tables' step), then the optimizer's
            hook.before_optimizer(skip=False)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_matches_device_state_and_keeps_identity(device):
    ref_model, ref_opt, ref_sched, ref_hooks = _setup(False, device)
    model, opt, sched, hooks = _setup(True, device)
    tables = engram_table_params(model)
    identity = [(id(p), p.data_ptr()) for p in tables]
    (hook,) = hooks
    offloaded = hook.offloaded
    assert offloaded is not opt and ref_hooks == []

    _train(ref_model, ref_opt, ref_sched, ref_hooks, device)
    _train(model, opt, sched, hooks, device)

    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert [(id(p), p.data_ptr()) for p in engram_table_params(model)] == identity
    # Params equal after 3 steps of a changing LR: the offloaded updates followed the schedule.
    assert all(p.device.type == device for p in tables)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in tables:
        # No device-side Adam state for the tables; the CPU state is complete and separate.
        assert p not in opt.state or not opt.state[p]
        state = offloaded.state[p]
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert state[key].device.type == "cpu" and state[key].shape == p.shape
            assert state[key].is_pinned() == (device == "cuda")
            assert state[key].data_ptr() != p.data_ptr()
        assert float(state["step"]) == 3
        ref_state = ref_opt.state[ref_model.get_parameter(names[id(p)])]
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"].cpu(), rtol=1e-5, atol=1e-9)


def test_offloaded_state_dict_round_trip():
    model, opt, sched, hooks = _setup(True, "cpu")
    _train(model, opt, sched, hooks, "cpu")
    sd = hooks[0].offloaded.state_dict()
    assert all("grad_buffer" not in s for s in sd["state"].values())
    model2, opt2, _, hooks2 = _setup(True, "cpu")
    hooks2[0].offloaded.load_state_dict(sd)
    for p, q in zip(engram_table_params(model), engram_table_params(model2)):
        s1, s2 = hooks[0].offloaded.state[p], hooks2[0].offloaded.state[q]
        for key in ("exp_avg", "exp_avg_sq", "master", "step"):
            torch.testing.assert_close(s1[key], s2[key])
            assert s2[key].device.type == "cpu"


@pytest.mark.parametrize("resume_offloaded", [True, False])
def test_checkpoint_holds_offloaded_state(tmp_path, resume_offloaded):
    """CheckpointManager (DCP) saves the CPU-resident table state; resuming (offloaded or not)
    continues exactly like the uninterrupted run, which it could not with fresh Adam moments."""
    from trainer.checkpoint import CheckpointManager
    from trainer.config import load_config as load

    class NoData:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def manager(model, opt, sched):
        return CheckpointManager(load(["--checkpoint.enable"]).checkpoint, tmp_path, model=model, optimizer=opt,
                                 lr_scheduler=sched, dataloader=NoData(), model_args=model.args,
                                 device=torch.device("cpu"))

    model, opt, sched, hooks = _setup(True, "cpu")
    _train(model, opt, sched, hooks, "cpu", steps=2)
    manager(model, opt, sched).save(2, {"step": 2})
    _train(model, opt, sched, hooks, "cpu", steps=2, seed=4)

    model2, opt2, sched2, hooks2 = _setup(resume_offloaded, "cpu")
    assert manager(model2, opt2, sched2).load()["step"] == 2
    _train(model2, opt2, sched2, hooks2, "cpu", steps=2, seed=4)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
