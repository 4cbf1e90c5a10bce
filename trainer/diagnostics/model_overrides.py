"""``--model-override key=value`` for the benchmarks: change a flavor's DeepSeekV3ModelArgs.

Keys are the dataclass fields (``n_layers=4``, ``dim=2048``) or, one level down, the fields of
its nested ``moe`` / ``engram`` args (``moe.num_experts=16``). Values are parsed by the type of
the field's current value; a field whose value is None takes a Python literal. So a
V2-Lite-shaped (16B) or V3-width model with a few layers fits one GPU at its real widths:

    python benchmarks/step_bench.py --flavor 16B --model-override n_layers=4
"""

from __future__ import annotations

import ast
import dataclasses

from models.deepseek_v3 import DeepSeekV3ModelArgs

NESTED = ("moe", "engram")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ModelOverrideError(ValueError):
    """A --model-override that names no field or whose value does not parse."""


def _parse_value(key: str, raw: str, current):
    try:
        if isinstance(current, bool):
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(f"expected true/false, got {raw!r}")
            return raw.lower() in _TRUE
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, str):
            return raw
        if isinstance(current, tuple):
            value = ast.literal_eval(raw)
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError) as e:
        raise ModelOverrideError(f"--model-override {key}={raw}: {e}") from None


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    """``["n_layers=4", "moe.top_k=2"]`` -> [(key, raw value)], rejecting items without '='."""
    pairs = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ModelOverrideError(f"--model-override {item!r}: expected key=value, e.g. n_layers=4")
        pairs.append((key.strip(), raw.strip()))
    return pairs


def apply_overrides(args: DeepSeekV3ModelArgs, items: list[str]) -> DeepSeekV3ModelArgs:
    """A copy of ``args`` with every ``key=value`` of ``items`` applied (validated by the dataclasses)."""
    top: dict = {}
    nested: dict[str, dict] = {name: {} for name in NESTED}
    for key, raw in parse_overrides(items):
        head, dot, sub = key.partition(".")
        if dot:
            if head not in NESTED:
                raise ModelOverrideError(
                    f"--model-override {key}: only {', '.join(n + '.*' for n in NESTED)} keys have a dot"
                )
            inner = getattr(args, head)
            if inner is None:
                raise ModelOverrideError(f"--model-override {key}: this model has no {head} (its {head} args are None)")
            if sub not in _field_names(inner):
                raise ModelOverrideError(
                    f"--model-override {key}: unknown key; {head}.* keys are: {', '.join(_field_names(inner))}"
                )
            nested[head][sub] = _parse_value(key, raw, getattr(inner, sub))
        else:
            if key not in _field_names(args) or key in NESTED:
                raise ModelOverrideError(
                    f"--model-override {key}: unknown key; model keys are: "
                    f"{', '.join(n for n in _field_names(args) if n not in NESTED)} (and moe.*, engram.*)"
                )
            top[key] = _parse_value(key, raw, getattr(args, key))
    try:
        for head, changes in nested.items():
            if changes:
                top[head] = dataclasses.replace(getattr(args, head), **changes)
        return dataclasses.replace(args, **top)
    except (ValueError, TypeError) as e:
        raise ModelOverrideError(f"--model-override {' '.join(items)}: {e}") from None
