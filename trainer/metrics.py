"""Per-step metrics: console line (with step time and ETA), JSONL file in the run folder, wandb
and TensorBoard.

MFU convention (stated wherever MFU is printed): model FLOPs per token come from
``models.deepseek_v3.flops_per_token`` = 6 x active non-embedding parameters + the
attention term 6 x n_layers x n_heads x (qk_head_dim + v_head_dim) x seq_len, without
halving for the causal mask (the torchtitan convention). MFU = achieved model FLOP/s
divided by the device's dense bf16 peak (or ``[metrics] peak_flops``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger("trainer")

TENSORBOARD_FOLDER = "tb"  # inside the run folder

# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), matched by
# substring of torch.cuda.get_device_name(); first match wins, so longer names go first.
_PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("GB200", 2500e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("MI300X", 1307e12),
)


def peak_flops_for(device: torch.device, override: float = 0.0) -> float | None:
    """Per-device peak FLOP/s used for MFU; None when unknown (MFU is then not reported)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16_FLOPS:
        if key in name:
            return flops
    logger.warning("unknown GPU %r: set [metrics] peak_flops to report MFU", name)
    return None


def peak_memory_gib(device: torch.device) -> float:
    """CUDA max reserved memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


# (record key, format) of the console line, in order.
_LINE_FIELDS = (
    ("loss", "loss {:.4f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("val_loss_ema", "ema {:.4f}"),
    ("grad_norm", "gnorm {:.3f}"),
    ("lr", "lr {:.2e}"),
    ("tokens_per_sec", "tok/s {:,.0f}"),
    ("tflops", "TFLOP/s {:.2f}"),
    ("mfu_pct", "MFU {:.1f}%"),
    ("memory_gib", "mem {:.2f}GiB"),
    ("moe_imbalance", "moe max/mean {:.2f}"),
    ("max_logit", "max logit {:.1f}"),
    ("data_wait_pct", "data {:.1f}%"),
)


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class MetricsLogger:
    """Writes one record per logged step to the console, the JSONL file, wandb and TensorBoard.

    Only the rank chosen for logging writes; the others hold a disabled logger so
    call sites need no rank checks.

    The ETA on the console line is the wall-clock time per step since the first logged training
    step of this process, times the steps left: it includes validation and checkpoint saves, and
    leaves out the first step (compilation, warm-up). Until there is a second logged step it is
    the record's `step_time_s` times the steps left.
    """

    def __init__(self, metrics_cfg, run_dir: Path, job_config_dict: dict, total_steps: int, enabled: bool = True):
        self.cfg = metrics_cfg
        self.total_steps = total_steps
        self.enabled = enabled
        self._jsonl = None
        self._wandb_run = None
        self._tensorboard = None
        self._start = time.perf_counter()
        self._first_step: tuple[int, float] | None = None  # (step, clock) of the first logged step
        if not enabled:
            return
        jsonl = run_dir / metrics_cfg.jsonl_file
        self._jsonl = open(jsonl, "a", encoding="utf-8")
        if _ends_mid_line(jsonl):
            # A run killed while writing left its last record cut off: the resumed run's records
            # start on a line of their own instead of continuing (and spoiling) that one.
            self._jsonl.write("\n")
        if metrics_cfg.enable_wandb and metrics_cfg.wandb_mode != "disabled":
            import wandb

            self._wandb_run = wandb.init(
                project=metrics_cfg.wandb_project,
                dir=str(run_dir),
                mode=metrics_cfg.wandb_mode,
                config=job_config_dict,
            )
        if metrics_cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports the optional tensorboard package

            self._tensorboard = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_FOLDER))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {k: v for k, v in record.items() if v is not None}
        now = time.perf_counter()
        record["elapsed_s"] = round(now - self._start, 3)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, step)
        logger.info(self.format_line(record, self._eta_s(step, record.get("step_time_s"), now)))

    def _eta_s(self, step: int, step_time_s: float | None, now: float) -> float | None:
        if step < 1 or step_time_s is None:
            return None  # the validation before the first step
        if self._first_step is None:
            self._first_step = (step, now)
        first, since = self._first_step
        per_step = (now - since) / (step - first) if step > first else step_time_s
        return per_step * (self.total_steps - step)

    def format_line(self, r: dict, eta_s: float | None = None) -> str:
        step = r["step"]
        width = len(str(self.total_steps))
        parts = [f"step {step:>{width}}/{self.total_steps} [{100 * step / self.total_steps:5.1f}%]"]
        if "step_time_s" in r:
            parts.append(f"{r['step_time_s']:.2f}s/step")
        if eta_s is not None:
            parts.append(f"eta {datetime.timedelta(seconds=round(eta_s))}")
        parts += [fmt.format(r[key]) for key, fmt in _LINE_FIELDS if key in r]
        # A mixture's per-source validation losses (trainer/validate.py, MixtureValidator).
        parts += [f"{key} {value:.4f}" for key, value in r.items() if key.startswith("val_loss/")]
        if "time/forward_backward_ms" in r:  # [profiling] step_breakdown
            labels = (("data_wait", "data"), ("forward_backward", "fwd+bwd"), ("reduce_clip", "clip"), ("optimizer", "opt"))
            parts.append("ms " + " ".join(f"{short} {r[f'time/{key}_ms']:.1f}" for key, short in labels))
        return "  ".join(parts)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def throughput_record(
    *,
    tokens: int,
    seconds: float,
    flops_per_token: float,
    peak_flops: float | None,
) -> dict:
    """tokens/s per device, achieved model TFLOP/s, and MFU when the peak is known."""
    tps = tokens / max(seconds, 1e-9)
    achieved = tps * flops_per_token
    record = {"tokens_per_sec": tps, "tflops": achieved / 1e12}
    if peak_flops:
        record["mfu_pct"] = 100.0 * achieved / peak_flops
    return record


class ThroughputWindow:
    """The steps since the last logged one: their wall time and data wait, turned into the logged
    throughput figures (tokens/s and TFLOP/s per device, MFU, step time, data-wait share)."""

    def __init__(self, tokens_per_step: float, flops_per_token: float, peak_flops: float | None):
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.seconds, self.data_wait, self.steps = 0.0, 0.0, 0

    def add(self, seconds: float, data_wait: float) -> None:
        self.seconds += seconds
        self.data_wait += data_wait
        self.steps += 1

    def record(self) -> dict:
        """The window's figures; the window starts over."""
        record = throughput_record(
            tokens=self.tokens_per_step * self.steps, seconds=self.seconds, flops_per_token=self.flops_per_token,
            peak_flops=self.peak_flops,
        )
        record["step_time_s"] = self.seconds / max(self.steps, 1)
        record["data_wait_pct"] = 100.0 * self.data_wait / max(self.seconds, 1e-9)
        self.seconds, self.data_wait, self.steps = 0.0, 0.0, 0
        return record


def is_log_step(step: int, last_step: int, log_freq: int, stopping: bool) -> bool:
    """Logged: every ``log_freq``-th step, the first, the last, and the one a stop ends on."""
    return step % log_freq == 0 or step in (1, last_step) or stopping
