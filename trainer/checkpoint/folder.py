"""The on-disk checkpoint folder: its files, its completion marker, and model-only weights.

One checkpoint is the folder `<dump_folder>/<checkpoint.folder>/step-N` holding DCP's shard files
and `.metadata`, our `model_args.json` and, written last, the `COMPLETE` marker (a JSON object:
`step`, `model_only`, `world_size`, ..., and `files`: each file's size and SHA-256, checked before
every load; `trainer.checkpoint.integrity`). A folder without the marker, or a `step-N.tmp`
folder, is an unfinished save. What the state dict inside holds is `trainer.checkpoint.manager`'s
business; this module reads and writes the folder and the `model.*` entries that model-only
exports, `initial_load_path` and `scripts/convert_hf.py` share.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models.deepseek_v3 import DeepSeekV3ModelArgs, DeepSeekV3StateDictAdapter
from models.deepseek_v3.hf_io import CONFIG_FILE, read_hf_config, read_hf_state_dict, rope_mismatches
from trainer.checkpoint.errors import CheckpointError, RefusedCheckpoint, UnreadableCheckpoint
from trainer.checkpoint.integrity import ChecksumWriter, checksum_problems, record_checksums
from trainer.checkpoint.safe_load import read_metadata, safe_dcp_load
from trainer.distributed import is_distributed

logger = logging.getLogger("trainer")

COMPLETE = "COMPLETE"
MODEL_ARGS = "model_args.json"
DCP_METADATA = ".metadata"
FILES = "files"  # the marker's record of every file's size and SHA-256
_STEP_DIR = re.compile(r"step-(\d+)")
RANK_STATE = re.compile(r"rank_state_(\d+)\.")
TMP_SUFFIX = ".tmp"
# Buffers that keep fp32 in a reduced-precision export: the routing bias moves in steps of
# ~1e-3, below bf16's resolution at magnitudes near 1.
_KEEP_FP32_SUFFIXES = ("expert_bias", "tokens_per_expert")


# DCP gathers every rank's failure into a CheckpointException, which is a BaseException.
LOAD_ERRORS = (Exception, CheckpointException)


@dataclasses.dataclass
class CheckpointInfo:
    path: Path
    step: int
    model_only: bool


@contextmanager
def quiet_single_process():
    """DCP warns on every single-process save/load that it assumes a single process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_load(state: dict[str, Any], path: Path) -> None:
    """`dcp.load` of `state` in place from the checkpoint folder `path`, on one process or many,
    running no code from its files (`safe_load`): RefusedCheckpoint where one would, and
    UnreadableCheckpoint for any other failure (a damaged file)."""
    try:
        with quiet_single_process():
            safe_dcp_load(state, path, no_dist=not is_distributed())
    except RefusedCheckpoint:
        raise
    except LOAD_ERRORS as e:
        raise UnreadableCheckpoint(short_error(e)) from None


def seal(tmp: Path, final: Path, model_args: DeepSeekV3ModelArgs, marker: dict) -> None:
    """Finish a written checkpoint folder: add `model_args.json`, then the `COMPLETE` marker,
    with every file's checksum, then rename `tmp` to `final` (replacing an older folder of that name)."""
    (tmp / MODEL_ARGS).write_text(json.dumps(dataclasses.asdict(model_args), indent=1))
    marker = {**marker, FILES: record_checksums(tmp)}
    # Written last: its presence is the promise that everything else is on disk.
    (tmp / COMPLETE).write_text(json.dumps(marker))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


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
            try:
                model_only = bool(read_marker(path).get("model_only", False))
            except UnreadableCheckpoint:
                # Listed as a full checkpoint: a load verifies the marker first and reports it by name.
                model_only = False
            found.append(CheckpointInfo(path, int(match.group(1)), model_only))
    return sorted(found, key=lambda c: c.step, reverse=True)


