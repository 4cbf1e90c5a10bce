"""The configuration schema: one dataclass per TOML section, each field with its default and the
one-line doc that is also its `--help` text (`metadata["help"]`); a field with a fixed set of values
is typed `Literal[...]`, the one list of its choices.

Adding a section is one new `Section` dataclass plus one line in `JobConfig`; loading, overriding,
validation (types, choices, the section's `problems()`), help and TOML export discover it.
Torch-free, so `--help` and config errors come back instantly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from trainer.config.activation_checkpoint import ActivationCheckpoint
from trainer.config.combinations import BUNDLED_DATASET, combination_problems, combination_warnings
from trainer.config.data_mix import mixture_problems
from trainer.config.fields import ConfigError, Section, choice_problems, failed_checks, option, sections_of
from trainer.config.layout import degree_problems
from trainer.config.schedules import PPSchedule


@dataclass
class Job(Section):
    config_file: str | None = option(None, "TOML config file to load (alias: --config)")
    dump_folder: str = option(
        "./outputs", "Where runs write (log, metrics, config): a fresh run into a new timestamped folder under it, "
        "a resumable run (checkpoint.enable) into it, with its checkpoints"
    )
    description: str = option("", "Free-text description of the run, recorded in the log")
    print_config: bool = option(True, "Print the resolved config at start")
    dry_run: bool = option(
        False, "Rehearse one step of one rank of a [dry_run] world_size world on this CPU (fake process group, fake "
        "tensors): the build, per-rank peak memory by category, the step's collectives; nothing is trained "
        "(docs/planning.md)"
    )


@dataclass
class Model(Section):
    name: Literal["deepseek_v3"] = option("deepseek_v3", "Model family")
    flavor: str = option("debugmodel", "Architecture preset of the model family (sizes live in Python, not TOML)")
    tokenizer_path: str = option(
        "assets/tokenizer/shakespeare.tiktoken",
        "The tokenizer: a .tiktoken file, a Hugging Face tokenizer.json, or a directory holding one (docs/tokenizer.md)",
    )
    parse_special_tokens: bool = option(
        False, "Special-token strings inside documents become their ids (chat-formatted data; a document's own "
        "BOS/EOS are not doubled); false: they are encoded as plain text"
    )
    attn_backend: Literal["sdpa", "flex"] = option("sdpa", "Attention kernel")
    attn_mask_type: Literal["causal", "block_causal"] = option(
        "causal",
        "causal: one causal mask (what HF inference computes); block_causal: no attention across packed "
        "documents, so logits after an EOS differ from HF inference (docs/checkpoints.md)",
    )
    disable_yarn: bool = option(
        False, "Plain RoPE and softmax scale even if the flavor uses YaRN (changes what released weights compute)"
    )
    use_grouped_mm: bool = option(True, "Compute experts with grouped GEMM instead of a per-expert loop")
    mtp_depth: int = option(-1, "Multi-token-prediction depth; -1 = the flavor's, 0 disables MTP")
    moe_aux_loss_alpha: float = option(0.0, "Weight of the sequence-wise balance loss; 0 disables it")
    moe_bias_update_speed: float = option(0.001, "Aux-loss-free balancing bias step gamma; 0 disables it")
    mtp_loss_weight: float = option(0.3, "Weight lambda of the multi-token-prediction loss")

    def mtp_depth_for(self, flavor_depth: int) -> int:
        """The run's MTP depth: `mtp_depth`, or the flavor's where it is -1."""
        return flavor_depth if self.mtp_depth < 0 else self.mtp_depth

    def problems(self) -> list[str]:
        return failed_checks(
            (self.mtp_depth >= -1, f"model.mtp_depth must be >= 0, or -1 for the flavor's, got {self.mtp_depth}."),
            (self.mtp_loss_weight >= 0, f"model.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}."),
            (
                self.moe_aux_loss_alpha >= 0,
                f"model.moe_aux_loss_alpha must be >= 0 (0 disables), got {self.moe_aux_loss_alpha}.",
            ),
            (
                self.moe_bias_update_speed >= 0,
                f"model.moe_bias_update_speed must be >= 0 (0 disables), got {self.moe_bias_update_speed}.",
            ),
        )


@dataclass
class Engram(Section):
    enable: bool = option(False, "Add Engram conditional memory (hashed n-gram tables) to the model")
    layer_ids: list[int] = option([1], "Blocks that get an Engram module: 0-based block indices, ascending")
    max_ngram: int = option(3, "N: hash suffix n-grams of orders 2..N (also the short conv's dilation)")
    heads_per_order: int = option(8, "K: hash heads per n-gram order")
    base_size: int = option(262144, "Rows per hash head before rounding up to a prime (Engram-27B: 2262400)")
    head_dim: int = option(80, "D_h: width of one head's row; memory width = (N-1) x K x D_h")
    seed: int = option(0, "Seed of the hash multipliers (identical on every rank)")
    lr_multiplier: float = option(5.0, "Table learning rate = optimizer.lr x this")
    weight_decay: float = option(0.0, "Weight decay of the tables")
    embedding_parallel_degree: int = option(
        1, "Ranks the table rows are split over (of those seeing different tokens); 1 = unsharded, -1 = all"
    )
    precompute: bool = option(True, "Exchange the lookups of all Engram layers together, once per step")
    offload_optimizer_state: bool = option(False, "Keep the tables' Adam state in CPU memory and update there")

    def problems(self) -> list[str]:
        ids = self.layer_ids
        return failed_checks(
            (
                not self.enable or (bool(ids) and ids == sorted(set(ids)) and min(ids) >= 0),
                f"engram.layer_ids must be distinct, ascending, 0-based block indices, got {ids}.",
            ),
            (self.max_ngram >= 2, f"engram.max_ngram must be >= 2, got {self.max_ngram}."),
            *(
                (getattr(self, key) >= 1, f"engram.{key} must be >= 1, got {getattr(self, key)}.")
                for key in ("heads_per_order", "head_dim")
            ),
            (
                self.embedding_parallel_degree >= 1 or self.embedding_parallel_degree == -1,
                f"engram.embedding_parallel_degree must be >= 1 or -1 (all data ranks), got {self.embedding_parallel_degree}.",
            ),
            (self.base_size >= 2, f"engram.base_size must be >= 2, got {self.base_size}."),
            (self.lr_multiplier > 0, f"engram.lr_multiplier must be > 0, got {self.lr_multiplier}."),
            (self.weight_decay >= 0, f"engram.weight_decay must be >= 0, got {self.weight_decay}."),
        )


@dataclass
class Training(Section):
    steps: int = option(1000, "Number of optimizer steps")
    seq_len: int = option(2048, "Tokens per sample")
    local_batch_size: int = option(8, "Samples per data-parallel rank per micro-batch")
    global_batch_size: int = option(
        -1, "Samples per optimizer step; -1 = local_batch_size x data-parallel degree (no accumulation)"
    )
    dataset: str = option("shakespeare", "Training dataset name")
    dataset_path: str | None = option(None, "Local path or HF hub id of the dataset; none = the dataset's default")
    dataset_mix: list[str] = option(
        [], "Weighted mixture of datasets instead of training.dataset: entries 'WEIGHT DATASET [PATH]' "
        "(docs/data.md); empty = training.dataset alone"
    )
    seed: int = option(42, "Random seed for weights and data order")
    deterministic: bool = option(False, "Use deterministic algorithms (slower)")
    compile: bool = option(False, "Apply torch.compile to the model blocks")
    mixed_precision_param: Literal["bfloat16", "float32"] = option(
        "bfloat16", "Dtype of parameters in forward/backward (master weights stay fp32)"
    )
    one_process_cast: Literal["fsdp", "autocast"] = option(
        "fsdp", "One process, bfloat16: fsdp = FSDP2 casts each weight once per step; autocast = plain autocast "
        "casts at every use, no process group (benchmarks/step_bench.py compares them, docs/performance.md)"
    )
    max_norm: float = option(1.0, "Gradient clipping max norm; 0 = no clipping")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "Device type; auto = cuda when available, else cpu")
    gc_freq: int = option(50, "Run Python garbage collection every N steps")
    cpu_keep_freed_memory: bool = option(
        True,
        "CPU only: glibc malloc keeps the memory a step frees for the next step instead of returning it to "
        "the OS and page-faulting it in again (faster, steadier steps; the process's memory no longer shrinks)",
    )
    check_memory_fit: bool = option(
        True,
        "Before building the model, refuse a run whose memory estimate (trainer/planning/memory.py) exceeds the free "
        "device memory; --no-training.check_memory_fit when the estimate is wrong for your setup",
    )
    time_limit_minutes: float = option(0.0, "Save a checkpoint and stop after this many minutes; 0 = no limit")
    max_skipped_steps: int = option(
        10, "Stop when this many consecutive steps had a non-finite loss or grad norm (each is skipped)"
    )
    debug_inject_nan_step: int = option(-1, "Debug: make the loss and gradients NaN at this step; -1 = never")

    def problems(self) -> list[str]:
        gbs, lbs = self.global_batch_size, self.local_batch_size
        return mixture_problems(self.dataset_mix) + failed_checks(
            (
                not self.dataset_mix or (self.dataset == BUNDLED_DATASET and self.dataset_path is None),
                f"training.dataset_mix replaces training.dataset = {self.dataset!r} / training.dataset_path = "
                f"{self.dataset_path!r}; add that dataset to the mixture as an entry, or drop --training.dataset_mix.",
            ),
            *(
                (getattr(self, key) > 0, f"training.{key} must be a positive integer, got {getattr(self, key)}.")
                for key in ("steps", "seq_len", "local_batch_size", "gc_freq")
            ),
            (
                gbs == -1 or (gbs > 0 and lbs > 0 and gbs % lbs == 0),
                f"training.global_batch_size must be -1 or a positive multiple of "
                f"training.local_batch_size ({lbs}), got {gbs}.",
            ),
            (self.max_norm >= 0, f"training.max_norm must be >= 0 (0 disables clipping), got {self.max_norm}."),
            (
                self.time_limit_minutes >= 0,
                f"training.time_limit_minutes must be >= 0 (0 = no limit), got {self.time_limit_minutes}.",
            ),
            (
                self.max_skipped_steps >= 1,
                f"training.max_skipped_steps must be >= 1 (1 stops at the first non-finite step), "
                f"got {self.max_skipped_steps}.",
            ),
        )


@dataclass
class Optimizer(Section):
    name: Literal["AdamW", "Adam", "muon"] = option(
        "AdamW", "Optimizer; muon = Muon on the block matrices and AdamW on the rest (docs/optimizers.md)"
    )
    lr: float = option(8e-4, "Peak learning rate")
    beta1: float = option(0.9, "Adam beta1")
    beta2: float = option(0.95, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon")
    weight_decay: float = option(0.1, "Decoupled weight decay (not applied to norms, biases and embeddings)")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = option(
        "auto", "Optimizer kernel; auto = fused on GPU, foreach otherwise"
    )
    state_dtype: Literal["float32", "bfloat16"] = option(
        "float32", "Dtype of the optimizer states (AdamW moments, Muon momentum); weights stay fp32"
    )
    muon_momentum: float = option(0.95, "Muon momentum mu")
    muon_nesterov: bool = option(True, "Muon: orthogonalise the Nesterov momentum (else the plain momentum)")
    muon_ns_steps: int = option(5, "Muon: Newton-Schulz iterations")
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto", "Muon: Newton-Schulz dtype; auto = bfloat16 on GPUs and AMX CPUs (bf16 matrix units), float32 on other CPUs"
    )
    qk_clip: bool = option(
        False, "MuonClip's QK-clip: rescale a head's MLA query/key weights once its max logit passes the threshold"
    )
    qk_clip_threshold: float = option(100.0, "QK-clip: largest pre-softmax attention logit a head may keep")
    qk_clip_every: int = option(1, "QK-clip: record the logits and clip every N steps")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}."),
            (0 <= self.beta1 < 1, f"optimizer.beta1 must be in [0, 1), got {self.beta1}."),
            (0 <= self.beta2 < 1, f"optimizer.beta2 must be in [0, 1), got {self.beta2}."),
            (self.eps > 0, f"optimizer.eps must be > 0, got {self.eps}."),
            (self.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}."),
            (
                self.name != "Adam" or self.state_dtype == "float32",
                "optimizer.state_dtype = 'bfloat16' is for AdamW and muon (Adam keeps torch's fp32 states); "
                "use --optimizer.name AdamW or --optimizer.state_dtype float32.",
            ),
            (0 <= self.muon_momentum < 1, f"optimizer.muon_momentum must be in [0, 1), got {self.muon_momentum}."),
            (1 <= self.muon_ns_steps < 100, f"optimizer.muon_ns_steps must be in [1, 99], got {self.muon_ns_steps}."),
            (
                self.qk_clip_threshold > 0,
                f"optimizer.qk_clip_threshold must be > 0 (a logit bound, e.g. 100), got {self.qk_clip_threshold}.",
            ),
            (self.qk_clip_every >= 1, f"optimizer.qk_clip_every must be >= 1, got {self.qk_clip_every}."),
        )


@dataclass
class LRScheduler(Section):
    warmup_steps: int = option(200, "Linear warmup steps")
    decay_ratio: float | None = option(
        None, "Fraction of steps spent decaying at the end (WSD); none = decay over all steps after warmup"
    )
    decay_type: Literal["linear", "cosine", "sqrt"] = option("linear", "Shape of the decay")
    min_lr_factor: float = option(0.0, "Final learning rate as a fraction of the peak")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}."),
            (
                self.decay_ratio is None or 0 <= self.decay_ratio <= 1,
                f"lr_scheduler.decay_ratio must be in [0, 1] (or none to decay after warmup), "
                f"got {self.decay_ratio}.",
            ),
            (
                0 <= self.min_lr_factor <= 1,
                f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}.",
            ),
        )


@dataclass
class Metrics(Section):
    log_freq: int = option(10, "Log metrics every N steps")
    enable_wandb: bool = option(False, "Also log to Weights & Biases")
    wandb_project: str = option("dsv3-trainer", "Weights & Biases project")
    wandb_mode: Literal["offline", "online", "disabled"] = option("offline", "Weights & Biases mode")
    enable_tensorboard: bool = option(False, "Also write TensorBoard scalars to <run folder>/tb (needs tensorboard)")
    peak_flops: float = option(0.0, "Per-device peak FLOP/s for MFU; 0 = look up the device")
    jsonl_file: str = option("metrics.jsonl", "Metrics JSONL file name inside the run folder")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.log_freq >= 1, f"metrics.log_freq must be >= 1, got {self.log_freq}."),
            (
                self.peak_flops >= 0,
                f"metrics.peak_flops must be >= 0 (0 = look up the device), got {self.peak_flops}.",
            ),
            (
                not self.enable_tensorboard or importlib.util.find_spec("tensorboard") is not None,
                "metrics.enable_tensorboard needs the tensorboard package: pip install tensorboard "
                "(or the project's [tensorboard] extra), or drop --metrics.enable_tensorboard.",
            ),
        )


@dataclass
class Validation(Section):
    enable: bool = option(True, "Run validation during training")
    freq: int = option(50, "Validate every N steps")
    steps: int = option(10, "Batches per validation")
    dataset: str | None = option(None, "Validation dataset; none = held-out split of the training dataset")
    dataset_path: str | None = option(None, "Local path or HF hub id of the validation dataset")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.freq >= 1, f"validation.freq must be >= 1, got {self.freq}."),
            (self.steps >= 1, f"validation.steps must be >= 1, got {self.steps}."),
        )


@dataclass
class Checkpoint(Section):
    enable: bool = option(False, "Save checkpoints and resume from the latest one")
    folder: str = option("checkpoint", "Checkpoint folder, relative to the run folder")
    interval: int = option(500, "Save every N steps")
    keep_latest_k: int = option(3, "Keep only the newest K checkpoints; 0 = keep all")
    async_mode: Literal["disabled", "async"] = option(
        "disabled", "async: write checkpoints in a background thread while training goes on"
    )
    load_step: int = option(-1, "Step to resume from; -1 = the newest complete checkpoint")
    load_unverified: bool = option(
        False, "Also load checkpoints whose marker records no checksums (saved before checksums existed, or by "
        "another tool): their files are not verified"
    )
    reset_optimizer: bool = option(
        False, "Resume weights, schedule and data position but start the optimizer state afresh (to switch optimizer)"
    )
    last_save_model_only: bool = option(False, "Make the final save model weights only, in export_dtype")
    export_dtype: Literal["float32", "bfloat16", "float16"] = option(
        "bfloat16", "Weight dtype of the model-only final save"
    )
    initial_load_path: str | None = option(
        None, "Weights to start from when there is no checkpoint to resume: a DCP checkpoint or HF folder"
    )
    initial_load_format: Literal["dcp", "hf"] = option("dcp", "Format of initial_load_path")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.interval >= 1, f"checkpoint.interval must be >= 1, got {self.interval}."),
            (
                self.load_step == -1 or self.load_step >= 1,
                f"checkpoint.load_step must be -1 (newest) or a step >= 1, got {self.load_step}.",
            ),
            (
                self.keep_latest_k >= 0,
                f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}.",
            ),
        )


@dataclass
class Ema(Section):
    enable: bool = option(
        False, "Keep an exponential moving average of the weights in CPU memory (DeepSeek-V3; docs/checkpoints.md)"
    )
    decay: float = option(0.999, "Weight of the old average at each update, in (0, 1)")
    update_every: int = option(1, "Update the average every N steps (it then spans about N / (1 - decay) steps)")
    validate: bool = option(False, "Also score the validation split with the averaged weights (val_loss_ema)")

    def problems(self) -> list[str]:
        return failed_checks(
            (0.0 < self.decay < 1.0, f"ema.decay must be in (0, 1), e.g. 0.999, got {self.decay}."),
            (self.update_every >= 1, f"ema.update_every must be >= 1, got {self.update_every}."),
        )


ReshardPolicy = Literal["default", "always", "never"]


@dataclass
class Parallelism(Section):
    dp_replicate: int = option(1, "Data-parallel replicas (HSDP replicate dim)")
    dp_shard: int = option(-1, "FSDP shard degree; -1 = infer from the world size")
    tp: int = option(1, "Tensor-parallel degree")
    cp: int = option(1, "Context-parallel degree")
    ep: int = option(1, "Expert-parallel degree (borrows ranks from dp_shard x cp)")
    ep_as_cp: bool = option(False, "Shard the sequence over the expert dim outside the MoE exchange")
    pp: int = option(1, "Pipeline-parallel degree, the outermost dim: world = pp x dp_replicate x dp_shard x cp x tp")
    pp_schedule: PPSchedule = option("1F1B", "Pipeline schedule of torch.distributed.pipelining")
    pp_stages_per_rank: int = option(-1, "Pipeline stages per rank; -1 = 1 for GPipe/1F1B, else 2 (V schedules need 2)")
    pp_microbatches: int = option(
        -1, "Pipeline micro-batches per step; -1 = the fewest that fill the pipeline (pp, or all stages for V schedules)"
    )
    pp_max_deferred_weight_passes: int = option(
        -1,
        "Zero-bubble schedules: most weight passes a rank keeps waiting (each holds its micro-batch's "
        "gradients at every weight's use); past it the oldest is taken in its input pass; -1 = the schedule's own",
    )
    pp_layout: str = option(
        "", "Explicit stage split: stages split by '|', E embedding, t block, L head+MTP, e.g. 'Et*2|t*4L'; empty = even"
    )
    moe_overlap: bool = option(
        False,
        "Hide the EP all-to-all: run micro-batch i's backward beside i+1's forward, MoE node by node "
        "(needs ep > 1; with pp > 1 DualPipeV, whose OVERLAP_F_B actions it interleaves)",
    )
    fsdp_reshard_after_forward: ReshardPolicy = option(
        "default",
        "Free gathered FSDP params after forward: default = all but the root unit",
    )

    def problems(self) -> list[str]:
        return degree_problems(self)


def _positive_seconds(section: Section, name: str, keys: tuple[str, ...]) -> list[tuple[bool, str]]:
    """Checks that each of ``keys`` is a finite number of seconds > 0."""
    return [
        (
            math.isfinite(getattr(section, key)) and getattr(section, key) > 0,
            f"{name}.{key} must be a number of seconds > 0, got {getattr(section, key)}.",
        )
        for key in keys
    ]


@dataclass
class Comm(Section):
    init_timeout_seconds: float = option(
        300.0, "Longest wait of any collective until the first step has finished: process-group start-up, the "
        "build, the checkpoint load and the first step (which compiles)"
    )
    train_timeout_seconds: float = option(
        100.0, "Longest wait of any collective after the first step: a rank that lags the others by more (it hung, "
        "died or is that slow) ends the run with one line naming this key"
    )

    def problems(self) -> list[str]:
        return failed_checks(*_positive_seconds(self, "comm", ("init_timeout_seconds", "train_timeout_seconds")))


@dataclass
class FaultTolerance(Section):
    enable: bool = option(
        False, "Fault-tolerant replica groups (torchft): this launch is one of parallelism.dp_replicate groups; a "
        "failed group drops out and the others train on (docs/fault_tolerance.md)"
    )
    replica_id: int = option(0, "This launch's replica group, 0 .. parallelism.dp_replicate - 1")
    min_replicas: int = option(1, "Fewest live replica groups that may commit a step (torchft min_replica_size)")
    lighthouse: str = option(
        "", "The torchft lighthouse's address, e.g. http://host:29510; empty = $TORCHFT_LIGHTHOUSE"
    )
    quorum_timeout_seconds: float = option(
        120.0, "Longest wait for a quorum of replica groups at the start of a step (a group that builds its model "
        "meanwhile joins late)"
    )
    timeout_seconds: float = option(
        30.0, "Longest wait of a cross-group collective, commit vote or live-state transfer; past it the step is "
        "not committed and the next quorum leaves the silent group out"
    )

    def problems(self) -> list[str]:
        return failed_checks(
            (self.replica_id >= 0, f"fault_tolerance.replica_id must be >= 0, got {self.replica_id}."),
            (self.min_replicas >= 1, f"fault_tolerance.min_replicas must be >= 1, got {self.min_replicas}."),
            *_positive_seconds(self, "fault_tolerance", ("quorum_timeout_seconds", "timeout_seconds")),
        )


@dataclass
class Profiling(Section):
    enable_profiling: bool = option(False, "Record torch.profiler traces of profile_steps steps from profile_start_step")
    profile_start_step: int = option(3, "First profiled step (after warm-up steps, so compile and caches are settled)")
    profile_steps: int = option(2, "Number of consecutive steps in the trace")
    ranks: list[int] = option([0], "Ranks that write traces and memory snapshots")
    traces_folder: str = option("profile_traces", "Trace and snapshot folder, relative to the run folder")
    profile_memory: bool = option(False, "Also record tensor allocations in the trace (slower, larger trace)")
    memory_snapshot_step: int = option(-1, "CUDA only: dump an allocator memory snapshot after this step; -1 = never")
    memory_snapshot_on_oom: bool = option(False, "CUDA only: record allocation history and dump a snapshot on OOM")
    step_breakdown: bool = option(
        False, "Log per-step time split: data wait, forward+backward, reductions+clipping, optimizer (syncs CUDA)"
    )

    def problems(self) -> list[str]:
        return failed_checks(
            (
                self.profile_start_step >= 1,
                f"profiling.profile_start_step must be >= 1, got {self.profile_start_step}.",
            ),
            (self.profile_steps >= 1, f"profiling.profile_steps must be >= 1, got {self.profile_steps}."),
            (
                self.memory_snapshot_step == -1 or self.memory_snapshot_step >= 1,
                f"profiling.memory_snapshot_step must be -1 (never) or a step >= 1, got {self.memory_snapshot_step}.",
            ),
            (all(r >= 0 for r in self.ranks), f"profiling.ranks must be ranks >= 0, got {self.ranks}."),
        )


@dataclass
class Quantize(Section):
    float8: bool = option(False, "Train nn.Linear layers with float8 matmuls (torchao; CUDA SM89+)")
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = option(
        "tensorwise", "torchao float8 scaling recipe of the Linear layers"
    )
    filter_fqns: list[str] = option(
        ["router", "gate", "head"], "Modules whose name contains any of these stay in high precision"
    )
    float8_experts: bool = option(
        False, "Also run the routed experts' grouped GEMMs in float8 (torchao MoE training; CUDA SM90+)"
    )
    emulate: bool = option(False, "Emulate float8 matmuls in high precision (CPU tests; no speed-up)")

    def problems(self) -> list[str]:
        return failed_checks(
            (
                self.float8 or not self.float8_experts,
                "quantize.float8_experts = true needs quantize.float8 = true; add --quantize.float8.",
            ),
        )


@dataclass
class DryRun(Section):
    world_size: int = option(8, "job.dry_run: ranks of the rehearsed world (NNODES x NGPU of the real launch)")
    rank: int = option(-1, "job.dry_run: the one rank to rehearse; -1 = the ranks dry_run.ranks names")
    ranks: Literal["peak", "all_stages"] = option(
        "peak", "job.dry_run: peak = rank 0, or under pipelining the pp ranks that can peak (docs/planning.md); "
        "all_stages = the first rank of every pp rank"
    )
    gpu_memory_gib: float = option(80.0, "job.dry_run: memory of one rehearsed GPU, for the memory-fit check")
    output_json: str = option("", "job.dry_run: also write the report to this JSON file")

    def problems(self) -> list[str]:
        return failed_checks(
            (self.world_size >= 1, f"dry_run.world_size must be >= 1, got {self.world_size}."),
            (  # a rank is checked against a valid world only (world -8 has no ranks to name)
                self.world_size < 1 or -1 <= self.rank < self.world_size,
                f"dry_run.rank {self.rank} is outside the world of dry_run.world_size {self.world_size} ranks; "
                f"pick a rank in 0..{self.world_size - 1}, or -1 for the default ranks.",
            ),
        )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    engram: Engram = field(default_factory=Engram)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    ema: Ema = field(default_factory=Ema)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    profiling: Profiling = field(default_factory=Profiling)
    quantize: Quantize = field(default_factory=Quantize)
    dry_run: DryRun = field(default_factory=DryRun)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        # TOML has no null; every None-able field defaults to None, so omitting it round-trips.
        return tomli_w.dumps(
            {s: {k: v for k, v in table.items() if v is not None} for s, table in self.to_dict().items()}
        )

    def save_toml(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_toml(), encoding="utf-8")

    def validate(self) -> None:
        """Raise one ConfigError listing every invalid value or combination."""
        problems = choice_problems(self)
        for section in sections_of(type(self)):
            problems += getattr(self, section).problems()
        problems += combination_problems(self)
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

    def warnings(self) -> list[str]:
        """Options the run will not use and legal but suspicious settings, one message each
        (the trainer logs them at start)."""
        return combination_warnings(self)

