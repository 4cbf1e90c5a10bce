"""CheckpointManager on a tiny model: atomic layout, pruning, async save, corrupt-checkpoint
fallback, checksums, refusal of a checkpoint whose pickles would run code, clear errors for a
missing or mismatching checkpoint, no save of a non-finite state; the stop request; the NaN guard."""

import contextlib
import json
import logging
import math
import shutil
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.moe import MoEArgs
from tests.helpers import flip_bytes, tamper_entry, tamper_metadata
from trainer.checkpoint import (
    COMPLETE,
    CheckpointError,
    CheckpointManager,
    RefusedCheckpoint,
    list_checkpoints,
    read_model_args,
    read_model_state_dict,
)
from trainer.checkpoint.folder import checkpoint_shapes
from trainer.checkpoint.safe_load import SafeFileSystemReader
from trainer.fault_tolerance import NonFiniteGuard, StopRequest, TrainingDiverged
from trainer.optim.ema import ParameterEMA

pytestmark = pytest.mark.numerics  # docs/numerics.md


def tiny_args(dim: int = 32) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=64, dim=dim, inter_dim=48, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=2,
        moe=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True),
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=16, mtp_depth=0,
    )


class FakeLoader:
    """A data position; refuses a state it cannot continue (the real loader: an older per-shard format)."""

    def __init__(self, shard: int = 0):
        self.pos = 0
        self.shard = shard

    def state_dict(self):
        return {"pos": self.pos, "shard": self.shard, "buffer": [1, 2, 3]}

    def load_state_dict(self, state):
        if state["shard"] != self.shard:
            raise ValueError(f"saved by shard {state['shard']}, this is shard {self.shard}")
        self.pos = state["pos"]


def ckpt_cfg(**overrides):
    cfg = dict(
        enable=True, folder="checkpoint", interval=1, keep_latest_k=0, async_mode="disabled", load_step=-1,
        last_save_model_only=False, export_dtype="bfloat16", initial_load_path=None, initial_load_format="dcp",
        load_unverified=False,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def build(tmp_path, dim=32, ema=False, **overrides):
    args = tiny_args(dim)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    loader = FakeLoader()
    average = ParameterEMA(model, 0.75, 1) if ema else None
    mgr = CheckpointManager(
        ckpt_cfg(**overrides), tmp_path, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
        model_args=args, device=torch.device("cpu"), ema=average,
    )
    return SimpleNamespace(args=args, model=model, opt=opt, sched=sched, loader=loader, mgr=mgr, ema=average)


def train_step(t, step):
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    if t.ema is not None:
        t.ema.before_forward(step)
    t.model(tokens).logits.float().pow(2).mean().backward()
    t.opt.step()
    if t.ema is not None:
        t.ema.after_optimizer(stepped=True)
    t.sched.step()
    t.opt.zero_grad()
    with torch.no_grad():
        t.model.layers["1"].ffn.expert_bias.add_(0.01 * step)
    t.loader.pos = step


def test_save_resume_restores_everything(tmp_path):
    a = build(tmp_path, ema=True, keep_latest_k=2, async_mode="async")
    for step in (1, 2, 3):
        train_step(a, step)
        a.mgr.maybe_save(step, {"step": step, "skipped_total": 1})
    a.mgr.close()
    found = list_checkpoints(tmp_path / "checkpoint")
    assert [c.step for c in found] == [3, 2]  # step-1 pruned by keep_latest_k
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))
    for c in found:
        assert (c.path / COMPLETE).is_file() and (c.path / ".metadata").is_file()
    assert read_model_args(found[0].path) == a.args
    rng_after_save = torch.rand(3)

    b = build(tmp_path, ema=True)
    torch.rand(7)  # disturb the generator: the checkpoint must restore it
    state = b.mgr.load()
    assert state == {"step": 3, "skipped_total": 1}
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[key]), key
    assert b.model.layers["1"].ffn.expert_bias.abs().sum() > 0
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    for pid, st in sa["state"].items():
        for name, value in st.items():
            assert torch.equal(value, sb["state"][pid][name]), name
    assert b.sched.state_dict()["last_epoch"] == 3 and b.loader.pos == 3
    assert torch.equal(torch.rand(3), rng_after_save)
    # The parameter EMA continues bit for bit (trainer/optim/ema.py).
    for t in (a, b):
        train_step(t, 4)
        t.ema.flush()
    assert all(torch.equal(x, y) for x, y in zip(a.ema.averages, b.ema.averages))


