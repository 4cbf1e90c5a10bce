"""The ``[activation_checkpoint]`` section and its vocabulary of block parts (torch-free, as the
whole config package): which modes exist, the parts ``modules`` mode can recompute by Megatron-LM's
names, and the named sets of them. trainer/parallel/activation_checkpoint.py applies them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config.fields import Section, failed_checks, option

ACMode = Literal["none", "full", "selective", "op", "modules"]
# `activation_checkpoint.mode modules`: the parts of a block recomputed in backward, by the names
# Megatron-LM's `recompute_modules` uses (trainer/parallel/activation_checkpoint.py defines each).
RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "core_attn", "moe_act", "mlp", "shared_experts", "moe")
# Named sets: DeepSeek-V3's own (technical report, section 3.2.3: every RMSNorm, MLA's
# up-projections and the MoE SwiGLU output) and NVIDIA's production recipe for it in Megatron.
RECOMPUTE_SETS = {"deepseek": ("layernorm", "mla_up_proj", "moe_act"), "megatron_dsv3": ("mla_up_proj", "mlp")}
# The parts made of cheap elementwise ops: `op` recomputes them (it keeps only matmul, attention and
# all-to-all outputs), `modules` keeps them unless chosen.
CHEAP_PARTS = ("layernorm", "moe_act")


def recompute_module_set(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`recompute_modules` with the named sets expanded, in RECOMPUTE_MODULES order."""
    chosen = {part for name in names for part in RECOMPUTE_SETS.get(name, (name,))}
    return tuple(part for part in RECOMPUTE_MODULES if part in chosen)


@dataclass
class ActivationCheckpoint(Section):
    mode: ACMode = option(
        "none",
        "Activation checkpointing: none, full (every block), selective (every N-th block), op (per-op: keep "
        "matmul/attention/all-to-all outputs), modules (recompute the parts named by recompute_modules)",
    )
    selective_every: int = option(2, "In selective mode, checkpoint every N-th block")
    recompute_modules: list[str] = option(
        ["deepseek"],
        "In modules mode, the block parts recomputed, by Megatron-LM's recompute_modules names so its users "
        f"need no new words: {', '.join(RECOMPUTE_MODULES)}, or a set: "
        + "; ".join(f"{k} = {','.join(v)}" for k, v in RECOMPUTE_SETS.items()),
    )

    def problems(self) -> list[str]:
        valid = (*RECOMPUTE_MODULES, *RECOMPUTE_SETS)
        unknown = [name for name in self.recompute_modules if name not in valid]
        return failed_checks(
            (
                self.selective_every >= 1,
                f"activation_checkpoint.selective_every must be >= 1, got {self.selective_every}.",
            ),
            (
                not unknown,
                f"activation_checkpoint.recompute_modules: unknown {', '.join(map(repr, unknown))}; valid: "
                f"{', '.join(valid)}.",
            ),
            (
                bool(self.recompute_modules) or self.mode != "modules",
                "activation_checkpoint.recompute_modules is empty in modules mode: name at least one of "
                f"{', '.join(valid)}, or use --activation_checkpoint.mode none.",
            ),
        )
