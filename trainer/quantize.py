"""float8 training via torchao: a model converter applied before any parallelism.

House order (`docs/architecture.md`, like torchtitan's model converters): the
meta-device model is converted first, then TP -> EP -> CP -> AC -> compile -> FSDP2 wrap the
converted modules. Two conversions, both from ``[quantize]``:

* ``float8``: every ``nn.Linear`` whose name matches none of ``filter_fqns`` (default: the
  router gate and the output head, which are precision-sensitive and small) becomes torchao's
  ``Float8Linear`` (dynamic scaling, recipe ``tensorwise`` / ``rowwise`` / ``rowwise_with_gw_hp``).
  Layers whose dimensions are not multiples of 16 are left alone (``torch._scaled_mm`` needs
  them aligned).
* ``float8_experts``: the routed experts' stacked weights are wrapped in torchao's MoE
  training tensor, which turns their ``torch._grouped_mm`` into a rowwise-scaled float8 grouped
  GEMM (torchao prototype, CUDA SM90+ only: there is no CPU kernel, emulated or not).

Real float8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell).
``emulate = true`` runs the same casts with high-precision matmuls: numerically float8, no
speed-up, usable on CPU (that is what the CPU tests run).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from models.moe.experts import GroupedExperts
from trainer.config import ConfigError

logger = logging.getLogger("trainer")

# _scaled_mm needs both GEMM dims aligned to 16 bytes of float8.
_ALIGN = 16


class Float8Unavailable(ConfigError):
    """float8 was asked for where it cannot run; the message names the fix."""


def check_float8_support(qcfg, device_type: str, tp_enabled: bool = False) -> None:
    """Fails early, with the fix, when ``[quantize]`` cannot run on this device or layout."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise Float8Unavailable(
            "quantize.float8 needs torchao (pip install torchao); or set --no-quantize.float8"
        ) from None
    if tp_enabled:
        raise Float8Unavailable(
            "quantize.float8 with tensor parallelism is not supported yet (it needs torchao's float8 "
            "TP plans); use --parallelism.tp 1 or --no-quantize.float8"
        )
    if device_type == "cuda":
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9) and not qcfg.emulate:
            raise Float8Unavailable(
                f"quantize.float8 needs a GPU with float8 tensor cores (compute capability >= 8.9, e.g. "
                f"H100/L40S); this one is {cap[0]}.{cap[1]}. Use --no-quantize.float8 "
                "(or --quantize.emulate for a numerics check without speed-up)"
            )
        if qcfg.float8_experts and (cap < (9, 0) or qcfg.emulate):
            raise Float8Unavailable(
                f"quantize.float8_experts needs torchao's float8 grouped GEMM: CUDA compute capability >= 9.0 "
                f"and no emulation (got {cap[0]}.{cap[1]}, emulate={qcfg.emulate}); "
                "use --no-quantize.float8_experts"
            )
    else:
        if not qcfg.emulate:
            raise Float8Unavailable(
                f"quantize.float8 on {device_type}: real float8 matmuls need a CUDA GPU (compute capability "
                ">= 8.9). Use --quantize.emulate to check float8 numerics (no speed-up), or --no-quantize.float8"
            )
        if qcfg.float8_experts:
            raise Float8Unavailable(
                f"quantize.float8_experts runs torchao's float8 grouped GEMM, which exists only on CUDA "
                f"(SM90+), not on {device_type}; use --no-quantize.float8_experts"
            )


def _linear_filter(filter_fqns: list[str]):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # recurse into containers
        if any(f in fqn for f in filter_fqns):
            return False
        return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0

    return keep


def convert_to_float8(model: nn.Module, qcfg) -> dict[str, list[str]]:
    """Converts ``model`` in place per ``[quantize]`` (call on the meta-device model, before
    parallelisms). Returns the converted module names: ``{"linear": [...], "experts": [...]}``.

    The caller checks the device first (``check_float8_support``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(qcfg.recipe)
    if qcfg.emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, module_filter_fn=_linear_filter(list(qcfg.filter_fqns)), config=config)
    converted = {"linear": [n for n, m in model.named_modules() if isinstance(m, Float8Linear)], "experts": []}
    if qcfg.float8_experts:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        op_config = Float8TrainingOpConfig()
        experts = [n for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
        experts = [n for n in experts if not any(f in n for f in qcfg.filter_fqns)]
        chosen = set(experts)
        # quantize_ swaps the stacked w1/w2/w3 for torchao's wrapper tensor, whose _grouped_mm
        # quantizes rows and weights to float8 on the fly.
        quantize_(model, op_config, filter_fn=lambda m, fqn: fqn in chosen)
        converted["experts"] = experts
    skipped = [
        n for n, m in model.named_modules() if type(m) is nn.Linear
    ]
    logger.info(
        "float8 (%s%s): %d Linear layers converted, %d kept in high precision (%s or not 16-aligned); "
        "%d routed-expert modules in float8",
        qcfg.recipe, ", emulated" if qcfg.emulate else "", len(converted["linear"]), len(skipped),
        ", ".join(qcfg.filter_fqns) or "no filter", len(converted["experts"]),
    )
    return converted
