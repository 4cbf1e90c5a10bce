"""Building a `JobConfig` from what the user typed: defaults, then the TOML file named by
`--job.config_file`/`--config` (`from_dict`), then the other command-line options
(CLI > TOML > defaults), `--help`, and the did-you-mean hints of unknown sections, keys and
options. Torch-free."""

from __future__ import annotations

import codecs
import difflib
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
    base_type,
    choices_hint,
    choices_of,
    cli_repr,
    default_of,
    from_cli,
    from_toml,
    options_of,
    sections_of,
    type_name,
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
    cfg = from_dict(_read_toml(config_file), config_file, config_cls) if config_file else config_cls()
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    cfg.validate()
    return cfg


def from_dict(data: dict[str, Any], source: str = "config", config_cls: type[JobConfig] = JobConfig) -> JobConfig:
    """Defaults overlaid with `data` ({section: {key: value}}, as TOML parses); not validated."""
    sections = sections_of(config_cls)
    cfg = config_cls()
    for section, table in data.items():
        if not isinstance(table, dict) and section not in sections:
            nearest = _nearest_key(section, sections)
            hint = f"; did you mean {nearest}?" if nearest else "."
            raise ConfigError(
                f"{source}: key '{section}' is outside any [section]{hint} "
                f"Valid sections: {', '.join(sections)}."
            )
        if section not in sections:
            raise ConfigError(
                f"{source}: unknown section [{section}]{_did_you_mean(section, list(sections), '[{}]')} "
                f"Valid sections: {', '.join(sections)}."
            )
        if not isinstance(table, dict):
            raise ConfigError(
                f"{source}: '{section}' must be a [{section}] table of key = value pairs, "
                f"got {type(table).__name__} {table!r}."
            )
        options = options_of(sections[section])
        target = getattr(cfg, section)
        for key, value in table.items():
            if key not in options:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}{_key_hint(section, key, options)} "
                    f"Valid keys in [{section}]: {', '.join(options)}."
                )
            _, tp = options[key]
            try:
                converted = from_toml(value, tp)
            except ValueError:
                raise ConfigError(
                    f"{source}: {section}.{key} must be {type_name(tp)}{choices_hint(tp)}, "
                    f"got {type(value).__name__} {value!r}."
                ) from None
            setattr(target, key, converted)
    return cfg


def format_help(config_cls: type[JobConfig] = JobConfig) -> str:
    lines = [
        "usage: python -m trainer.train [--config FILE.toml] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Precedence: command line > TOML file > defaults. Booleans: --x.y, --x.y=false, --no-x.y.",
        "Lists are comma-separated; options that accept none take none or null.",
    ]
    for section, section_cls in sections_of(config_cls).items():
        lines += ["", f"[{section}]"]
        for key, (f, tp) in options_of(section_cls).items():
            option = f"--{section}.{key}"
            if base_type(tp) is bool:
                option += f", --no-{section}.{key}"
            choices = choices_of(tp)
            kind = "{" + ",".join(choices) + "}" if choices else type_name(tp)
            lines.append(f"  {option}  {kind}  (default: {cli_repr(default_of(f))})")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _parse_cli(argv: list[str], config_cls: type[JobConfig]) -> list[tuple[str, str, Any]]:
    """Turn argv into converted (section, key, value) overrides, in command-line order."""
    sections = sections_of(config_cls)
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
        if section not in sections or key not in options_of(sections[section]):
            raise ConfigError(_unknown_option(token.partition("=")[0], name, sections))
        _, tp = options_of(sections[section])[key]
        option = f"--{section}.{key}"
        is_bool = base_type(tp) is bool
        if negated:
            if not is_bool:
                raise ConfigError(
                    f"--no-{name}: only boolean options can be negated; {option} is {type_name(tp)}, "
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
                f"{option} needs a value ({type_name(tp)}{choices_hint(tp)}) but none was given; "
                f"use {option} VALUE or {option}=VALUE."
            )
        else:
            raw = argv[i]
            i += 1
        try:
            value = from_cli(raw, tp)
        except ValueError:
            raise ConfigError(f"{option} must be {type_name(tp)}{choices_hint(tp)}, got {raw!r}.") from None
        overrides.append((section, key, value))
    return overrides


def _unknown_option(typed: str, name: str, sections: dict[str, type]) -> str:
    section, _, key = name.partition(".")
    hint = _removed_hint(name)
    if hint is None:
        nearest = _nearest_key(name, sections)
        hint = f"; did you mean --{nearest}?" if nearest else "."
    if section in sections:
        valid = f"Valid keys in [{section}]: {', '.join(options_of(sections[section]))}."
    else:
        valid = f"Valid sections: {', '.join(sections)}."
    return f"unknown option {typed}{hint} {valid} Run with --help to list every option."


# torchtitan's names of options this trainer spells otherwise; spelling distance alone would
# suggest the wrong key (expert_parallel_degree is closest to engram.embedding_parallel_degree).
FOREIGN_NAMES = {
    "expert_parallel_degree": "parallelism.ep",
    "tensor_parallel_degree": "parallelism.tp",
    "context_parallel_degree": "parallelism.cp",
    "data_parallel_shard_degree": "parallelism.dp_shard",
    "data_parallel_replicate_degree": "parallelism.dp_replicate",
}


def _did_you_mean(word: str, candidates: list[str], template: str) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {template.format(close[0])}?" if close else "."


# Options this trainer had and dropped: the hint says why instead of pointing at a near spelling.
REMOVED_OPTIONS = {
    "parallelism.expert_parallel_comm_backend": "the all-to-all exchange is the only expert-parallel one",
    "engram.mesh_name": "the Engram table's mesh is always named 'engram'",
}


def _removed_hint(name: str) -> str | None:
    reason = REMOVED_OPTIONS.get(name)
    return None if reason is None else f" was removed ({reason}); drop it."


def _key_hint(section: str, key: str, options: dict) -> str:
    removed = _removed_hint(f"{section}.{key}")
    if removed is not None:
        return removed
    foreign = FOREIGN_NAMES.get(key)
    if foreign is not None:
        return f"; did you mean {foreign}?"
    return _did_you_mean(key, list(options), section + ".{}")


def _nearest_key(name: str, sections: dict[str, type]) -> str | None:
    """The valid `section.key` closest to `name`, which may lack or misspell its section."""
    foreign = FOREIGN_NAMES.get(name.rpartition(".")[2])
    if foreign is not None:
        return foreign
    full_keys = [f"{s}.{k}" for s, cls in sections.items() for k in options_of(cls)]
    nearest = difflib.get_close_matches(name, full_keys, n=1, cutoff=0.6)
    if nearest:
        return nearest[0]
    by_key: dict[str, str] = {}
    for full in full_keys:
        by_key.setdefault(full.partition(".")[2], full)
    close = difflib.get_close_matches(name.rpartition(".")[2], list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


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
