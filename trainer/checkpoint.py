"""Training checkpoints on `torch.distributed.checkpoint` (DCP): save, prune, resume, initial load.

One checkpoint is the folder `<dump_folder>/<checkpoint.folder>/step-N` holding DCP's shard files
and `.metadata`, our `model_args.json` and, written last, the `COMPLETE` marker. Its state dict:

    model          get_state_dict(model): parameters and persistent buffers (the MoE `expert_bias`)
    optimizer      get_state_dict(optimizer): FQN-keyed, so it reshards like the model
    lr_scheduler   LambdaLR.state_dict()
    train_state    {"step", "skipped_total"}
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
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from models.deepseek_v3 import DeepSeekV3ModelArgs, DeepSeekV3StateDictAdapter
from models.deepseek_v3.hf_io import read_hf_state_dict

logger = logging.getLogger("trainer")

COMPLETE = "COMPLETE"
MODEL_ARGS = "model_args.json"
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"step-(\d+)")
_RANK_STATE = re.compile(r"rank_state_(\d+)\.")
_TMP_SUFFIX = ".tmp"
# Buffers that keep fp32 in a reduced-precision export: the routing bias moves in steps of
# ~1e-3, below bf16's resolution at magnitudes near 1.
_KEEP_FP32_SUFFIXES = ("expert_bias", "tokens_per_expert")


# DCP gathers every rank's failure into a CheckpointException, which is a BaseException.
_LOAD_ERRORS = (Exception, CheckpointException)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says which and why."""


@dataclasses.dataclass
class CheckpointInfo:
    path: Path
    step: int
    model_only: bool


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load that it assumes a single process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / DCP_METADATA).is_file()


def list_checkpoints(folder: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under `folder`, newest first; `.tmp` and unmarked folders are ignored."""
    folder = Path(folder)
    found = []
    if not folder.is_dir():
        return found
    for path in folder.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir() and is_complete(path):
            marker = _read_marker(path)
            found.append(CheckpointInfo(path, int(match.group(1)), bool(marker.get("model_only", False))))
    return sorted(found, key=lambda c: c.step, reverse=True)


def _read_marker(path: Path) -> dict:
    try:
        return json.loads((path / COMPLETE).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def read_model_args(path: str | Path) -> DeepSeekV3ModelArgs:
    """The model args a checkpoint was saved with (for conversion without the run's config)."""
    file = Path(path) / MODEL_ARGS
    if not file.is_file():
        raise CheckpointError(f"{path} has no {MODEL_ARGS}; is it a checkpoint written by this trainer?")
    return DeepSeekV3ModelArgs(**json.loads(file.read_text()))


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder itself, or a folder of `step-N` checkpoints (its newest complete one)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    if (path / DCP_METADATA).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"{path} is neither a DCP checkpoint (no {DCP_METADATA}) nor a folder of complete step-N checkpoints"
        )
    return found[0].path


def _short_error(e: BaseException) -> str:
    """One line for the log instead of DCP's per-rank traceback dump."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, wrapped = next(iter(failures.items()))
        inner = getattr(wrapped, "exception", wrapped)
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every key of a DCP checkpoint with its tensor shape (None for non-tensor values)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except _LOAD_ERRORS as e:  # a corrupt .metadata raises whatever unpickling raises
        raise _Unreadable(f"cannot read {path / DCP_METADATA}: {_short_error(e)}") from None
    return {
        k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
        for k, v in metadata.state_dict_metadata.items()
    }


class _Unreadable(Exception):
    """A checkpoint whose files are damaged (as opposed to one that does not fit the model)."""


def _listing(keys: list[str], limit: int = 8) -> str:
    return f"({len(keys)}): {', '.join(keys[:limit])}{' ...' if len(keys) > limit else ''}"


def check_model_fits(
    path: Path, model_sd: dict[str, Any], shapes: dict[str, tuple | None], prefix: str = "model."
) -> None:
    """Raise CheckpointError naming every key and shape that differs between checkpoint and model."""
    ckpt = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix)}
    ours = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = sorted(set(ours) - set(ckpt))
    unexpected = sorted(set(ckpt) - set(ours))
    wrong = [
        f"{k}: checkpoint {ckpt[k]} vs model {ours[k]}" for k in sorted(set(ours) & set(ckpt)) if ckpt[k] != ours[k]
    ]
    if not (missing or unexpected or wrong):
        return
    parts = []
    if missing:
        parts.append(f"missing in checkpoint {_listing(missing)}")
    if unexpected:
        parts.append(f"not in this model {_listing(unexpected)}")
    if wrong:
        parts.append(f"shape mismatch ({len(wrong)}): {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}")
    raise CheckpointError(
        f"checkpoint {path} was saved from a different model (another [model] flavor or model option?):\n  "
        + "\n  ".join(parts)
    )


def export_state_dict(model_sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point weights cast to `dtype` (MoE routing buffers stay fp32)."""
    return {
        k: v.to(dtype) if v.is_floating_point() and not k.endswith(_KEEP_FP32_SUFFIXES) else v
        for k, v in model_sd.items()
    }


def load_model_weights(path: str | Path, model: torch.nn.Module) -> Path:
    """Load only the `model.*` entries of a DCP checkpoint (full or model-only, any dtype) into
    `model`, resharding to its layout. Returns the checkpoint path used."""
    path = resolve_checkpoint_path(path)
    model_sd = get_model_state_dict(model)
    try:
        shapes = _checkpoint_shapes(path)
    except _Unreadable as e:
        raise CheckpointError(str(e)) from None
    check_model_fits(path, model_sd, shapes)
    state = {"model": model_sd}
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=_single_process())
    except _LOAD_ERRORS as e:
        raise CheckpointError(f"cannot read the model weights of {path}: {_short_error(e)}") from None
    set_model_state_dict(model, state["model"])
    return path


