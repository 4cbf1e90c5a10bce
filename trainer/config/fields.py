"""What a config field is: its declaration (`option`), the `Section` base, and the type rules
shared by the TOML loader, the command line and `--help` (conversion, type names, choices).
A field with a fixed set of values is typed `Literal[...]`: the type is the one list of its
choices, read by the check, the error messages and `--help`. Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message names the key and the fix."""


def option(default: Any, help: str) -> Any:
    """A section field: its default and the one-line doc that is also its `--help` text."""
    metadata = {"help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def failed_checks(*checks: tuple[bool, str]) -> list[str]:
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


def sections_of(config_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def options_of(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _split_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config field type {tp} is not supported: only X | None unions are")
        return args[0], True
    return tp, False


def base_type(tp: Any) -> Any:
    return _split_optional(tp)[0]


def _scalar_type(tp: Any) -> Any:
    # A choice converts as the type of its values; choice_problems then names a value not listed.
    if typing.get_origin(tp) is typing.Literal:
        value_types = {type(v) for v in typing.get_args(tp)}
        if len(value_types) != 1:
            raise TypeError(f"config field type {tp} is not supported: choices must share one type")
        return value_types.pop()
    return tp


def type_name(tp: Any) -> str:
    base, optional = _split_optional(tp)
    if typing.get_origin(base) is list:
        name = f"list[{typing.get_args(base)[0].__name__}]"
    else:
        name = _scalar_type(base).__name__
    return f"{name} or none" if optional else name


def _scalar_from_toml(value: Any, tp: Any) -> Any:
    tp = _scalar_type(tp)
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


def from_toml(value: Any, tp: Any) -> Any:
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


def _scalar_from_cli(raw: str, tp: Any) -> Any:
    tp = _scalar_type(tp)
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


def from_cli(raw: str, tp: Any) -> Any:
    base, optional = _split_optional(tp)
    if optional and raw.strip().lower() in NONE_WORDS:
        return None
    if typing.get_origin(base) is list:
        (elem,) = typing.get_args(base)
        return [_scalar_from_cli(item.strip(), elem) for item in raw.split(",")] if raw.strip() else []
    return _scalar_from_cli(raw, base)


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The allowed values of a `Literal[...]` field type (also under `| None`), else None."""
    base = base_type(tp)
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def choices_hint(tp: Any) -> str:
    choices = choices_of(tp)
    return f", one of {', '.join(choices)}" if choices else ""


def choice_problems(cfg: Any) -> list[str]:
    problems = []
    for section, section_cls in sections_of(type(cfg)).items():
        for key, (_, tp) in options_of(section_cls).items():
            choices = choices_of(tp)
            value = getattr(getattr(cfg, section), key)
            if choices is None or value is None or value in choices:
                continue
            problems.append(choice_message(f"{section}.{key}", value, choices))
    return problems


def choice_message(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """The one line refusing ``value`` of ``key`` (``section.key``), naming its choices."""
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"{key} = {value!r} is not allowed; choose one of {', '.join(choices)}{hint}"


def cli_repr(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or '""'
    return str(value) if value != "" else '""'