def incomplete_checkpoints(folder: str | Path) -> list[Path]:
    """`step-N` folders under `folder` that `list_checkpoints` passes over: no `COMPLETE` marker
    or no DCP `.metadata` (a damaged or partly copied checkpoint; saves go through `.tmp`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir() and not is_complete(p))


def read_marker(path: Path) -> dict:
    """The `COMPLETE` marker of the checkpoint folder `path`; {} when it has none (a DCP folder
    another tool wrote). Every version of this trainer wrote a JSON object there, so anything else
    (empty, cut off, changed bytes) is a damaged marker: its record of the other files cannot be
    trusted, and UnreadableCheckpoint names it, as a damaged shard is named."""
    file = path / COMPLETE
    try:
        text = file.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UnreadableCheckpoint(f"cannot read {file}: {e.strerror}") from None
    if not text.strip():
        raise UnreadableCheckpoint(f"{file} is damaged: empty (its save wrote a JSON object)")
    try:
        marker = json.loads(text)  # bytes: a changed byte that is not UTF-8 is a ValueError too
    except ValueError as e:
        raise UnreadableCheckpoint(f"{file} is damaged: not the JSON its save wrote ({str(e).splitlines()[0]})") from None
    if not isinstance(marker, dict):
        raise UnreadableCheckpoint(f"{file} is damaged: a JSON {type(marker).__name__}, not the object its save wrote")
    if not isinstance(marker.get("step"), int) or isinstance(marker.get("step"), bool):
        # Every version's marker names its step: `{}`, or a changed byte in the key, is damage.
        raise UnreadableCheckpoint(f"{file} is damaged: no \"step\", which every marker of this trainer names")
    files = marker.get(FILES)
    if files is not None and not _well_formed_record(files):
        raise UnreadableCheckpoint(f"{file} is damaged: its \"{FILES}\" entry is not a record of sizes and SHA-256s")
    return marker


def _well_formed_record(files) -> bool:
    return isinstance(files, dict) and all(
        isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str)
        for f in files.values()
    )


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


def short_error(e: BaseException) -> str:
    """One line for the log instead of DCP's per-rank traceback dump."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (inner, _) = next(iter(failures.items()))  # each rank's (exception, traceback)
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint folder `path`, read without running code from it (a
    pickle naming anything but DCP's metadata raises RefusedCheckpoint)."""
    try:
        return read_metadata(path / DCP_METADATA)
    except RefusedCheckpoint:
        raise
    except LOAD_ERRORS as e:  # a corrupt .metadata raises whatever unpickling raises
        raise UnreadableCheckpoint(f"cannot read {path / DCP_METADATA}: {short_error(e)}") from None


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every key of a DCP checkpoint with its tensor shape (None for non-tensor values)."""
    metadata = read_dcp_metadata(path)
    return {
        k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
        for k, v in metadata.state_dict_metadata.items()
    }


def verify_checkpoint(path: Path, load_unverified: bool = False) -> bool:
    """Raise UnreadableCheckpoint naming a damaged `COMPLETE` marker, a file of `path` its record
    leaves out, or every file whose size or SHA-256 differs from its record (every rank calls it:
    the ranks share the hashing). Fails closed: a marker without a record (`{"step": 12}`: one
    changed byte in its key, or a checkpoint saved before checksums existed) or no marker at all
    (a DCP folder another tool wrote) is refused, unless `load_unverified`
    (`checkpoint.load_unverified`); then it returns False: nothing was verified."""
    marker = read_marker(path)
    files = marker.get(FILES)
    if files is None:
        what = f"{path / COMPLETE} records no checksums" if marker else f"{path} has no {COMPLETE} marker"
        if not load_unverified:
            raise UnreadableCheckpoint(
                f"{what}, so its files cannot be verified (a damaged marker, or a checkpoint saved before checksums "
                "existed or by another tool); --checkpoint.load_unverified loads such a checkpoint unverified"
            )
        logger.warning("%s: loading it unverified (checkpoint.load_unverified)", what)
        return False
    unrecorded = sorted(p.name for p in path.iterdir() if p.name != COMPLETE and p.name not in files)
    if unrecorded:
        raise UnreadableCheckpoint(
            f"{path / COMPLETE} is damaged: its checksum record leaves out files the checkpoint holds "
            f"{_listing(unrecorded)}"
        )
    start = time.perf_counter()
    problems = checksum_problems(path, files)
    if problems:
        raise UnreadableCheckpoint("; ".join(problems))
    logger.info("%s: %d files (%.1f MiB) match their checksums, checked in %.2fs", path, len(files),
                sum(f["bytes"] for f in files.values()) / 2**20, time.perf_counter() - start)
    return True


def verify_or_refuse(path: Path, load_unverified: bool = False) -> None:
    """`verify_checkpoint` for a load that has no older checkpoint to fall back to."""
    try:
        verify_checkpoint(path, load_unverified)
    except UnreadableCheckpoint as e:
        raise CheckpointError(str(e)) from None


def _listing(keys: list[str], limit: int = 8) -> str:
    return f"({len(keys)}): {', '.join(keys[:limit])}{' ...' if len(keys) > limit else ''}"


def check_model_fits(
    path: Path, model_sd: dict[str, Any], shapes: dict[str, tuple | None], prefix: str = "model.",
    whole: bool = True,
) -> None:
    """Raise CheckpointError naming every key and shape that differs between checkpoint and model.
    ``whole=False``: the model is one pipeline rank's share, so the checkpoint's other keys are
    other stages' (checked there)."""
    ckpt = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix)}
    ours = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = sorted(set(ours) - set(ckpt))
    unexpected = sorted(set(ckpt) - set(ours)) if whole else []
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