def load_hf_weights(path: str | Path, model: torch.nn.Module, args: DeepSeekV3ModelArgs) -> None:
    """Load a HF / DeepSeek safetensors folder (bf16/fp32, or FP8 with block scales) into `model`.
    Every rank reads the files and keeps its own shards (`full_state_dict` loading)."""
    hf_sd = read_hf_state_dict(path, dtype=torch.float32)
    try:
        native = DeepSeekV3StateDictAdapter(args).from_hf(hf_sd)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"HF checkpoint {path} does not fit this model: {e.args[0] if e.args else e}") from None
    result = set_model_state_dict(model, native, options=StateDictOptions(full_state_dict=True, strict=False))
    if result.missing_keys:
        logger.info("HF checkpoint has no weights for %d keys (kept freshly initialised): %s",
                    len(result.missing_keys), ", ".join(result.missing_keys[:6]))


def save_model_checkpoint(
    model_sd: dict[str, torch.Tensor], path: str | Path, model_args: DeepSeekV3ModelArgs, step: int = 0
) -> Path:
    """Write a model-only DCP checkpoint folder (atomically, with `model_args.json` and the
    `COMPLETE` marker) that `initial_load_path` and `scripts/convert_hf.py export` read."""
    final = Path(path)
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet_single_process():
        dcp.save({"model": model_sd}, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=_single_process())
    (tmp / MODEL_ARGS).write_text(json.dumps(dataclasses.asdict(model_args), indent=1))
    (tmp / COMPLETE).write_text(json.dumps({"step": step, "model_only": True}))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def read_model_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP checkpoint as plain CPU tensors in their saved dtypes,
    without building a model (for conversion)."""
    path = resolve_checkpoint_path(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {
        k.removeprefix("model."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"{path} holds no model weights")
    state = {"model": model}
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=_single_process())
    except _LOAD_ERRORS as e:
        raise CheckpointError(f"cannot read the model weights of {path}: {_short_error(e)}") from None
    return state["model"]


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
        run_dir: the run folder (`[job] dump_folder`); checkpoints go to `run_dir / cfg.folder`.
        dataloader: anything with `state_dict()` / `load_state_dict()`.
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
    ):
        self.cfg = cfg
        self.folder = Path(run_dir) / cfg.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.model_args = model_args
        self.device = device
        self.rank = _rank()
        self.storage_writer_factory = storage_writer_factory or (lambda path: dcp.FileSystemWriter(str(path)))
        self._pending: _PendingSave | None = None
        self._last_saved_step = -1
        self._async_pg = None
        if cfg.enable and cfg.async_mode == "async":
            if _single_process():
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

    def _full_state(self, train_state: dict) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": dict(train_state),
            self._rank_key(): {"dataloader": self.dataloader.state_dict(), "rng": _rng_state(self.device)},
        }

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
        final = self.folder / f"step-{step}"
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        marker = {"step": step, "model_only": model_only, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1}
        if model_only:
            marker["dtype"] = self.cfg.export_dtype
        start = time.perf_counter()
        writer = self.storage_writer_factory(tmp)
        if self.cfg.async_mode == "async" and not last:
            with _quiet_single_process():
                future = dcp.async_save(
                    state, storage_writer=writer, process_group=self._async_pg, no_dist=_single_process()
                )
            # torch >= 2.9 may return an AsyncSaveResponse; its upload future is the one to wait on.
            future = getattr(future, "upload_completion", future)
            self._pending = _PendingSave(future, tmp, final, marker)
            logger.info(
                "checkpoint step %d: staged in %.2fs, writing in the background", step, time.perf_counter() - start
            )
        else:
            with _quiet_single_process():
                dcp.save(state, storage_writer=writer, no_dist=_single_process())
            self._finalize(_PendingSave(None, tmp, final, marker))
            logger.info("checkpoint step %d saved to %s in %.2fs%s", step, final, time.perf_counter() - start,
                        f" (model only, {self.cfg.export_dtype})" if model_only else "")
        self._last_saved_step = step

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
            (pending.tmp / MODEL_ARGS).write_text(json.dumps(dataclasses.asdict(self.model_args), indent=1))
            # Written last: its presence is the promise that everything else is on disk.
            (pending.tmp / COMPLETE).write_text(json.dumps(pending.marker))
            if pending.final.exists():
                shutil.rmtree(pending.final)
            pending.tmp.rename(pending.final)
            self._prune()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for old in list_checkpoints(self.folder)[k:]:
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
                for stale in self.folder.glob(f"step-*{_TMP_SUFFIX}"):
                    logger.warning("removing %s: an unfinished save of an earlier run", stale)
                    shutil.rmtree(stale, ignore_errors=True)
            _barrier()
            state = self._resume()
            if state is not None:
                return state
        elif cfg.load_step != -1:
            raise CheckpointError(f"checkpoint.load_step = {cfg.load_step} needs checkpoint.enable = true")
        if cfg.initial_load_path:
            self._initial_load()
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
                return self._load_full(CheckpointInfo(path, cfg.load_step, _read_marker(path).get("model_only", False)))
            except _Unreadable as e:
                raise CheckpointError(str(e)) from None
        candidates = list_checkpoints(self.folder)
        if not candidates:
            if self.folder.is_dir():
                logger.info("no complete checkpoint in %s; starting from scratch", self.folder)
            return None
        for i, info in enumerate(candidates):
            if info.model_only:
                logger.info("skipping %s: a model-only export cannot resume training", info.path.name)
                continue
            try:
                return self._load_full(info)
            except _Unreadable as e:
                rest = [c for c in candidates[i + 1:] if not c.model_only]
                logger.warning(
                    "checkpoint %s is corrupt or partial (%s); %s", info.path.name, e,
                    f"falling back to {rest[0].path.name}" if rest else "no older complete checkpoint to fall back to",
                )
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
        shapes = _checkpoint_shapes(info.path)
        # Whatever train_state keys the checkpoint has (older ones may lack newer counters).
        saved_train_state = {k.removeprefix("train_state."): 0 for k in shapes if k.startswith("train_state.")}
        state = self._full_state(saved_train_state)
        check_model_fits(info.path, state["model"], shapes)
        rank_key = self._rank_key()
        own = state.pop(rank_key)
        saved_ranks = sorted({int(m.group(1)) for k in shapes if (m := _RANK_STATE.match(k))})
        world = 1 if _single_process() else dist.get_world_size()
        if _read_marker(info.path).get("world_size", world) == world:
            candidates = [self.rank] if self.rank in saved_ranks else []
        else:
            # Another world size: the data position is global (the same on every saved rank),
            # so any saved rank's entry continues this rank's data; its own entry comes first.
            candidates = sorted(saved_ranks, key=lambda r: r != self.rank)
        for r in candidates:
            state[f"rank_state_{r}"] = copy.deepcopy(own)
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(info.path)), no_dist=_single_process())
        except _LOAD_ERRORS as e:
            raise _Unreadable(_short_error(e)) from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._restore_rank_state([(r, state[f"rank_state_{r}"]) for r in candidates], info.path.name)
        train_state = state["train_state"]
        self._last_saved_step = int(train_state["step"])
        logger.info("resumed from %s (step %d) in %.2fs", info.path, train_state["step"], time.perf_counter() - start)
        return train_state

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
            path = load_model_weights(path, self.model)
        logger.info(
            "initial weights loaded from %s (%s) in %.2fs", path, cfg.initial_load_format, time.perf_counter() - start
        )
