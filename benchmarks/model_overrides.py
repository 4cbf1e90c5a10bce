"""`--model-override key=value` for the benchmarks: reshape a flavor without a new preset.

Keys are `DeepSeekV3ModelArgs` fields (`n_layers=4`, `dim=2048`) or `MoEArgs` fields, bare when
the name is unambiguous (`top_k=6`) or as `moe.<field>` (`moe.num_experts=64`). Values are
parsed as the field's type (int, float, bool as true/false, str, or `none` for optional
fields); the result is re-validated by the dataclasses' own checks.
"""

from __future__ import annotations

import dataclasses
import typing

from models.deepseek_v3 import DeepSeekV3ModelArgs
from models.moe import MoEArgs

_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _fields(cls) -> dict[str, object]:
    """Field name -> resolved type annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse(key: str, text: str, field_type) -> object:
    options = typing.get_args(field_type) or (field_type,)
    if text.lower() == "none" and type(None) in options:
        return None
    for option in options:
        if option is bool:
            if text.lower() in _BOOLS:
                return _BOOLS[text.lower()]
        elif option in (int, float, str):
            try:
                return option(text)
            except ValueError:
                continue
    raise ValueError(f"--model-override {key}={text}: cannot parse {text!r} as {field_type}")


def apply_model_overrides(args: DeepSeekV3ModelArgs, overrides: list[str]) -> DeepSeekV3ModelArgs:
    """`args` with each `key=value` of `overrides` applied (a new object)."""
    model_fields, moe_fields = _fields(DeepSeekV3ModelArgs), _fields(MoEArgs)
    model_changes, moe_changes = {}, {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--model-override {item!r}: expected key=value, e.g. n_layers=4")
        name = key.removeprefix("moe.")
        if key.startswith("moe.") or (name not in model_fields and name in moe_fields):
            if name not in moe_fields:
                raise ValueError(f"--model-override {key}: MoEArgs has no field {name!r}; fields: {sorted(moe_fields)}")
            moe_changes[name] = _parse(key, text, moe_fields[name])
        elif name in model_fields and name not in ("moe", "engram"):
            model_changes[name] = _parse(key, text, model_fields[name])
        else:
            raise ValueError(
                f"--model-override {key}: not a DeepSeekV3ModelArgs or MoEArgs field; "
                f"model fields: {sorted(set(model_fields) - {'moe', 'engram'})}; MoE fields: {sorted(moe_fields)}"
            )
    moe = dataclasses.replace(args.moe, **moe_changes) if moe_changes else args.moe
    return dataclasses.replace(args, moe=moe, **model_changes)