def load_model_weights(path: str | Path, model: torch.nn.Module, whole: bool = True, load_unverified: bool = False) -> Path:
    """Load only the `model.*` entries of a DCP checkpoint (full or model-only, any dtype) into
    `model` (``whole=False``: one pipeline rank's share), resharding to its layout. Returns the
    checkpoint path used."""
    path = resolve_checkpoint_path(path)
    model_sd = get_model_state_dict(model)
    verify_or_refuse(path, load_unverified)
    try:
        shapes = checkpoint_shapes(path)
    except UnreadableCheckpoint as e:
        raise CheckpointError(str(e)) from None
    check_model_fits(path, model_sd, shapes, whole=whole)
    state = {"model": model_sd}
    try:
        dcp_load(state, path)
    except UnreadableCheckpoint as e:
        raise CheckpointError(f"cannot read the model weights of {path}: {e}") from None
    set_model_state_dict(model, state["model"])
    return path


def load_hf_weights(path: str | Path, model: torch.nn.Module, args: DeepSeekV3ModelArgs) -> None:
    """Load a HF / DeepSeek safetensors folder (bf16/fp32, or FP8 with block scales) into `model`.
    Every rank reads the files and keeps its own shards (`full_state_dict` loading)."""
    hf_sd = read_hf_state_dict(path, dtype=torch.float32)
    if (Path(path) / CONFIG_FILE).is_file() and (mismatch := rope_mismatches(args, read_hf_config(path))):
        logger.warning("positional settings differ from %s/%s (ours vs its): %s", path, CONFIG_FILE, "; ".join(mismatch))
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
    tmp = final.with_name(final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_single_process():
        dcp.save({"model": model_sd}, storage_writer=ChecksumWriter(str(tmp)), no_dist=not is_distributed())
    seal(tmp, final, model_args, {"step": step, "model_only": True})
    return final


def read_model_state_dict(path: str | Path, load_unverified: bool = False, ema: bool = False) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP checkpoint as plain CPU tensors in their saved dtypes,
    without building a model (for conversion). ``ema``: the parameters are the checkpoint's
    parameter EMA instead (`ema.*`, fp32; `[ema] enable`), the buffers the model's."""
    path = resolve_checkpoint_path(path)
    verify_or_refuse(path, load_unverified)
    try:
        metadata = read_dcp_metadata(path).state_dict_metadata
    except UnreadableCheckpoint as e:
        raise CheckpointError(str(e)) from None

    def tensors(prefix: str) -> dict[str, torch.Tensor]:
        return {
            k.removeprefix(prefix): torch.empty(tuple(v.size), dtype=v.properties.dtype)
            for k, v in metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
        }

    state = {"model": tensors("model.")}
    if not state["model"]:
        raise CheckpointError(f"{path} holds no model weights")
    if ema:
        state["ema"] = tensors("ema.")
        if not state["ema"]:
            raise CheckpointError(f"{path} holds no parameter EMA (it was saved without --ema.enable)")
    try:
        dcp_load(state, path)
    except UnreadableCheckpoint as e:
        raise CheckpointError(f"cannot read the model weights of {path}: {e}") from None
    return {**state["model"], **state.get("ema", {})}
