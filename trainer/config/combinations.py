"""Checks across sections: options that another option makes meaningless.

Audit rule: an option the run would silently ignore is refused when it names data the user wants
used (a dataset path the chosen dataset does not read), and warned about when it only tunes a
feature whose switch was left off (a value other than its default under a switch at its default).
Torch-free, so the pre-launch check runs the same rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.config.fields import cli_repr, default_of
from trainer.config.pipeline_layout import PipelinePlan
from trainer.config.replica_groups import replica_group_problems
from trainer.config.schedules import PP_SCHEDULES, SCHEDULES

LOCAL_FORMATS = ("json", "text", "parquet", "auto")
BUNDLED_DATASET = "shakespeare"


def combination_problems(cfg: Any) -> list[str]:
    """Combinations that cannot mean what the user asked: one message each."""
    t, v = cfg.training, cfg.validation
    problems = []
    if t.dataset == BUNDLED_DATASET and t.dataset_path:
        problems.append(
            f"training.dataset_path = {t.dataset_path!r} is ignored by training.dataset = {BUNDLED_DATASET!r} "
            f"(the bundled corpus); to train on that path add --training.dataset json (or text, parquet, auto; "
            f"a hub dataset name takes its config there), or drop --training.dataset_path."
        )
    if t.dataset in LOCAL_FORMATS and not t.dataset_path:
        problems.append(
            f"training.dataset = {t.dataset!r} reads local files: set --training.dataset_path "
            f"(a file, a glob or a directory)."
        )
    if v.enable and v.dataset is None and v.dataset_path and (t.dataset == BUNDLED_DATASET or t.dataset_mix):
        training_data = (
            "each source of training.dataset_mix" if t.dataset_mix else f"the training dataset {BUNDLED_DATASET!r}"
        )
        problems.append(
            f"validation.dataset_path = {v.dataset_path!r} is ignored: validation uses {training_data}; "
            "add --validation.dataset json (or text, parquet, auto), or drop --validation.dataset_path."
        )
    if v.enable and v.dataset == BUNDLED_DATASET and v.dataset_path:
        problems.append(
            f"validation.dataset_path = {v.dataset_path!r} is ignored by validation.dataset = {BUNDLED_DATASET!r}; "
            "add --validation.dataset json (or text, parquet, auto), or drop --validation.dataset_path."
        )
    if v.enable and v.dataset in LOCAL_FORMATS and not v.dataset_path:
        problems.append(
            f"validation.dataset = {v.dataset!r} reads local files: set --validation.dataset_path "
            "(a file, a glob or a directory)."
        )
    if cfg.optimizer.qk_clip and cfg.model.attn_backend != "sdpa":
        problems.append(
            "optimizer.qk_clip records the attention logits with model.attn_backend = 'sdpa' only; "
            "add --model.attn_backend sdpa or drop --optimizer.qk_clip."
        )
    # An unknown schedule (choice_problems names it) has no record: checked as no pipeline.
    known = cfg.parallelism.pp_schedule in PP_SCHEDULES
    plan = PipelinePlan.from_config(cfg.parallelism) if known else PipelinePlan()
    if plan.enabled and t.compile and not plan.facts.compile:
        # docs/compile.md, "Zero-bubble schedules": measured wrong or failing, and no faster.
        problems.append(
            f"parallelism.pp_schedule = {plan.pp_schedule!r} splits each backward into input and weight passes, and a "
            "compiled block is one autograd node whose whole backward the weight pass would run again (inductor "
            "refuses it); use --parallelism.pp_schedule Interleaved1F1B (or 1F1B) with --training.compile, or "
            "drop --training.compile."
        )
    if cfg.parallelism.tp > 1 and t.compile:
        # Measured (docs/compile.md): after minutes of compiling, the first backward fails inside DTensor's
        # redistribute (a plain tensor where it expects a DTensor's gradient), torch 2.13, CPU.
        problems.append(
            f"parallelism.tp = {cfg.parallelism.tp} with training.compile: the compiled blocks' backward fails inside "
            "DTensor's redistribute ('Tensor' object has no attribute '_local_tensor') after minutes of compiling; "
            "drop --training.compile, or shard over FSDP / EP instead of TP (parallelism.tp 1)."
        )
    if cfg.job.dry_run and cfg.optimizer.name == "muon" and cfg.dry_run.world_size > 1:
        # trainer/optim/muon_owners.py: OwnedExchange's plan gathers the other ranks' shard layouts.
        problems.append(
            f"job.dry_run cannot rehearse optimizer.name = 'muon' at dry_run.world_size = {cfg.dry_run.world_size}: "
            "Muon's owner plan asks the other ranks where their shards sit, which the fake process group cannot "
            "answer; rehearse with --optimizer.name adamw (the layout, activations and collectives are the same) or "
            "--dry_run.world_size 1."
        )
    problems += _moe_overlap_problems(cfg)
    problems += replica_group_problems(cfg)
    return problems


def _moe_overlap_problems(cfg: Any) -> list[str]:
    """What ``parallelism.moe_overlap`` (trainer/parallel/moe_overlap.py, with pipelining
    pipeline_overlap.py) does not run: it calls each MoE block's phases node by node, outside a
    checkpointed or compiled block."""
    p = cfg.parallelism
    if not p.moe_overlap:
        return []
    overlapping = [s.name for s in SCHEDULES if s.moe_overlap]
    refusals = [
        (p.ep <= 1, "overlaps the expert-parallel all-to-all: set --parallelism.ep > 1"),
        (
            p.pp > 1 and p.pp_schedule not in overlapping,
            f"with pp needs pp_schedule {' or '.join(overlapping)} (whose OVERLAP_F_B actions it interleaves): add "
            f"--parallelism.pp_schedule {overlapping[0]} or use --parallelism.pp 1",
        ),
        (
            cfg.activation_checkpoint.mode != "none",
            "keeps two micro-batches' activations and never recomputes a block: use --activation_checkpoint.mode none",
        ),
        (cfg.training.compile, "runs each MoE block eagerly node by node: drop --training.compile"),
        (cfg.engram.enable, "does not run Engram blocks: drop --engram.enable"),
        (p.tp > 1 or p.cp > 1 or p.ep_as_cp, "is tested with FSDP and EP only: use --parallelism.tp 1 --parallelism.cp 1"),
    ]
    return [f"parallelism.moe_overlap {message}, or drop --parallelism.moe_overlap." for bad, message in refusals if bad]


# (switch, is the feature off?, the section's options it makes meaningless; None = all others).
# Only a switch left at its default warns: the user configured a feature and forgot to turn it on,
# whereas one turned off on purpose (e.g. --no-validation.enable over a TOML) keeps its settings quietly.
_GATES = (
    ("engram.enable", lambda c: not c.engram.enable, None),
    ("fault_tolerance.enable", lambda c: not c.fault_tolerance.enable, None),
    (
        "checkpoint.enable", lambda c: not c.checkpoint.enable,
        ("folder", "interval", "keep_latest_k", "async_mode", "last_save_model_only"),
    ),
    (
        "checkpoint.last_save_model_only",
        lambda c: c.checkpoint.enable and not c.checkpoint.last_save_model_only, ("export_dtype",),
    ),
    ("checkpoint.initial_load_path", lambda c: not c.checkpoint.initial_load_path, ("initial_load_format",)),
    ("metrics.enable_wandb", lambda c: not c.metrics.enable_wandb, ("wandb_project", "wandb_mode")),
    (
        "profiling.enable_profiling", lambda c: not c.profiling.enable_profiling,
        ("profile_start_step", "profile_steps", "traces_folder", "profile_memory"),
    ),
    ("quantize.float8", lambda c: not c.quantize.float8, ("recipe", "filter_fqns", "emulate")),
    ("activation_checkpoint.mode", lambda c: c.activation_checkpoint.mode != "selective", ("selective_every",)),
    ("activation_checkpoint.mode", lambda c: c.activation_checkpoint.mode != "modules", ("recompute_modules",)),
    (
        "optimizer.name", lambda c: c.optimizer.name != "muon",
        ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_dtype"),
    ),
    ("optimizer.qk_clip", lambda c: not c.optimizer.qk_clip, ("qk_clip_threshold", "qk_clip_every")),
    ("ema.enable", lambda c: not c.ema.enable, None),
    (
        "parallelism.pp", lambda c: c.parallelism.pp == 1,
        tuple(f.name for f in dataclasses.fields(PipelinePlan) if f.name != "pp"),
    ),
)


def _value_and_default(cfg: Any, dotted: str) -> tuple[Any, Any]:
    section, _, key = dotted.partition(".")
    table = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(table)}
    return getattr(table, key), default_of(fields[key])


def combination_warnings(cfg: Any) -> list[str]:
    """Options set to a value the run will not use, and settings that are legal but suspicious."""
    warnings = []
    for switch, is_off, keys in _GATES:
        value, default = _value_and_default(cfg, switch)
        if not is_off(cfg) or value != default:
            continue
        section, _, switch_key = switch.partition(".")
        names = keys or [f.name for f in dataclasses.fields(getattr(cfg, section)) if f.name != switch_key]
        for key in names:
            set_to, key_default = _value_and_default(cfg, f"{section}.{key}")
            if set_to != key_default:
                warnings.append(f"{section}.{key} = {cli_repr(set_to)} is ignored: {switch} is {cli_repr(value)}.")
    t = cfg.training
    if cfg.lr_scheduler.warmup_steps > t.steps:
        warnings.append(
            f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is more than training.steps = {t.steps}: "
            "the learning rate never reaches optimizer.lr; lower --lr_scheduler.warmup_steps."
        )
    if cfg.ema.enable and cfg.ema.validate and not cfg.validation.enable:
        warnings.append("ema.validate = true is ignored: validation.enable is false.")
    if t.time_limit_minutes > 0 and not cfg.checkpoint.enable:
        warnings.append(
            "training.time_limit_minutes stops the run without saving it: checkpoint.enable is false; "
            "add --checkpoint.enable to resume it later."
        )
    return warnings
