"""Job configuration, torch-free so that `--help` and config errors come back instantly.

- `fields`: what a field is (declaration, types and `Literal` choices, conversion);
- `schema`: one dataclass per TOML section (fields, defaults, one-line docs, per-section checks);
- `combinations`: checks across sections (inputs that would be ignored: refused or warned);
- `loader`: TOML file + command line -> `JobConfig` (CLI > TOML > defaults), did-you-mean hints, `--help`;
- `layout`: the parallel degrees and their arithmetic against the world size (also the base of
  `ParallelDims`);
- `check`: the pre-launch check `run_train.sh` runs before starting any process.
"""

from trainer.config.activation_checkpoint import ActivationCheckpoint
from trainer.config.fields import ConfigError, Section, option, sections_of
from trainer.config.loader import format_help, from_dict, load_config
from trainer.config.schema import (
    Checkpoint,
    Comm,
    Engram,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Quantize,
    Training,
    Validation,
)

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "ConfigError",
    "Engram",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Quantize",
    "Section",
    "Training",
    "Validation",
    "format_help",
    "from_dict",
    "load_config",
    "option",
    "sections_of",
]
