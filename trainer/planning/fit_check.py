"""The memory-fit check before a build: the estimate of a run's config (trainer/planning/memory.py)
against what its device can still take, refused in one line that names the largest term and what
can help (the Trainer before its build, the dry run for each rehearsed rank)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from models.deepseek_v3 import DeepSeekV3ModelArgs
from trainer.config import ConfigError
from trainer.planning.memory import GiB, estimate


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """Memory a run on ``device`` can still take, and the device's name: free CUDA memory
    (``torch.cuda.mem_get_info``) plus the blocks torch's caching allocator holds unused, or on
    CPU the host's MemAvailable shared by the processes of this host (``LOCAL_WORLD_SIZE``).
    None where the host does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"{torch.cuda.get_device_name(device)} ({device})"
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    where = "this host's CPU memory" + (f" shared by {procs} processes" if procs > 1 else "")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // procs, where
    except OSError:
        pass
    return None, where


def check_fits(cfg, model_args: DeepSeekV3ModelArgs, dims, device: torch.device, available: int | None = None) -> dict:
    """Refuses (ConfigError) a run whose estimated peak exceeds the memory available, before the
    model is built; every activation-checkpointing mode estimated as it runs. Returns the estimate."""
    t = cfg.training
    where = str(device)
    if available is None:
        available, where = available_bytes(device)
    ac = cfg.activation_checkpoint.mode
    est = estimate(
        cfg.model.flavor, dims.dp_shard, dims.ep, dims.tp, dims.cp, t.seq_len, t.local_batch_size, ac,
        mixed_precision=t.mixed_precision_param, model_args=model_args, device_type=device.type,
        block_causal_sdpa=cfg.model.attn_mask_type == "block_causal" and cfg.model.attn_backend == "sdpa",
        pipeline=dims.pipeline, optimizer=cfg.optimizer.name, state_dtype=cfg.optimizer.state_dtype,
        ep_as_cp=dims.ep_as_cp, recompute_modules=tuple(cfg.activation_checkpoint.recompute_modules),
        selective_every=cfg.activation_checkpoint.selective_every,
    )
    need = est["gib"]["total"]
    if available is not None and need * GiB > available:
        g = est["gib"]
        biggest = max(("layers", "logits_and_loss", "attention_mask", "params", "optimizer", "grads",
                       "stage_unsharded_params", "stage_grad_accumulators"), key=g.get)
        fixes = ["lower training.seq_len or training.local_batch_size"]
        if ac != "full":
            fixes.append("use activation_checkpoint.mode full")  # every other mode keeps more than full
        elif dims.pipeline.enabled and dims.pipeline.zero_bubble:
            # The weight pass keeps its recomputes (module docstring): full AC is no cure there.
            fixes.append(
                f"use parallelism.pp_schedule Interleaved1F1B or 1F1B (under {dims.pipeline.pp_schedule} full AC "
                "keeps the weight pass's recomputed activations, docs/performance.md)"
            )
            if dims.pipeline.pp_schedule == "DualPipeV":
                # Late in the step its ranks keep weight passes waiting (`weight_pass_drain`).
                fixes.append("lower parallelism.pp_max_deferred_weight_passes (e.g. 8: docs/parallelism.md)")
        raise ConfigError(
            f"the run does not fit: estimated {need:.1f} GiB per device > available {available / GiB:.1f} GiB on "
            f"{where} (seq_len {t.seq_len}, local_batch_size {t.local_batch_size}, activation_checkpoint "
            f"{cfg.activation_checkpoint.mode}; largest term {biggest} {g[biggest]:.1f} GiB, trainer/planning/memory.py); "
            f"{', '.join(fixes)}, or shard over more devices"
        )
    return est
