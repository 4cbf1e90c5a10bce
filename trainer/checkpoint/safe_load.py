"""Reading a DCP checkpoint without running code from its files.

A DCP checkpoint holds pickles in two places: `.metadata` (DCP's index of the shard files, which
`FileSystemReader` reads with `pickle.load`) and every non-tensor entry of the state dict (the
optimizer's hyperparameters, the train state, the data position, RNG states: 1,231 of the debug
model's 1,648 entries), which DCP's default load planner reads with
`torch.load(weights_only=False)`. A pickle can name any importable callable, and unpickling calls
it, so whoever can write a checkpoint folder (shared storage, a copy, a download) could run code in
every process that loads it. The `COMPLETE` marker's checksums do not stop that: the same person
can rewrite them. So every load here goes through

- `SafeFileSystemReader`, whose `.metadata` unpickler resolves only `METADATA_GLOBALS` (DCP's
  metadata classes, torch's dtypes, `Size`, the layouts and DCP's memory-format encoding, and the
  path DCP records); calling any of them builds data and nothing else;
- `WeightsOnlyLoadPlanner`, which reads the non-tensor entries with
  `torch.load(weights_only=True)`: plain containers, numbers, strings, tensors, and
  `ENTRY_GLOBALS` (numpy arrays: `numpy.random.get_state()` is saved in every `rank_state_R`).

Everything this trainer saves reads through both, so a checkpoint it wrote, before this module
existed or since, loads as it did. A pickle that names anything else raises `RefusedCheckpoint`
naming the file and the global, before the global is even imported; so does a non-tensor entry
that the weights-only unpickler refuses for another reason (an opcode it does not run, bytes it
cannot parse). A file that fails otherwise (a cut-off pickle or archive) is damaged, as before:
the caller's `UnreadableCheckpoint`, which a resume falls back past. The checksums, checked before
every load, already tell a disk fault from a file rewritten along with its record.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

# DCP's own helper that puts a value into the nested state dict, as DefaultLoadPlanner.load_bytes
# (which WeightsOnlyLoadPlanner replaces) does.
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainer.checkpoint.errors import RefusedCheckpoint

_DCP_METADATA_CLASSES = (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
)
# (module, name) of every global a `.metadata` written by DCP names. torch pickles a dtype by its
# name in `torch` and a layout through `torch.serialization._get_layout(name)`, a table lookup;
# `StorageMeta.checkpoint_id` is the folder's path as FileSystemWriter was given it.
METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
       ("pathlib._local", "PosixPath")}  # where Python 3.13 defines (and so pickles) PosixPath
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.layout))}
)
# numpy's array pickle, for the MT19937 key (uint32) of `numpy.random.get_state()`:
# `_reconstruct(ndarray, shape, dtype)` makes an empty array whose bytes the pickle then sets, and
# the dtype is `numpy.dtype("u4")` with its state set (an instance of uint32's dtype class). numpy 2
# moved `_reconstruct` from `numpy.core` to `numpy._core`; a checkpoint names the module its numpy
# had, so both names stand for the function this numpy has.
_NUMPY_RECONSTRUCT = np.empty(0).__reduce__()[0]
ENTRY_GLOBALS = [
    (_NUMPY_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
    (_NUMPY_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refused(file: Path, holds: str) -> RefusedCheckpoint:
    return RefusedCheckpoint(
        f"{file} holds {holds}, which no checkpoint of this trainer holds: loading it would run code from the "
        "file (refused; nothing from it was run)"
    )


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `METADATA_GLOBALS`; any other global refuses the file."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise _refused(self.path, f"a pickle naming the global {module}.{name}")
        return super().find_class(module, name)


def read_metadata(file: Path) -> Metadata:
    """DCP's `.metadata` file `file`, unpickled with `MetadataUnpickler`."""
    with open(file, "rb") as f:
        metadata = MetadataUnpickler(f, file).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, reading `.metadata` with `MetadataUnpickler` and the non-tensor entries only
    through a `WeightsOnlyLoadPlanner` (tensors it reads with `torch.load(weights_only=True)` already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # As FileSystemReader.read_metadata: DCP's load keys its plans by this id.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        if not isinstance(planner, WeightsOnlyLoadPlanner):
            raise TypeError(f"SafeFileSystemReader reads through a WeightsOnlyLoadPlanner, not a {type(planner).__name__}")
        return super().read_data(plan, planner)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor entries of the checkpoint folder `folder`
    with `torch.load(weights_only=True)` and `ENTRY_GLOBALS`."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = Path(folder)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals(ENTRY_GLOBALS), warnings.catch_warnings():
                # A bare pickle (DCP writes torch.save archives) gets torch's advice on pickle
                # protocols before the refusal below: noise next to its one line.
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            name = _REFUSED_GLOBAL.search(str(e))
            file = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
            holds = f"the global {name.group(1)}" if name else "a pickle that torch.load(weights_only=True) refuses"
            raise _refused(file, f"in its entry {fqn} {holds}") from None
        set_element(self.original_state_dict, self.mappings[fqn], loaded)


def safe_dcp_load(state: dict[str, Any], folder: Path, no_dist: bool) -> None:
    """`dcp.load` of `state` from the checkpoint folder `folder` through the reader and planner above.
    A refusal on any rank is raised on every rank as the `RefusedCheckpoint` itself (DCP gathers
    each rank's failure into one CheckpointException)."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(folder)), planner=WeightsOnlyLoadPlanner(folder),
                 no_dist=no_dist)
    except CheckpointException as e:
        for error, _ in e.failures.values():
            if isinstance(error, RefusedCheckpoint):
                raise error from None
        raise
