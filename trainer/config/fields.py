"""What a config field is: its declaration (`_field`), the `Section` base, and the type rules
shared by the TOML loader, the command line and `--help` (conversion, type names, choices,
did-you-mean). Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message names the key and the fix."""


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _failed(*checks: tuple[bool, str]) -> list[str]:
    return [message for ok, message in checks if not ok]


@dataclass
class Section:
    """Base of every TOML section. Types and choices are checked generically; a section with
    further constraints overrides problems() to return one message per violation."""

    def problems(self) -> list[str]:
        return []


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NONE_WORDS = ("none", "null")


def _sections(config_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def _options(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _split_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config field type {tp} is not supported: only X | None unions are")
        return args[0], True
    return tp, False


def _base_type(tp: Any) -> Any:
    return _split_optional(tp)[0]


def _type_name(tp: Any) -> str:
    base, optional = _split_optional(tp)
    if typing.get_origin(base) is list:
        name = f"list[{typing.get_args(base)[0].__name__}]"
    else:
        name = base.__name__
    return f"{name} or none" if optional else name


def _scalar_from_toml(value: Any, tp: type) -> Any:
    # bool is a subclass of int in Python but never a number in a config file.
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp not in (bool, int, float, str):
        raise TypeError(f"config field type {tp} is not supported")
    raise ValueError(value)


def _from_toml(value: Any, tp: Any) -> Any:
    base, optional = _split_optional(tp)
    # TOML itself never yields None, but to_dict() output does.
    if optional and value is None:
        return None
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            raise ValueError(value)
        (elem,) = typing.get_args(base)
        return [_scalar_from_toml(v, elem) for v in value]
    return _scalar_from_toml(value, base)


def _scalar_from_cli(raw: str, tp: type) -> Any:
    if tp is bool:
        if raw.lower() in TRUE_WORDS:
            return True
        if raw.lower() in FALSE_WORDS:
            return False
        raise ValueError(raw)
    if tp in (int, float):
        return tp(raw)
    if tp is str:
        return raw
    raise TypeError(f"config field type {tp} is not supported")


def _from_cli(raw: str, tp: Any) -> Any:
    base, optional = _split_optional(tp)
    if optional and raw.strip().lower() in NONE_WORDS:
        return None
    if typing.get_origin(base) is list:
        (elem,) = typing.get_args(base)
        return [_scalar_from_cli(item.strip(), elem) for item in raw.split(",")] if raw.strip() else []
    return _scalar_from_cli(raw, base)


def _did_you_mean(word: str, candidates: list[str], template: str) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {template.format(close[0])}?" if close else "."


def _choices_hint(f: dataclasses.Field) -> str:
    return f", one of {', '.join(f.metadata['choices'])}" if "choices" in f.metadata else ""


def _choice_problems(cfg: Any) -> list[str]:
    problems = []
    for section, section_cls in _sections(type(cfg)).items():
        for key, (f, _) in _options(section_cls).items():
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), key)
            if choices is None or value is None or value in choices:
                continue
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            problems.append(
                f"{section}.{key} = {value!r} is not allowed; choose one of {', '.join(choices)}{hint}"
            )
    return problems


def _cli_repr(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or '""'
    return str(value) if value != "" else '""'
# torchtitan's names of options this trainer spells otherwise; spelling distance alone would
# suggest the wrong key (expert_parallel_degree is closest to expert_parallel_comm_backend).
FOREIGN_NAMES = {
    "expert_parallel_degree": "parallelism.ep",
    "tensor_parallel_degree": "parallelism.tp",
    "context_parallel_degree": "parallelism.cp",
    "data_parallel_shard_degree": "parallelism.dp_shard",
    "data_parallel_replicate_degree": "parallelism.dp_replicate",
}


def _nearest_key(name: str, sections: dict[str, type]) -> str | None:
    """The valid `section.key` closest to `name`, which may lack or misspell its section."""
    foreign = FOREIGN_NAMES.get(name.rpartition(".")[2])
    if foreign is not None:
        return foreign
    full_keys = [f"{s}.{k}" for s, cls in sections.items() for k in _options(cls)]
    nearest = difflib.get_close_matches(name, full_keys, n=1, cutoff=0.6)
    if nearest:
        return nearest[0]
    by_key: dict[str, str] = {}
    for full in full_keys:
        by_key.setdefault(full.partition(".")[2], full)
    close = difflib.get_close_matches(name.rpartition(".")[2], list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


