"""Building a `JobConfig` from what the user typed: defaults, then the TOML file named by
`--job.config_file`/`--config`, then the other command-line options (CLI > TOML > defaults),
`--help`, and the did-you-mean hints of unknown options. Torch-free."""

from __future__ import annotations

import codecs
import sys
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from trainer.config.fields import (
    FALSE_WORDS,
    TRUE_WORDS,
    ConfigError,
    _base_type,
    _choices_hint,
    _cli_repr,
    _default,
    _from_cli,
    _nearest_key,
    _options,
    _sections,
    _type_name,
)
from trainer.config.schema import JobConfig


def load_config(argv: list[str] | None = None, config_cls: type[JobConfig] = JobConfig) -> JobConfig:
    """Defaults, then the TOML named by --job.config_file/--config, then the other CLI options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(config_cls))
        raise SystemExit(0)
    overrides = _parse_cli(argv, config_cls)
    config_file = None
    for section, key, value in overrides:
        if (section, key) == ("job", "config_file"):
            config_file = value
    cfg = config_cls.from_dict(_read_toml(config_file), source=config_file) if config_file else config_cls()
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    cfg.validate()
    return cfg


def format_help(config_cls: type[JobConfig] = JobConfig) -> str:
    lines = [
        "usage: python -m trainer.train [--config FILE.toml] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Precedence: command line > TOML file > defaults. Booleans: --x.y, --x.y=false, --no-x.y.",
        "Lists are comma-separated; options that accept none take none or null.",
    ]
    for section, section_cls in _sections(config_cls).items():
        lines += ["", f"[{section}]"]
        for key, (f, tp) in _options(section_cls).items():
            option = f"--{section}.{key}"
            if _base_type(tp) is bool:
                option += f", --no-{section}.{key}"
            kind = "{" + ",".join(f.metadata["choices"]) + "}" if "choices" in f.metadata else _type_name(tp)
            lines.append(f"  {option}  {kind}  (default: {_cli_repr(_default(f))})")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)



def _parse_cli(argv: list[str], config_cls: type[JobConfig]) -> list[tuple[str, str, Any]]:
    """Turn argv into converted (section, key, value) overrides, in command-line order."""
    sections = _sections(config_cls)
    overrides = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ConfigError(
                f"unexpected argument {token!r}: options look like --section.key VALUE (see --help)."
            )
        name, has_inline, inline = token[2:].partition("=")
        negated = name.startswith("no-")
        if negated:
            name = name[3:]
        if name == "config":
            name = "job.config_file"
        section, _, key = name.partition(".")
        if section not in sections or key not in _options(sections[section]):
            raise ConfigError(_unknown_option(token.partition("=")[0], name, sections))
        f, tp = _options(sections[section])[key]
        option = f"--{section}.{key}"
        is_bool = _base_type(tp) is bool
        if negated:
            if not is_bool:
                raise ConfigError(
                    f"--no-{name}: only boolean options can be negated; {option} is {_type_name(tp)}, "
                    f"pass {option} VALUE instead."
                )
            if has_inline:
                raise ConfigError(f"--no-{name} takes no value; use {option}={inline} or --no-{name} alone.")
            overrides.append((section, key, False))
            continue
        if has_inline:
            raw = inline
        elif is_bool:
            # A bare flag means true; a following boolean word is taken as its value.
            if i < len(argv) and argv[i].lower() in TRUE_WORDS + FALSE_WORDS:
                raw = argv[i]
                i += 1
            else:
                raw = "true"
        elif i >= len(argv) or argv[i].startswith("--"):
            raise ConfigError(
                f"{option} needs a value ({_type_name(tp)}{_choices_hint(f)}) but none was given; "
                f"use {option} VALUE or {option}=VALUE."
            )
        else:
            raw = argv[i]
            i += 1
        try:
            value = _from_cli(raw, tp)
        except ValueError:
            raise ConfigError(f"{option} must be {_type_name(tp)}{_choices_hint(f)}, got {raw!r}.") from None
        overrides.append((section, key, value))
    return overrides



def _unknown_option(typed: str, name: str, sections: dict[str, type]) -> str:
    nearest = _nearest_key(name, sections)
    hint = f"; did you mean --{nearest}?" if nearest else "."
    section, _, key = name.partition(".")
    if section in sections:
        valid = f"Valid keys in [{section}]: {', '.join(_options(sections[section]))}."
    else:
        valid = f"Valid sections: {', '.join(sections)}."
    return f"unknown option {typed}{hint} {valid} Run with --help to list every option."



def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (given by --job.config_file/--config).") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}.") from None
    # TOML is UTF-8 without a byte-order mark; tomllib would call a BOM an "invalid statement".
    if raw.startswith(codecs.BOM_UTF8):
        raise ConfigError(
            f"config file {path} starts with a UTF-8 byte-order mark, which TOML does not allow; save it as "
            "UTF-8 without BOM (e.g. \"UTF-8\", not \"UTF-8 with BOM\", in your editor)."
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {raw[e.start]:#04x} on line {line}); TOML files are "
            "UTF-8: convert it (e.g. iconv -f latin1 -t utf-8) or retype that character."
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # The decoder's message carries "(at line L, column C)".
        raise ConfigError(f"TOML syntax error in {path}: {e}") from None
