"""Mixture-of-experts building blocks (single-device; parallelism swaps the dispatcher)."""

from models.moe.args import MoEArgs
from models.moe.balance import moe_modules, update_expert_bias
from models.moe.dispatcher import LocalTokenDispatcher, TokenDispatcher
from models.moe.experts import GroupedExperts
from models.moe.moe import MoE, Routing
from models.moe.router import TokenChoiceTopKRouter

__all__ = [
    "GroupedExperts",
    "LocalTokenDispatcher",
    "MoE",
    "MoEArgs",
    "Routing",
    "TokenChoiceTopKRouter",
    "TokenDispatcher",
    "moe_modules",
    "update_expert_bias",
]
