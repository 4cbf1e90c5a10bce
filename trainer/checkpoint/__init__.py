"""Checkpoints: the on-disk folder format (`folder`), reading it without running code from it
(`safe_load`), and the run's save/resume manager (`manager`)."""

from trainer.checkpoint.errors import CheckpointError, RefusedCheckpoint
from trainer.checkpoint.folder import (
    COMPLETE,
    CheckpointInfo,
    export_state_dict,
    list_checkpoints,
    load_hf_weights,
    load_model_weights,
    read_model_args,
    read_model_state_dict,
    resolve_checkpoint_path,
    save_model_checkpoint,
)
from trainer.checkpoint.manager import CheckpointManager

__all__ = [
    "COMPLETE",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "RefusedCheckpoint",
    "export_state_dict",
    "list_checkpoints",
    "load_hf_weights",
    "load_model_weights",
    "read_model_args",
    "read_model_state_dict",
    "resolve_checkpoint_path",
    "save_model_checkpoint",
]
