"""What a run's log says about the run as it starts (rank 0's train.log, and the console): the
resolved config, the code and library versions, the device and layout, the optional features
switched on, the model's size and FLOPs, the data, positions and precision. A user reading
train.log learns from these lines what this run was without reading the code or the config."""

from __future__ import annotations

import logging

from trainer.config.data_mix import parse_mixture
from trainer.config.pipeline_layout import PipelinePlan
from trainer.metrics import device_description
from trainer.runtime import git_revision, resolve_path, versions

logger = logging.getLogger("trainer")


def log_run_header(trainer) -> None:
    """The start-of-run lines of a built `trainer.trainer.Trainer` (and its `config.toml` in the
    run folder)."""
    cfg, t = trainer.cfg, trainer.cfg.training
    if cfg.job.print_config:
        logger.info("resolved config:\n%s", cfg.to_toml().rstrip())
    cfg.save_toml(trainer.run_dir / "config.toml")
    logger.info("git revision %s | %s", git_revision(), " ".join(f"{k} {v}" for k, v in versions().items()))
    logger.info("device %s | %s", device_description(trainer.device), trainer.parallel_dims.describe())
    logger.info("optional features: %s", ", ".join(active_features(cfg, trainer.parallel_dims.world_size)) or "none")
    logger.info(
        "model %s/%s: %.2fM params total, %.2fM active per token%s | %.3g training FLOPs/token "
        "(6 x active non-embedding params + attention, no causal halving)",
        cfg.model.name,
        cfg.model.flavor,
        trainer.n_params / 1e6,
        trainer.n_active / 1e6,
        f" (incl. MTP depth {trainer.model_args.mtp_depth})" if trainer.model_args.mtp_depth else "",
        trainer.flops_per_token,
    )
    logger.info(
        "tokenizer %s (vocab %d) | data %s | seq_len %d | global batch %d sequences = %d micro-batch(es) of %d",
        resolve_path(cfg.model.tokenizer_path),
        trainer.tokenizer.vocab_size,
        _data_description(t),
        t.seq_len,
        trainer.train_loader.global_batch_size,
        trainer.grad_accum_steps,
        t.local_batch_size,
    )
    if cfg.model.disable_yarn:
        logger.warning("positions: %s, YaRN off by model.disable_yarn", trainer.model_args.describe_positions())
    else:
        logger.info("positions: %s", trainer.model_args.describe_positions())
    logger.info(
        "precision: params fp32%s | %s | run folder %s",
        ", bf16 autocast" if trainer.autocast_dtype else ", no autocast",
        "compiled" if t.compile else "eager",
        trainer.run_dir.resolve(),
    )



def _data_description(t) -> str:
    """The training data: the dataset, or the mixture's sources with their weights."""
    if t.dataset_mix:
        return "mixture " + ", ".join(f"{s.name} x {s.weight:g}" for s in parse_mixture(t.dataset_mix))
    return t.dataset if not t.dataset_path else f"{t.dataset}:{t.dataset_path}"


def active_features(cfg, world_size: int) -> list[str]:
    """The switched-on options that change how a step runs, as the run's log lists them: a user
    reading train.log sees which of them this run had without reading the resolved config."""
    p, plan = cfg.parallelism, PipelinePlan.from_config(cfg.parallelism)
    features = [
        (p.moe_overlap, "moe_overlap (the MoE all-to-alls run under another micro-batch's compute)"),
        (p.ep_as_cp, "ep_as_cp (the sequence sharded over the expert ranks outside the MoE exchange)"),
        (plan.enabled and plan.zero_bubble,
         f"zero-bubble schedule {plan.pp_schedule} (each backward split into input and weight passes)"),
        (cfg.activation_checkpoint.mode != "none", f"activation checkpointing {cfg.activation_checkpoint.mode}"),
        (cfg.training.compile, "torch.compile"),
        (cfg.optimizer.name == "muon" and world_size > 1, "Muon owners (each matrix orthogonalised by one rank)"),
        (cfg.optimizer.name == "muon" and world_size == 1, "Muon"),
        (cfg.optimizer.qk_clip, "QK-clip"),
        (cfg.quantize.float8, "float8 matmuls" + (" (emulated)" if cfg.quantize.emulate else "")),
        (cfg.engram.enable, "Engram" + (" (optimizer state in CPU memory)" if cfg.engram.offload_optimizer_state else "")),
        (cfg.ema.enable, f"parameter EMA in CPU memory (decay {cfg.ema.decay}, every {cfg.ema.update_every} steps)"),
    ]
    return [name for on, name in features if on]
