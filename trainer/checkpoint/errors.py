"""What can be wrong with a checkpoint, as three exceptions: each failure is handled differently.

- `CheckpointError`: it cannot be used as asked (another model, an explicit step that is missing
  or damaged); the run stops with one line.
- `UnreadableCheckpoint`: its files are damaged (a disk or copy fault); a resume reports it and
  falls back to the next older checkpoint.
- `RefusedCheckpoint`: a file holds a pickle that would run code when loaded; nothing from it
  ran, and the run stops rather than fall back past it (tampering is not a disk fault: the
  older checkpoints of that folder may have been changed too).
"""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says which and why."""


class UnreadableCheckpoint(Exception):
    """A checkpoint whose files are damaged (as opposed to one that does not fit the model)."""


class RefusedCheckpoint(CheckpointError):
    """A checkpoint file that holds a pickle a load would have to run code for; the message names
    the file and what it holds."""
