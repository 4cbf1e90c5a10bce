"""Training checkpoints on `torch.distributed.checkpoint` (DCP): save, prune, resume, initial load.

The folder (`step-N`, `model_args.json`, the `COMPLETE` marker) is `trainer.checkpoint.folder`'s;
the state dict a training checkpoint holds is this module's:

    model          get_state_dict(model): parameters and persistent buffers (the MoE `expert_bias`)
    optimizer      get_state_dict(optimizer): FQN-keyed, param groups too (flattened), so it
                   reshards like the model, across pipeline stages as well
    lr_scheduler   LambdaLR.state_dict()
    ema            with `[ema] enable`: the CPU-resident average of the parameters (`trainer.optim.ema`),
                   keyed and laid out like `model`'s parameters, so it reshards the same way
    train_state    {"step", "skipped_total", "seq_len", "global_batch_size"}
    rank_state_R   per rank R: data-loader position (global: the same on every rank, valid in any
                   layout) and RNG states (torch CPU/CUDA, python, numpy)

Model and optimizer state come from `torch.distributed.checkpoint.state_dict`, so under FSDP2 /
TP / EP they are DTensors and DCP writes each rank's shards and reshards them on load into whatever
layout the loading run has (routed experts are DTensors of the global expert stack under EP). A single process (no process group) uses the same code path.

Atomicity: DCP writes into `step-N.tmp`; only once its `.metadata` exists (DCP writes that after
every rank's data) does rank 0 write `COMPLETE` and rename the folder to `step-N`. A run killed
at any moment leaves either a complete `step-N` or a `.tmp` folder that resume ignores (and
deletes). Async mode (`dcp.async_save`) stages the state to CPU memory, returns, and writes in a
background thread while training continues; the rename happens at the first step boundary after
the write finished, and the run waits for it before the next save and before exiting.

Integrity: the `COMPLETE` marker records every file's size and SHA-256 (`integrity`), and a load
checks them first; a damaged newest checkpoint (a file, or the marker itself) is reported by name
and the next older complete one is loaded instead. Pruning does not count the damaged ones it
passed over. A state with NaN or inf in its weights or optimizer state is never saved: the save
raises `TrainingDiverged` (exit code 3) and leaves the complete checkpoints as they are; the
manager knows the newest checkpoint it verified or saved itself (`newest_good`), which the run's
message names.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from models.deepseek_v3 import DeepSeekV3ModelArgs
from trainer.checkpoint.errors import CheckpointError, RefusedCheckpoint, UnreadableCheckpoint
from trainer.checkpoint.folder import (
    COMPLETE,
    DCP_METADATA,
    RANK_STATE,
    TMP_SUFFIX,
    CheckpointInfo,
    check_model_fits,
    checkpoint_shapes,
    dcp_load,
    export_state_dict,
    incomplete_checkpoints,
    is_complete,
    list_checkpoints,
    load_hf_weights,
    load_model_weights,
    quiet_single_process,
    read_marker,
    seal,
    verify_checkpoint,
)
from trainer.checkpoint.integrity import ChecksumWriter
from trainer.distributed import all_ranks_any, barrier, global_rank, global_world_size, is_distributed
from trainer.fault_tolerance import TrainingDiverged, nonfinite_entries
from trainer.optim.build import optimizer_signature

if TYPE_CHECKING:
    from trainer.optim.ema import ParameterEMA

logger = logging.getLogger("trainer")
# Param groups keyed by parameter name, not by group index: a pipeline rank's group 0 holds other
# parameters than another rank's, so index-keyed groups would collide in the checkpoint.
OPTIM_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
INDEXED_GROUP = re.compile(r"optimizer\.param_groups\.\d+\.")


def _per_parameter_step(group_key: str) -> str:
    return "state." + group_key.removeprefix("param_groups.")


def _group_steps_not_saved(optim_sd: dict, shapes) -> dict[str, Any]:
    """`MuonAdamW` counts AdamW steps per param group (``param_groups.<name>.step``); checkpoints from
    before that hold a ``step`` tensor per parameter instead (``state.<name>.step``, AdamW
    parameters only). Takes the group entries the checkpoint lacks out of ``optim_sd`` (returned:
    the loader puts them back) and asks for the per-parameter counts where they were saved."""
    kept = {}
    for key in [k for k in optim_sd if k.startswith("param_groups.") and k.endswith(".step")]:
        if f"optimizer.{key}" not in shapes:
            kept[key] = optim_sd.pop(key)
            if f"optimizer.{_per_parameter_step(key)}" in shapes:
                optim_sd[_per_parameter_step(key)] = torch.zeros((), dtype=torch.float32)
    return kept


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


@dataclasses.dataclass
class _PendingSave:
    future: Any
    tmp: Path
    final: Path
    marker: dict


class CheckpointManager:
    """Saves, prunes and loads checkpoints for one run (see the module docstring for the layout).

    Args:
        cfg: the `[checkpoint]` section.
        run_dir: the run folder (`[job] dump_folder` itself when resumable); checkpoints go to `run_dir / cfg.folder`.
        dataloader: anything with `state_dict()` / `load_state_dict()`.
        pipeline_share: ``model`` holds only this rank's pipeline stages.
        ema: the run's parameter EMA (``[ema] enable``), saved and resumed with the rest; a resume
            from a checkpoint without one, and an initial load, start it from the loaded weights.
        storage_writer_factory: makes the DCP storage writer for a folder; tests pass one that
            dies half-way through a save.
    """

    def __init__(
        self,
        cfg,
        run_dir: str | Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        dataloader,
        model_args: DeepSeekV3ModelArgs,
        device: torch.device,
        storage_writer_factory: Callable[[Path], Any] | None = None,
        pipeline_share: bool = False,
        ema: ParameterEMA | None = None,
    ):
        self.cfg = cfg
        self.folder = Path(run_dir) / cfg.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.model_args = model_args
        self.device = device
        self.pipeline_share = pipeline_share
        self.ema = ema
        self.rank = global_rank()
        self.storage_writer_factory = storage_writer_factory or (lambda path: ChecksumWriter(str(path)))
        self._pending: _PendingSave | None = None
        self._last_saved_step = -1
        # The newest checkpoint this run saved, or resumed from after verifying it, with how it is
        # known good; and the folders the resume found damaged, which pruning must not count.
        self._good: tuple[Path, str] | None = None
        self._damaged: set[str] = set()
        self._async_pg = None
        if cfg.enable and cfg.async_mode == "async":
            if not is_distributed():
                # The background thread's save repeats DCP's single-process warning on every
                # save; a thread cannot be reached by catch_warnings, so filter it process-wide.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            else:
                # The background write gathers over its own gloo group, so it never interleaves
                # with the training collectives on the default group.
                self._async_pg = dist.new_group(backend="gloo")

    # ---- state ---------------------------------------------------------------------------------

    def _rank_key(self) -> str:
        return f"rank_state_{self.rank}"

    def _full_state(self, train_state: dict, options: StateDictOptions = OPTIM_BY_NAME) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": dict(train_state),
            self._rank_key(): {"dataloader": self.dataloader.state_dict(), "rng": _rng_state(self.device)},
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict(model_sd)
        return state

    # ---- saving --------------------------------------------------------------------------------

    def maybe_save(self, step: int, train_state: dict, *, last: bool = False, force: bool = False) -> None:
        """Called after every step: finishes a background save that is done, and saves at the
        interval, at the last step, and when `force`d (a stop request)."""
        self.poll()
        if self.cfg.enable and step != self._last_saved_step and (force or last or step % self.cfg.interval == 0):
            self.save(step, train_state, last=last)

    def save(self, step: int, train_state: dict, *, last: bool = False) -> None:
        """Save at `step` (async when configured). `last` marks the run's final save, which is
        model-only in `export_dtype` when `last_save_model_only` is set."""
        self.wait()
        model_only = last and self.cfg.last_save_model_only
        if model_only:
            dtype = getattr(torch, self.cfg.export_dtype)
            state = {"model": export_state_dict(get_model_state_dict(self.model), dtype)}
        else:
            state = self._full_state(train_state)
        self._refuse_nonfinite(step, state)
        final = self.folder / f"step-{step}"
        tmp = final.with_name(final.name + TMP_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        marker = {"step": step, "model_only": model_only, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "world_size": global_world_size()}
        if model_only:
            marker["dtype"] = self.cfg.export_dtype
        else:
            marker["optimizer"] = optimizer_signature(self.optimizer)
        start = time.perf_counter()
        writer = self.storage_writer_factory(tmp)
        if self.cfg.async_mode == "async" and not last:
            with quiet_single_process():
                future = dcp.async_save(
                    state, storage_writer=writer, process_group=self._async_pg, no_dist=not is_distributed()
                )
            # torch >= 2.9 may return an AsyncSaveResponse: the snapshot must be complete before
            # training changes the state in place, then its upload future is the one to wait on.
            staging = getattr(future, "staging_completion", None)
            if staging is not None:
                staging.result()
            future = getattr(future, "upload_completion", future)
            self._pending = _PendingSave(future, tmp, final, marker)
            logger.info(
                "checkpoint step %d: staged in %.2fs, writing in the background", step, time.perf_counter() - start
            )
        else:
            with quiet_single_process():
                dcp.save(state, storage_writer=writer, no_dist=not is_distributed())
            self._finalize(_PendingSave(None, tmp, final, marker))
            logger.info("checkpoint step %d saved to %s in %.2fs%s", step, final, time.perf_counter() - start,
                        f" (model only, {self.cfg.export_dtype})" if model_only else "")
        self._last_saved_step = step

    def _refuse_nonfinite(self, step: int, state: dict) -> None:
        """Raise TrainingDiverged (on every rank) when any rank's part of the weights or optimizer
        state holds NaN or inf: such a save would become the checkpoint a rerun resumes from."""
        bad = nonfinite_entries({"model": state["model"], "optimizer": state.get("optimizer", {})})
        if bad:
            logger.warning("step %d: NaN or inf in %d saved tensors on rank %d: %s%s", step, len(bad), self.rank,
                           ", ".join(bad[:6]), " ..." if len(bad) > 6 else "")
        if not all_ranks_any(bool(bad)):
            return
        raise TrainingDiverged(f"step {step}: the model weights or optimizer state hold NaN or inf; no checkpoint saved")

    def newest_good(self) -> str:
        """Where a rerun of a diverged run resumes, for its message: the newest checkpoint this run
        saved or verified on its resume. Never one found damaged, nor one merely listed: a marker
        says a save finished, not that its files are still intact."""
        if not self.cfg.enable:
            return "no checkpoint to resume from (checkpoint.enable is off)"
        if self._good is None:
            return "no checkpoint to resume from (this run neither saved one nor resumed from one)"
        path, how = self._good
        return f"the newest good checkpoint is {path} ({how}; a rerun of the same command resumes from it)"

    def poll(self) -> None:
        """Finish a background save whose write is done; cheap, call once per step."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written, then mark it complete."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.future.result()
        self._finalize(pending)
        logger.info("checkpoint step %d saved to %s (async)", pending.marker["step"], pending.final)

    def _finalize(self, pending: _PendingSave) -> None:
        if self.rank == 0:
            seal(pending.tmp, pending.final, self.model_args, pending.marker)
        # The save replaced a damaged folder of the same step, if there was one.
        self._damaged.discard(pending.final.name)
        if not pending.marker["model_only"]:
            self._good = (pending.final, "saved by this run")
        if self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        # A damaged checkpoint newer than the resumed one is not one of the newest K: counted, it
        # would make pruning delete the good ones saved since (with K = 1, each right after its save).
        usable = [c for c in list_checkpoints(self.folder) if c.path.name not in self._damaged]
        for old in usable[k:]:
            shutil.rmtree(old.path, ignore_errors=True)
            logger.info("removed old checkpoint %s (keep_latest_k = %d)", old.path.name, k)

    def close(self) -> None:
        self.wait()

    # ---- loading -------------------------------------------------------------------------------

    def load(self) -> dict | None:
        """Resume from the configured checkpoint, else apply the initial load. Returns the saved
        train_state ({"step", "skipped_total"}) when resuming, None for a fresh start."""
        cfg = self.cfg
        if cfg.enable:
            if self.rank == 0 and self.folder.is_dir():
                for stale in self.folder.glob(f"step-*{TMP_SUFFIX}"):
                    logger.warning("removing %s: an unfinished save of an earlier run", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            barrier()
            state = self._resume()
            if state is not None:
                return state
        elif cfg.load_step != -1:
            raise CheckpointError(f"checkpoint.load_step = {cfg.load_step} needs checkpoint.enable = true")
        if cfg.initial_load_path:
            self._initial_load()
            if self.ema is not None:
                self.ema.restart()
        return None

    def _resume(self) -> dict | None:
        cfg = self.cfg
        if cfg.load_step != -1:
            path = self.folder / f"step-{cfg.load_step}"
            if not path.is_dir():
                raise FileNotFoundError(
                    f"checkpoint.load_step = {cfg.load_step}: no checkpoint folder {path} "
                    f"(complete ones: {', '.join(c.path.name for c in list_checkpoints(self.folder)) or 'none'})"
                )
            if not is_complete(path):
                raise CheckpointError(
                    f"checkpoint {path} is incomplete (no {COMPLETE} marker or {DCP_METADATA}); its save did not finish"
                )
            try:
                return self._load_full(CheckpointInfo(path, cfg.load_step, read_marker(path).get("model_only", False)))
            except UnreadableCheckpoint as e:
                raise CheckpointError(str(e)) from None
            except RefusedCheckpoint as e:
                raise RefusedCheckpoint(f"{e}; remove the checkpoint {path} if you did not write it") from None
        if self.rank == 0:
            for path in incomplete_checkpoints(self.folder):
                logger.warning(
                    "skipping %s: it has no %s or no %s, so it is damaged or was copied in part; move it away "
                    "(or restore the file) to silence this", path, DCP_METADATA, COMPLETE,
                )
        candidates = list_checkpoints(self.folder)
        if not candidates:
            if self.folder.is_dir():
                logger.info("no complete checkpoint in %s; starting from scratch", self.folder)
            return None
        for i, info in enumerate(candidates):
            if info.model_only:
                logger.info("skipping %s: a model-only export cannot resume training", info.path.name)
                continue
            rest = [c for c in candidates[i + 1:] if not c.model_only]
            try:
                return self._load_full(info)
            except UnreadableCheckpoint as e:
                self._damaged.add(info.path.name)
                logger.warning(
                    "checkpoint %s is corrupt or partial (%s); %s", info.path.name, e,
                    f"falling back to {rest[0].path.name}" if rest else "no older complete checkpoint to fall back to",
                )
            except RefusedCheckpoint as e:
                # Not a disk fault but a changed file: no silent fallback to an older checkpoint
                # of the same folder, which whoever changed this one could have changed too.
                older = f", or resume from an older one with --checkpoint.load_step {rest[0].step}" if rest else ""
                raise RefusedCheckpoint(
                    f"{e}; remove the checkpoint {info.path} if you did not write it (the run does not fall back "
                    f"past it{older})"
                ) from None
        raise CheckpointError(
            f"no loadable checkpoint in {self.folder} (see the warnings above); "
            "move the folder away to start from scratch"
        )

    def _load_full(self, info: CheckpointInfo) -> dict:
        if info.model_only:
            raise CheckpointError(
                f"{info.path} is a model-only export; use checkpoint.initial_load_path to start from it"
            )
        start = time.perf_counter()
        verified = verify_checkpoint(info.path, self.cfg.load_unverified)
        shapes = checkpoint_shapes(info.path)
        # Whatever train_state keys the checkpoint has (older ones may lack newer counters).
        saved_train_state = {k.removeprefix("train_state."): 0 for k in shapes if k.startswith("train_state.")}
        # Checkpoints written before param groups were keyed by name hold them by group index.
        by_index = any(INDEXED_GROUP.match(k) for k in shapes)
        options = StateDictOptions() if by_index else OPTIM_BY_NAME
        state = self._full_state(saved_train_state, options)
        check_model_fits(info.path, state["model"], shapes, whole=not self.pipeline_share)
        reset_optimizer = self._optimizer_switched(info.path)
        if reset_optimizer:
            # Another optimizer has other param groups: of the schedule only its position carries over.
            del state["optimizer"]
            state["lr_scheduler"] = {k: state["lr_scheduler"][k] for k in ("last_epoch", "_step_count")}
        rank_key = self._rank_key()
        own = state.pop(rank_key)
        saved_ranks = sorted({int(m.group(1)) for k in shapes if (m := RANK_STATE.match(k))})
        _check_data_source_kind(info.path, "mixture" in own["dataloader"], shapes)
        world = global_world_size()
        if read_marker(info.path).get("world_size", world) == world:
            candidates = [self.rank] if self.rank in saved_ranks else []
        else:
            # Another world size: the data position is global (the same on every saved rank),
            # so any saved rank's entry continues this rank's data; its own entry comes first.
            candidates = sorted(saved_ranks, key=lambda r: r != self.rank)
        for r in candidates:
            state[f"rank_state_{r}"] = copy.deepcopy(own)
        ema_saved = any(k.startswith("ema.") for k in shapes)
        if self.ema is not None and not ema_saved:
            del state["ema"]
        kept = _group_steps_not_saved(state.get("optimizer", {}), shapes)
        dcp_load(state, info.path)
        for key, value in kept.items():  # from the per-parameter count where there is one
            old = state["optimizer"].pop(_per_parameter_step(key), None)
            state["optimizer"][key] = value if old is None else int(old.item())
        if reset_optimizer:
            set_model_state_dict(self.model, state["model"], options=options)
        else:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                options=options,
            )
        self.lr_scheduler.load_state_dict({**self.lr_scheduler.state_dict(), **state["lr_scheduler"]})
        if reset_optimizer:  # the fresh groups' LRs at the resumed step, as LambdaLR.step() sets them
            for group, base, factor in zip(
                self.optimizer.param_groups, self.lr_scheduler.base_lrs, self.lr_scheduler.lr_lambdas
            ):
                group["lr"] = base * factor(self.lr_scheduler.last_epoch)
        self._restore_rank_state([(r, state[f"rank_state_{r}"]) for r in candidates], info.path.name)
        if self.ema is not None and ema_saved:
            self.ema.loaded()
        elif self.ema is not None:
            self.ema.restart()
            logger.info("%s holds no parameter EMA (saved without ema.enable): the EMA starts from the resumed "
                        "weights", info.path.name)
        train_state = state["train_state"]
        self._last_saved_step = int(train_state["step"])
        self._good = (info.path, "its checksums verified when this run resumed from it" if verified else
                      "resumed from; saved before checksums were recorded, so not verified")
        logger.info("resumed from %s (step %d) in %.2fs", info.path, train_state["step"], time.perf_counter() - start)
        return train_state

    def _optimizer_switched(self, path: Path) -> bool:
        """Whether the checkpoint's optimizer state is another optimizer's (`name/state_dtype`), which
        `checkpoint.reset_optimizer` allows (its state then starts afresh) and anything else refuses.
        Checkpoints older than the marker's "optimizer" entry are taken as this run's."""
        current = optimizer_signature(self.optimizer)
        saved = read_marker(path).get("optimizer", current)
        if saved == current:
            return False
        if not self.cfg.reset_optimizer:
            raise CheckpointError(
                f"{path} holds {saved} optimizer state but this run uses {current} (optimizer.name/state_dtype); "
                "resume with the same optimizer, or add --checkpoint.reset_optimizer to start its state afresh"
            )
        logger.warning("%s: optimizer state of %s not loaded, %s starts afresh (checkpoint.reset_optimizer)",
                       path.name, saved, current)
        return True

    def _restore_rank_state(self, saved: list[tuple[int, dict]], name: str) -> None:
        """Data position (a position in the global sample stream, valid in any layout) and RNG
        from the first saved rank whose data loader state loads, this rank's own entry first."""
        errors = []
        for r, rank_state in saved:
            try:
                self.dataloader.load_state_dict(rank_state["dataloader"])
            except ValueError as e:
                errors.append(f"rank {r}: {e}")
                continue
            if r != self.rank:
                logger.info("%s: data position and RNG taken from saved rank %d", name, r)
            _set_rng_state(rank_state["rng"], self.device)
            return
        if not saved:
            logger.warning("%s has no data loader state (a model-only save): data order and RNG restart from the seed",
                           name)
            return
        logger.warning("data loader position not restored: %s", "; ".join(errors))
        if saved[0][0] == self.rank:
            _set_rng_state(saved[0][1]["rng"], self.device)

    def _initial_load(self) -> None:
        cfg = self.cfg
        path = Path(cfg.initial_load_path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint.initial_load_path: {path} does not exist")
        start = time.perf_counter()
        if cfg.initial_load_format == "hf":
            load_hf_weights(path, self.model, self.model_args)
        else:
            path = load_model_weights(path, self.model, whole=not self.pipeline_share,
                                      load_unverified=self.cfg.load_unverified)
        logger.info(
            "initial weights loaded from %s (%s) in %.2fs", path, cfg.initial_load_format, time.perf_counter() - start
        )


def _check_data_source_kind(path: Path, reads_mixture: bool, shapes: dict) -> None:
    """A one-dataset run's data position (a stream index) and a mixture's (one per source) do not
    translate: say so, instead of DCP's missing key, which the resume would take for damage."""
    saved = [k for k in shapes if RANK_STATE.match(k) and ".dataloader." in k]
    saved_mixture = any(".dataloader.mixture" in k for k in saved)
    if saved and saved_mixture != reads_mixture:
        was, now = ("a mixture", "one dataset") if saved_mixture else ("one dataset", "a mixture (training.dataset_mix)")
        raise CheckpointError(
            f"{path} was saved by a run reading {was} and this run reads {now}: the data position does not "
            "carry over. Resume with the data settings it was saved with, or start the new data from its weights "
            f"in a new run folder with --checkpoint.initial_load_path {path}"
        )