def test_optimizer_groups_are_keyed_by_name_and_older_index_keyed_checkpoints_resume(tmp_path, monkeypatch):
    """Param groups are saved per parameter name (a pipeline rank's group 0 is not another's);
    a checkpoint from before, with groups keyed by index, still resumes."""
    a = build(tmp_path)
    train_step(a, 1)
    a.mgr.maybe_save(1, {"step": 1})
    assert "optimizer.param_groups.embed.weight.lr" in checkpoint_shapes(tmp_path / "checkpoint" / "step-1")
    by_index = a.mgr._full_state
    monkeypatch.setattr(a.mgr, "_full_state", lambda train_state: by_index(train_state, StateDictOptions()))
    train_step(a, 2)
    a.mgr.maybe_save(2, {"step": 2})
    a.mgr.close()
    assert "optimizer.param_groups.0.lr" in checkpoint_shapes(tmp_path / "checkpoint" / "step-2")
    b = build(tmp_path)
    assert b.mgr.load() == {"step": 2}
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sb["param_groups"][0]["betas"] == sa["param_groups"][0]["betas"]
    for pid, st in sa["state"].items():
        for name, value in st.items():
            assert torch.equal(value, sb["state"][pid][name]), name


def test_other_world_size_continues_the_rank_that_read_the_same_shard(tmp_path, caplog, monkeypatch):
    a = build(tmp_path)
    train_step(a, 1)
    a.loader.shard = 1
    full_state = a.mgr._full_state

    def two_ranks(train_state):
        # As if saved by 2 ranks: rank 0 read shard 1 (at 1), rank 1 read shard 0 (at 7).
        state = full_state(train_state)
        state["rank_state_1"] = {"dataloader": {"pos": 7, "shard": 0, "buffer": [4]}, "rng": state["rank_state_0"]["rng"]}
        return state

    monkeypatch.setattr(a.mgr, "_full_state", two_ranks)
    a.mgr.save(1, {"step": 1, "skipped_total": 0})
    marker = tmp_path / "checkpoint" / "step-1" / COMPLETE
    marker.write_text(marker.read_text().replace('"world_size": 1', '"world_size": 2'))

    b = build(tmp_path)  # one process, reading shard 0
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert b.mgr.load()["step"] == 1
    assert b.loader.pos == 7 and "taken from saved rank 1" in caplog.text

    c = build(tmp_path)
    c.loader.shard = 2  # no saved rank read it: the data order restarts, the weights still load
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert c.mgr.load()["step"] == 1
    assert c.loader.pos == 0 and "data loader position not restored" in caplog.text
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, c.model.state_dict()[key]), key


def _saved_two_steps(tmp_path):
    """A run that trained and saved steps 1 and 2; and its weights at step 2."""
    a = build(tmp_path)
    for step in (1, 2):
        train_step(a, step)
        a.mgr.maybe_save(step, {"step": step})
    return a, {k: v.clone() for k, v in a.model.state_dict().items()}


@pytest.fixture(scope="module")
def two_steps_run(tmp_path_factory):
    """`_saved_two_steps` once for the tests that only read what it saved: its folder and weights."""
    folder = tmp_path_factory.mktemp("two_steps")
    _, reference = _saved_two_steps(folder)
    return folder, reference


def _copy_of(run, tmp_path):
    """`two_steps_run`'s files copied into `tmp_path` (each test damages its own copy); its weights."""
    folder, reference = run
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    return reference


