"""Weighted data mixtures (``[training] dataset_mix``): the entries' syntax and what is wrong with them.

An entry is ``"WEIGHT DATASET [PATH]"``, the two words of a one-dataset run (``training.dataset``
and ``training.dataset_path``) after a weight: ``"0.5 shakespeare"`` (the bundled corpus),
``"0.3 json data/code/*.jsonl"`` (local files, as ``dataset_path`` names them; the rest of the
entry is the path, spaces included), ``"0.2 allenai/c4 en"`` (a hub dataset and its config).
Weights are relative (they need not sum to 1). A source is named by its entry without the weight
(``shakespeare``, ``json:data/code/*.jsonl``): the name keys its metrics (``tokens/<name>``,
``val_loss/<name>``) and its position in a checkpoint.

Torch-free, so that the config check and the pre-launch check (trainer/config/check.py) refuse
a bad entry in a second with one line; the loader (trainer/data/mixture.py) reads the same parse.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config.combinations import BUNDLED_DATASET, LOCAL_FORMATS
from trainer.config.data_files import local_format
from trainer.config.fields import ConfigError

SYNTAX = "write each entry as 'WEIGHT DATASET [PATH]', e.g. '0.5 shakespeare' or '0.3 json data/code.jsonl'"
# A Hugging Face Hub dataset id: an optional namespace and a name of letters, digits, '-', '_' and
# '.' (huggingface_hub's validate_repo_id, without importing it here).
HUB_ID = re.compile(r"^([\w\-.]{1,96}/)?[\w\-.]{1,96}$")


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture: its name (the entry without the weight), its weight as written,
    and the dataset and path as ``training.dataset`` / ``training.dataset_path`` take them."""

    name: str
    weight: float
    dataset: str
    path: str | None


def parse_mixture(entries: list[str]) -> list[MixSource]:
    """The sources of ``training.dataset_mix``; ConfigError names the first bad entry and the fix."""
    sources: list[MixSource] = []
    for entry in entries:
        source = _parse_entry(entry)
        if any(s.name == source.name for s in sources):
            raise ConfigError(
                f"training.dataset_mix names {source.name!r} twice; give it one entry with the summed weight"
            )
        sources.append(source)
    return sources


def mixture_problems(entries: list[str]) -> list[str]:
    """The config check's message for ``training.dataset_mix`` (none when it parses)."""
    try:
        parse_mixture(entries)
    except ConfigError as e:
        return [str(e)]
    return []


def _parse_entry(entry: str) -> MixSource:
    words = entry.split(maxsplit=2)
    where = f"training.dataset_mix entry {entry!r}"
    if len(words) < 2:
        raise ConfigError(f"{where} has no dataset; {SYNTAX}")
    weight_word, dataset = words[:2]
    path = words[2] if len(words) == 3 else None
    try:
        weight = float(weight_word)
    except ValueError:
        raise ConfigError(f"{where}: the weight {weight_word!r} is not a number; {SYNTAX}") from None
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(
            f"{where}: the weight must be a positive number, got {weight_word}; drop the entry to leave the source out"
        )
    if dataset == BUNDLED_DATASET and path is not None:
        raise ConfigError(
            f"{where}: the bundled corpus {BUNDLED_DATASET!r} takes no path; for files write "
            f"'{weight_word} json {path}' (or text, parquet, auto)"
        )
    if dataset in LOCAL_FORMATS and path is None:
        raise ConfigError(f"{where}: {dataset!r} reads local files: add the path (a file, a glob or a directory)")
    if dataset != BUNDLED_DATASET and dataset not in LOCAL_FORMATS:
        _check_hub_name(where, weight_word, dataset, path)
    return MixSource(name=dataset if path is None else f"{dataset}:{path}", weight=weight, dataset=dataset, path=path)


def _check_hub_name(where: str, weight_word: str, dataset: str, path: str | None) -> None:
    """A dataset word that is no bundled or local format is a hub dataset id; refuse one that
    cannot be (a file path, a misspelt format or corpus name)."""
    rest = f" {path}" if path else ""
    if local_format(Path(dataset)) is not None or Path(dataset).expanduser().exists():
        fmt = local_format(Path(dataset)) or "auto"
        raise ConfigError(
            f"{where}: unknown source {dataset!r}; a local file comes after its format: "
            f"'{weight_word} {fmt} {dataset}{rest}'"
        )
    close = difflib.get_close_matches(dataset, [BUNDLED_DATASET, *LOCAL_FORMATS], n=1, cutoff=0.75)
    if close or not HUB_ID.match(dataset) or "--" in dataset or ".." in dataset:
        hint = f"did you mean '{weight_word} {close[0]}{rest}'? " if close else ""
        raise ConfigError(
            f"{where}: unknown source {dataset!r}; {hint}a source is {BUNDLED_DATASET!r} (the bundled corpus), "
            f"{'/'.join(LOCAL_FORMATS)} with a path, or a Hugging Face Hub dataset id (namespace/name)"
        )
