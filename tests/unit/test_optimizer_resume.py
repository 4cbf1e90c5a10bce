"""bf16 optimizer states stay bf16 through a checkpoint and resume exactly (Muon and AdamW with
``optimizer.state_dtype = "bfloat16"``): torch's ``load_state_dict`` casts state to the parameters'
fp32, which `trainer.optim.muon` undoes (issue 32)."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.checkpoint import CheckpointManager
from trainer.config import load_config
from trainer.optim.build import build_optimizer
from trainer.optim.lr_schedule import build_lr_scheduler
from trainer.optim.muon import MuonAdamW

pytestmark = pytest.mark.numerics  # docs/numerics.md

ARGS = dataclasses.replace(get_flavor("debugmodel"), n_layers=2, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=16,
                           mtp_depth=0, vocab_size=32, eos_id=1)


class _NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _setup(name: str, folder):
    cfg = load_config(["--optimizer.name", name, "--optimizer.state_dtype", "bfloat16", "--checkpoint.enable",
                       "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2"])
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    opt, hooks = build_optimizer(model, cfg.optimizer)
    assert isinstance(opt, MuonAdamW) and not hooks
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, total_steps=6)
    manager = CheckpointManager(cfg.checkpoint, folder, model=model, optimizer=opt, lr_scheduler=sched,
                                dataloader=_NoData(), model_args=ARGS, device=torch.device("cpu"))
    return model, opt, sched, manager


def _train(model, opt, sched, steps: range) -> list[dict[str, torch.Tensor]]:
    weights = []
    for step in steps:
        tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(step))
        out = model(tokens)
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return weights


def _state_dtypes(opt) -> set[torch.dtype]:
    return {v.dtype for s in opt.state.values() for k, v in s.items() if k in MuonAdamW.BUFFERS}


def _saved_state_dtypes(folder) -> set[torch.dtype]:
    (step_dir,) = [p for p in folder.rglob(".metadata")]
    metadata = dcp.FileSystemReader(str(step_dir.parent)).read_metadata()
    return {
        m.properties.dtype for key, m in metadata.state_dict_metadata.items()
        if any(key.endswith(b) for b in MuonAdamW.BUFFERS) and hasattr(m, "properties")
    }


@pytest.mark.parametrize("name", ["muon", "AdamW"])
def test_bf16_states_stay_bf16_and_resume_exactly(tmp_path, name):
    model, opt, sched, manager = _setup(name, tmp_path / "a")
    _train(model, opt, sched, range(1, 4))
    manager.save(3, {"step": 3})
    straight = _train(model, opt, sched, range(4, 7))

    model2, opt2, sched2, manager2 = _setup(name, tmp_path / "a")
    assert manager2.load()["step"] == 3
    assert _state_dtypes(opt2) == {torch.bfloat16}
    resumed = _train(model2, opt2, sched2, range(4, 7))
    for want, got in zip(straight, resumed):
        for key in want:
            assert torch.equal(want[key], got[key]), key
    assert _state_dtypes(opt2) == {torch.bfloat16}
    # The first checkpoint after the resume holds bf16 states too.
    resaved = CheckpointManager(manager2.cfg, tmp_path / "b", model=model2, optimizer=opt2, lr_scheduler=sched2,
                                dataloader=_NoData(), model_args=ARGS, device=torch.device("cpu"))
    resaved.save(6, {"step": 6})
    assert _saved_state_dtypes(tmp_path / "b") == {torch.bfloat16}


def test_checkpoint_with_a_step_count_per_parameter_resumes(tmp_path):
    """Before one step count per param group, `MuonAdamW` kept a `step` tensor per AdamW parameter
    (torch's layout): such a checkpoint resumes with its count in the group entries."""
    model, opt, sched, manager = _setup("muon", tmp_path / "a")
    _train(model, opt, sched, range(1, 4))
    for group in opt.param_groups:
        step = group.pop("step")
        for p in group["params"]:
            if not group["muon"]:
                opt.state[p]["step"] = torch.tensor(float(step))
    manager.save(3, {"step": 3})
    _, opt2, _, manager2 = _setup("muon", tmp_path / "a")
    assert manager2.load()["step"] == 3
    assert [g["step"] for g in opt2.param_groups] == [3, 3, 0]
    assert not any("step" in s for s in opt2.state.values())