def test_partial_and_corrupt_checkpoints_fall_back(tmp_path, caplog):
    # A Trainer built earlier in this process stops the run logger from propagating to the root.
    a, reference = _saved_two_steps(tmp_path)
    train_step(a, 3)
    a.mgr.maybe_save(3, {"step": 3})
    folder = tmp_path / "checkpoint"
    # A save killed before its marker: a .tmp folder, and an unmarked step folder.
    shutil.copytree(folder / "step-3", folder / "step-4.tmp")
    shutil.copytree(folder / "step-3", folder / "step-5")
    (folder / "step-5" / COMPLETE).unlink()
    # The newest complete one has a truncated data file.
    data = next((folder / "step-3").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])

    b = build(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert b.mgr.load()["step"] == 2
    assert "step-3 is corrupt or partial" in caplog.text and "falling back to step-2" in caplog.text
    assert not (folder / "step-4.tmp").exists()
    for key, value in reference.items():
        assert torch.equal(value, b.model.state_dict()[key]), key


def test_flipped_bytes_are_reported_and_skipped(tmp_path, caplog):
    a = build(tmp_path, async_mode="async")  # the digests are taken in the background write
    train_step(a, 1)
    a.mgr.maybe_save(1, {"step": 1})
    reference = {k: v.clone() for k, v in a.model.state_dict().items()}
    train_step(a, 2)
    a.mgr.maybe_save(2, {"step": 2})
    a.mgr.close()
    folder = tmp_path / "checkpoint"
    newest = folder / "step-2"
    recorded = json.loads((newest / COMPLETE).read_text())["files"]
    assert sorted(recorded) == sorted(p.name for p in newest.iterdir() if p.name != COMPLETE)
    assert ".metadata" in recorded and "model_args.json" in recorded
    shard = next(newest.glob("*.distcp"))
    size = shard.stat().st_size
    flip_bytes(shard)
    assert shard.stat().st_size == size == recorded[shard.name]["bytes"]

    b = build(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert b.mgr.load()["step"] == 1
    assert f"step-2 is corrupt or partial ({shard} differs from the SHA-256" in caplog.text
    assert "falling back to step-1" in caplog.text
    for key, value in reference.items():
        assert torch.equal(value, b.model.state_dict()[key]), key

    for load in (build(tmp_path, load_step=2).mgr.load, lambda: read_model_state_dict(newest)):
        with pytest.raises(CheckpointError, match=rf"^{shard} differs from the SHA-256 recorded"):
            load()

    # A marker without its record (an earlier version's, or `"files"` damaged away) fails closed
    # (issue 44): refused by name, naming the option that loads it unverified, which then says so.
    marker = json.loads((folder / "step-1" / COMPLETE).read_text())
    del marker["files"]
    (folder / "step-1" / COMPLETE).write_text(json.dumps(marker))
    for load in (build(tmp_path, load_step=1).mgr.load, lambda: read_model_state_dict(folder / "step-1")):
        with pytest.raises(CheckpointError, match=rf"^{folder / 'step-1' / COMPLETE} records no checksums.*"
                                                  "--checkpoint.load_unverified"):
            load()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        old = build(tmp_path, load_step=1, load_unverified=True)
        assert old.mgr.load()["step"] == 1
    assert "records no checksums: loading it unverified (checkpoint.load_unverified)" in caplog.text
    assert "saved before checksums were recorded, so not verified" in old.mgr.newest_good()
    assert read_model_state_dict(folder / "step-1", load_unverified=True)


# What a damaged marker can look like: cut off (a killed copy), empty (a crash before the write
# reached the disk), bytes changed into ones that are not UTF-8, valid JSON of the wrong shape.
DAMAGED_MARKERS = {
    "cut off": lambda text: text[: len(text) // 2],
    "empty": lambda text: b"",
    "not UTF-8": lambda text: text[:40] + b"\xff\xfe" + text[42:],
    "not an object": lambda text: b"[]",
    "checksum record": lambda text: text.replace(b'"bytes"', b'"bytez"'),
    # Valid JSON that lost what every marker holds (issue 44): the step, the record, or a file of it.
    "no step": lambda text: text.replace(b'"step"', b'"stop"'),
    "empty object": lambda text: b"{}",
    "no record": lambda text: text.replace(b'"files"', b'"filez"'),
    "empty record": lambda text: json.dumps({**json.loads(text), "files": {}}).encode(),
    "a file left out": lambda text: json.dumps(
        {**json.loads(text), "files": {k: v for k, v in json.loads(text)["files"].items() if k != ".metadata"}}
    ).encode(),
}


@pytest.mark.parametrize("damage", DAMAGED_MARKERS)
def test_damaged_marker_is_reported_by_name_and_skipped(tmp_path, caplog, damage, two_steps_run):
    reference = _copy_of(two_steps_run, tmp_path)
    folder = tmp_path / "checkpoint"
    # A damaged newer checkpoint: step-2's files (intact) under step-9, whose marker is damaged.
    shutil.copytree(folder / "step-2", folder / "step-9")
    marker = folder / "step-9" / COMPLETE
    marker.write_bytes(DAMAGED_MARKERS[damage](marker.read_bytes()))

    # Resume reports it by name at warning level and falls back, never loading it unverified.
    b = build(tmp_path, keep_latest_k=1)
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert b.mgr.load()["step"] == 2
    assert (f"checkpoint step-9 is corrupt or partial ({marker} is damaged" in caplog.text
            or f"checkpoint step-9 is corrupt or partial ({marker} records no checksums" in caplog.text), caplog.text
    assert "falling back to step-2" in caplog.text and "loading it unverified" not in caplog.text
    assert any(r.levelno == logging.WARNING and "step-9" in r.getMessage() for r in caplog.records)
    for key, value in reference.items():
        assert torch.equal(value, b.model.state_dict()[key]), key
    assert b.mgr.newest_good().startswith(f"the newest good checkpoint is {folder / 'step-2'} (its checksums verified")

    # Saving on, keep_latest_k = 1 keeps the checkpoint just saved, not the damaged step-9, which
    # stays for the user to look at; a divergence then names the new one.
    train_step(b, 3)
    b.mgr.maybe_save(3, {"step": 3})
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-9"]
    assert b.mgr.newest_good().startswith(f"the newest good checkpoint is {folder / 'step-3'} (saved by this run;")

    # Nothing to fall back to: one line naming the marker.
    for load in (build(tmp_path, load_step=9).mgr.load, lambda: read_model_state_dict(folder / "step-9")):
        with pytest.raises(CheckpointError, match=rf"^{marker} (is damaged|records no checksums)"):
            load()


def _refused(tmp_path, folder, match: str, model_only: bool = True) -> None:
    """Resuming from `folder` (step-2 of `_saved_two_steps`, whose step-1 is intact), by default or
    with `load_step`, and with `model_only` the model-only loads too, stop with RefusedCheckpoint,
    one line matching `match`; the resume names the checkpoint to remove and does not fall back to
    the intact step-1."""
    b = build(tmp_path)
    with pytest.raises(RefusedCheckpoint, match=match) as err:
        b.mgr.load()
    message = str(err.value)
    assert "\n" not in message
    assert f"remove the checkpoint {folder} if you did not write it (the run does not fall back past it, or resume " \
           "from an older one with --checkpoint.load_step 1)" in message
    assert "neither saved one nor resumed from one" in b.mgr.newest_good()
    loads = [build(tmp_path, load_step=2).mgr.load]
    if model_only:
        loads += [lambda: read_model_state_dict(folder), build(tmp_path / "other", initial_load_path=str(folder)).mgr.load]
    for load in loads:
        with pytest.raises(RefusedCheckpoint, match=match):
            load()


def test_tampered_metadata_is_refused_and_runs_nothing(tmp_path, two_steps_run):
    """`.metadata` replaced by a pickle that touches a file and then returns the real metadata,
    the marker's checksums updated to match: no load runs it, none falls back past it."""
    _copy_of(two_steps_run, tmp_path)
    folder = tmp_path / "checkpoint" / "step-2"
    sentinel = tmp_path / "ran"
    tamper_metadata(folder, sentinel)
    _refused(
        tmp_path, folder, rf"^{folder / '.metadata'} holds a pickle naming the global tests\.helpers\.touch_then, "
        "which no checkpoint of this trainer holds: loading it would run code from the file"
    )
    assert not sentinel.exists()
    dcp.FileSystemReader(str(folder)).read_metadata()  # DCP's own reader runs the payload
    assert sentinel.exists()


@pytest.mark.parametrize("as_torch_save", [True, False], ids=["torch.save", "bare pickle"])
def test_tampered_entry_is_refused_and_runs_nothing(tmp_path, as_torch_save, two_steps_run):
    """A non-tensor entry (the train state's step) replaced by a pickle that touches a file and then
    gives the saved value, `.metadata` and the marker updated to match: a resume refuses it by name."""
    _copy_of(two_steps_run, tmp_path)
    folder = tmp_path / "checkpoint" / "step-2"
    sentinel = tmp_path / "ran"
    shard = tamper_entry(folder, "train_state.step", sentinel, as_torch_save)
    holds = r"the global tests\.helpers\.touch_then" if as_torch_save else "a pickle that torch.load"
    _refused(tmp_path, folder, rf"^{shard} holds in its entry train_state\.step {holds}", model_only=False)
    read_model_state_dict(folder)  # reads the weights only: the entry is not even read
    # The reader takes no planner that would unpickle the entries in full (DCP's default).
    with pytest.raises(CheckpointException, match="SafeFileSystemReader reads through a WeightsOnlyLoadPlanner"):
        dcp.load({"train_state": {"step": 0}}, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
    assert not sentinel.exists()
    # DCP's own planner runs the payload (a bare pickle then fails torch.load's check of its format).
    with contextlib.suppress(CheckpointException):
        dcp.load({"train_state": {"step": 0}}, checkpoint_id=str(folder), no_dist=True)
    assert sentinel.exists()


def test_no_good_checkpoint_is_named_when_there_is_none(tmp_path):
    assert build(tmp_path, enable=False).mgr.newest_good() == "no checkpoint to resume from (checkpoint.enable is off)"
    fresh = build(tmp_path)
    assert fresh.mgr.load() is None
    assert "neither saved one nor resumed from one" in fresh.mgr.newest_good()


@pytest.mark.parametrize("where", ["weight", "optimizer state"])
def test_nonfinite_state_is_never_saved(tmp_path, where):
    a = build(tmp_path, keep_latest_k=1)
    train_step(a, 1)
    a.mgr.maybe_save(1, {"step": 1})
    good = tmp_path / "checkpoint" / "step-1"
    marker = (good / COMPLETE).read_text()
    train_step(a, 2)
    with torch.no_grad():
        if where == "weight":
            a.model.layers["1"].attn.wkv_b.weight[0, 0] = math.nan
        else:
            a.opt.state[a.model.embed.weight]["exp_avg_sq"][3, 1] = math.inf
    with pytest.raises(TrainingDiverged, match="NaN or inf; no checkpoint saved$"):
        a.mgr.maybe_save(2, {"step": 2})
    assert a.mgr.newest_good().startswith(f"the newest good checkpoint is {good} (saved by this run;")
    assert [c.step for c in list_checkpoints(tmp_path / "checkpoint")] == [1]  # not pruned by keep_latest_k
    assert (good / COMPLETE).read_text() == marker
    assert not list((tmp_path / "checkpoint").glob("step-2*"))


def test_clear_errors(tmp_path):
    a = build(tmp_path)
    train_step(a, 1)
    a.mgr.maybe_save(1, {"step": 1})

    with pytest.raises(FileNotFoundError, match=r"load_step = 7: no checkpoint folder .*step-7.*complete ones: step-1"):
        build(tmp_path, load_step=7).mgr.load()
    with pytest.raises(FileNotFoundError, match="initial_load_path"):
        build(tmp_path / "other", initial_load_path=str(tmp_path / "nope")).mgr.load()
    with pytest.raises(CheckpointError) as err:
        build(tmp_path, dim=48).mgr.load()
    message = str(err.value)
    assert "different model" in message and "shape mismatch" in message
    assert "embed.weight: checkpoint (64, 32) vs model (64, 48)" in message
    assert "Traceback" not in message


def test_model_only_export_and_initial_load(tmp_path):
    a = build(tmp_path / "a", last_save_model_only=True)
    train_step(a, 1)
    a.mgr.maybe_save(1, {"step": 1}, last=True)
    path = tmp_path / "a" / "checkpoint" / "step-1"
    weights = read_model_state_dict(path)
    assert weights["embed.weight"].dtype == torch.bfloat16
    assert weights["layers.1.ffn.expert_bias"].dtype == torch.float32
    assert not any(k.startswith("optimizer") for k in weights)

    b = build(tmp_path / "b", initial_load_path=str(path))
    assert b.mgr.load() is None  # a fresh start from those weights
    assert torch.equal(b.model.embed.weight, a.model.embed.weight.bfloat16().float())
    assert torch.equal(b.model.layers["1"].ffn.expert_bias, a.model.layers["1"].ffn.expert_bias)


def test_parameter_ema_export_and_a_checkpoint_without_one(tmp_path, caplog):
    a = build(tmp_path / "a", ema=True)
    train_step(a, 1)
    a.mgr.save(1, {"step": 1})
    # The export reads the average in place of the parameters, the buffers from the model.
    exported = read_model_state_dict(tmp_path / "a" / "checkpoint" / "step-1", ema=True)
    a.ema.flush()
    assert set(exported) == set(a.model.state_dict())
    for name, avg in zip(a.ema.names, a.ema.averages):
        assert torch.equal(exported[name], avg), name
    assert torch.equal(exported["layers.1.ffn.expert_bias"], a.model.layers["1"].ffn.expert_bias)
    assert not torch.equal(exported["embed.weight"], a.model.embed.weight)  # the average, not the weights

    # Resumed with an EMA, a checkpoint without one starts it from the resumed weights.
    plain = build(tmp_path / "plain")
    train_step(plain, 1)
    plain.mgr.save(1, {"step": 1})
    with pytest.raises(CheckpointError, match="holds no parameter EMA"):
        read_model_state_dict(tmp_path / "plain" / "checkpoint" / "step-1", ema=True)
    c = build(tmp_path / "plain", ema=True)
    with caplog.at_level(logging.INFO, logger="trainer"):
        c.mgr.load()
    assert "step-1 holds no parameter EMA (saved without ema.enable): the EMA starts from the resumed weights" in (
        caplog.text
    )
    assert all(torch.equal(x, p) for x, p in zip(c.ema.averages, plain.model.parameters()))


def test_stop_request_signal_and_time_limit():
    stop = StopRequest(agree=lambda flag: flag).install()
    try:
        assert stop.reason() is None
        signal.raise_signal(signal.SIGTERM)
        assert stop.reason() == "received SIGTERM"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert "time limit" in StopRequest(time_limit_minutes=1e-9, agree=lambda f: f).reason()


def test_nonfinite_guard_counts_and_stops():
    guard = NonFiniteGuard(max_consecutive=2)
    assert not guard.should_skip(1, 1.0, 1.0)
    assert guard.should_skip(2, math.nan, 1.0)
    assert not guard.should_skip(3, 1.0, 1.0)
    assert guard.should_skip(4, 1.0, math.inf)
    with pytest.raises(TrainingDiverged, match="2 consecutive"):
        guard.should_skip(5, math.nan, math.nan)
    assert guard.state_dict() == {"skipped_total": 3}


@pytest.mark.parametrize("saved_mixture", [True, False])
def test_a_resume_across_one_dataset_and_a_mixture_is_refused_by_name(tmp_path, saved_mixture):
    from trainer.checkpoint.errors import CheckpointError
    from trainer.checkpoint.manager import _check_data_source_kind

    key = "rank_state_0.dataloader." + ("mixture" if saved_mixture else "index")
    shapes = {key: (), "model.w": (2, 2)}
    _check_data_source_kind(tmp_path, saved_mixture, shapes)  # the same kind: nothing to say
    with pytest.raises(CheckpointError, match="the data position does not carry over.*initial_load_path"):
        _check_data_source_kind(tmp_path, not saved_mixture, shapes)
