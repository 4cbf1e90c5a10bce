"""The training entry point: ``python -m trainer.train --job.config_file X.toml [--section.key value ...]``.

``Trainer`` owns the pieces of one run (model, optimizer, schedule, data, metrics) and
``main`` turns user mistakes into one clear message instead of a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from models.deepseek_v3 import (
    DeepSeekV3Model,
    DeepSeekV3ModelArgs,
    count_params,
    flavor_names,
    flops_per_token,
    get_flavor,
    mtp_loss,
)
from trainer.config import ConfigError, JobConfig, load_config
from trainer.data import build_dataloader, build_tokenizer
from trainer.loss import IGNORE_INDEX, count_valid, cross_entropy_sum
from trainer.lr_schedule import build_lr_scheduler
from trainer.metrics import (
    MetricsLogger,
    device_description,
    peak_flops_for,
    peak_memory_gib,
    throughput_record,
)
from trainer.optim import ExpertBiasUpdater, build_optimizer
from trainer.runtime import git_revision, resolve_path, select_device, set_seed_and_determinism, versions
from trainer.validate import Validator

logger = logging.getLogger("trainer")

MODEL_NAMES = ("deepseek_v3",)


def check_unavailable_features(cfg: JobConfig, world_size: int) -> None:
    """Options that parse but whose implementation has not landed yet fail up front."""
    p = cfg.parallelism
    degrees = {"dp_replicate": p.dp_replicate, "tp": p.tp, "cp": p.cp, "ep": p.ep}
    if p.dp_shard not in (-1, 1):
        degrees["dp_shard"] = p.dp_shard
    wanted = {k: v for k, v in degrees.items() if v != 1}
    if wanted or p.ep_as_cp or world_size > 1:
        raise ConfigError(
            f"multi-process parallelism is not available yet (asked for {wanted or {}}, "
            f"ep_as_cp={p.ep_as_cp}, WORLD_SIZE={world_size}); run on one process (NGPU=1) with "
            "the [parallelism] degrees at 1"
        )
    if cfg.checkpoint.enable:
        raise ConfigError("[checkpoint] enable = true is not available yet; use --no-checkpoint.enable")
    if cfg.activation_checkpoint.mode != "none":
        raise ConfigError(
            f"activation_checkpoint.mode = {cfg.activation_checkpoint.mode!r} is not available yet; use 'none'"
        )


def resolve_flavor(cfg: JobConfig) -> DeepSeekV3ModelArgs:
    if cfg.model.name not in MODEL_NAMES:
        raise ConfigError(f"model.name = {cfg.model.name!r} is unknown; available: {', '.join(MODEL_NAMES)}")
    try:
        return get_flavor(cfg.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e} (available: {', '.join(flavor_names())})") from None


def build_model_args(cfg: JobConfig, vocab_size: int, eos_id: int) -> DeepSeekV3ModelArgs:
    """Resolves the flavor and every config-derived model value once, before the build."""
    args = resolve_flavor(cfg)
    m = cfg.model
    moe = dataclasses.replace(
        args.moe,
        use_grouped_mm=m.use_grouped_mm,
        seq_aux_loss_alpha=m.moe_aux_loss_alpha,
        load_balance_coeff=m.moe_bias_update_speed if m.moe_bias_update_speed > 0 else None,
    )
    try:
        return dataclasses.replace(
            args,
            moe=moe,
            vocab_size=vocab_size,
            eos_id=eos_id,
            max_seq_len=cfg.training.seq_len,
            attn_backend=m.attn_backend,
            attn_mask_type=m.attn_mask_type,
            mtp_depth=args.mtp_depth if m.mtp_depth < 0 else m.mtp_depth,
        )
    except ValueError as e:
        raise ConfigError(f"[model] options do not fit flavor {cfg.model.flavor!r}: {e}") from None


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        t = cfg.training
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_unavailable_features(cfg, world_size)
        resolve_flavor(cfg)  # a typo in the flavor fails before the run folder exists
        self.dp_rank, self.dp_world = 0, 1

        self.run_dir = Path(cfg.job.dump_folder)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _setup_logging(self.run_dir / "train.log")

        self.device = select_device(t.device)
        if cfg.model.attn_backend == "flex" and self.device.type != "cuda":
            raise ConfigError(
                "model.attn_backend = 'flex' needs a CUDA device (flex attention has no CPU backward); "
                "use --model.attn_backend sdpa"
            )
        set_seed_and_determinism(t.seed, t.deterministic)

        global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * self.dp_world
        if global_batch % (t.local_batch_size * self.dp_world):
            raise ConfigError(
                f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size x "
                f"data-parallel degree = {t.local_batch_size} x {self.dp_world}; pick a multiple of "
                f"{t.local_batch_size * self.dp_world}"
            )
        self.grad_accum_steps = global_batch // (t.local_batch_size * self.dp_world)

        tokenizer_path = resolve_path(cfg.model.tokenizer_path)
        self.tokenizer = build_tokenizer(tokenizer_path)
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size, self.tokenizer.eos_id)

        with torch.device("meta"):
            model = DeepSeekV3Model(self.model_args)
        model.to_empty(device=self.device)
        # Seed again so the weights do not depend on what ran before the build.
        torch.manual_seed(t.seed)
        model.init_weights()
        model.train()
        self.model = model

        self.autocast_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else None
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.bias_updater = ExpertBiasUpdater(model)
        self.bias_updater.register(self.optimizer)

        dataset_path = str(resolve_path(t.dataset_path)) if t.dataset_path else None
        self.train_loader = build_dataloader(
            tokenizer=self.tokenizer,
            dataset=t.dataset,
            dataset_path=dataset_path,
            seq_len=t.seq_len,
            batch_size=t.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world,
            split="train",
            seed=t.seed,
            infinite=True,
        )
        self.validator = self._build_validator() if cfg.validation.enable else None

        total, active = count_params(self.model_args, include_mtp=self.model_args.mtp_depth > 0)
        self.n_params, self.n_active = total, active
        self.flops_per_token = flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops_for(self.device, cfg.metrics.peak_flops)
        self.metrics = MetricsLogger(cfg.metrics, self.run_dir, cfg.to_dict(), t.steps)
        self.step = 0
        self._log_run_header(tokenizer_path, global_batch)

    def _build_validator(self) -> Validator:
        v, t = self.cfg.validation, self.cfg.training
        dataset = v.dataset or t.dataset
        path = v.dataset_path or (t.dataset_path if v.dataset is None else None)
        # A separate validation dataset is read whole; the training dataset gives its held-out split.
        split = "validation" if v.dataset is None else "train"
        path = str(resolve_path(path)) if path else None

        def build_loader():
            return build_dataloader(
                tokenizer=self.tokenizer,
                dataset=dataset,
                dataset_path=path,
                seq_len=t.seq_len,
                batch_size=t.local_batch_size,
                dp_rank=self.dp_rank,
                dp_world_size=self.dp_world,
                split=split,
                seed=t.seed,
                infinite=False,
            )

        return Validator(build_loader, v.steps, self.device, self.autocast)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _log_run_header(self, tokenizer_path: Path, global_batch: int) -> None:
        cfg, t = self.cfg, self.cfg.training
        if cfg.job.print_config:
            logger.info("resolved config:\n%s", cfg.to_toml().rstrip())
        cfg.save_toml(self.run_dir / "config.toml")
        logger.info("git revision %s | %s", git_revision(), " ".join(f"{k} {v}" for k, v in versions().items()))
        logger.info("device %s | world size %d", device_description(self.device), self.dp_world)
        logger.info(
            "model %s/%s: %.2fM params total, %.2fM active per token%s | %.3g training FLOPs/token "
            "(6 x active non-embedding params + attention, no causal halving)",
            cfg.model.name,
            cfg.model.flavor,
            self.n_params / 1e6,
            self.n_active / 1e6,
            f" (incl. MTP depth {self.model_args.mtp_depth})" if self.model_args.mtp_depth else "",
            self.flops_per_token,
        )
        logger.info(
            "tokenizer %s (vocab %d) | data %s | seq_len %d | global batch %d sequences = %d micro-batch(es) of %d",
            tokenizer_path,
            self.tokenizer.vocab_size,
            t.dataset if not t.dataset_path else f"{t.dataset}:{t.dataset_path}",
            t.seq_len,
            global_batch,
            self.grad_accum_steps,
            t.local_batch_size,
        )
        logger.info(
            "precision: params fp32%s | run folder %s",
            ", bf16 autocast" if self.autocast_dtype else ", no autocast",
            self.run_dir.resolve(),
        )

    def next_microbatches(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
        """All micro-batches of one optimizer step, fetched up front so the global count
        of valid tokens is known before the first backward."""
        start = time.perf_counter()
        batches = []
        for _ in range(self.grad_accum_steps):
            inputs, labels = next(self.train_iter)
            batches.append((inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)))
        return batches, time.perf_counter() - start

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        depth = self.model_args.mtp_depth
        n_valid = sum(count_valid(labels) for _, labels in batches)
        # MTP depth k predicts labels shifted by k+1, so its last k+1 positions have no target.
        n_valid_mtp = sum(count_valid(labels[:, k + 1 :]) for _, labels in batches for k in range(depth))
        loss_total = torch.zeros((), device=self.device)
        mtp_total = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            with self.autocast():
                out = self.model(inputs, labels=labels)
                loss = cross_entropy_sum(out.logits, labels) / n_valid
                objective = loss + out.aux_loss / len(batches)
                if out.mtp_logits:
                    mtp_sum, _ = mtp_loss(out.mtp_logits, labels, ignore_index=IGNORE_INDEX)
                    mtp = mtp_sum / max(n_valid_mtp, 1)
                    objective = objective + self.cfg.model.mtp_loss_weight * mtp
                    mtp_total += mtp.detach()
            objective.backward()
            loss_total += loss.detach()
        max_norm = self.cfg.training.max_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"loss": float(loss_total), "grad_norm": float(grad_norm), "lr": lr}
        if depth:
            stats["mtp_loss"] = float(mtp_total)
        moe_stats = self.bias_updater.last_stats
        if moe_stats:
            # max/mean expert load, averaged over MoE layers, and the worst layer's.
            stats["moe_imbalance"] = moe_stats["moe/load_imbalance/mean"]
            stats["moe_imbalance_worst"] = moe_stats["moe/load_imbalance/max"]
        return stats

    def validate(self) -> float:
        return self.validator.evaluate(self.model)

    def train(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.train_iter = iter(self.train_loader)
        if self.validator is not None:
            self.metrics.log({"step": 0, "val_loss": self.validate()})
        logger.info("training for %d steps", t.steps)
        gc.disable()
        tokens_per_step = self.grad_accum_steps * t.local_batch_size * t.seq_len
        window_time, window_wait, window_steps = 0.0, 0.0, 0
        try:
            while self.step < t.steps:
                self.step += 1
                if self.step % t.gc_freq == 0:
                    gc.collect()
                step_start = time.perf_counter()
                batches, data_wait = self.next_microbatches()
                stats = self.train_step(batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                window_time += time.perf_counter() - step_start
                window_wait += data_wait
                window_steps += 1
                is_log = self.step % cfg.metrics.log_freq == 0 or self.step == t.steps or self.step == 1
                is_val = self.validator is not None and (
                    self.step % cfg.validation.freq == 0 or self.step == t.steps
                )
                if not (is_log or is_val):
                    continue
                record = {"step": self.step, **stats}
                record.update(
                    throughput_record(
                        tokens=tokens_per_step * window_steps,
                        seconds=window_time,
                        flops_per_token=self.flops_per_token,
                        peak_flops=self.peak_flops,
                    )
                )
                record["memory_gib"] = peak_memory_gib(self.device)
                record["data_wait_pct"] = 100.0 * window_wait / max(window_time, 1e-9)
                if not math.isfinite(stats["loss"]):
                    logger.warning("step %d: non-finite loss %s", self.step, stats["loss"])
                if is_val:
                    record["val_loss"] = self.validate()
                self.metrics.log(record)
                window_time, window_wait, window_steps = 0.0, 0.0, 0
        finally:
            gc.enable()
        logger.info("training finished at step %d; run folder %s", self.step, self.run_dir.resolve())

    def close(self) -> None:
        self.metrics.close()


def _setup_logging(log_file: Path) -> None:
    root = logging.getLogger("trainer")
    root.setLevel(logging.INFO)
    root.propagate = False
    if root.handlers:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(log_file, encoding="utf-8")):
        handler.setFormatter(fmt)
        root.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        # Bad paths or bad data options detected while building the run: say so plainly.
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d; exiting", trainer.step)
        return 130
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
