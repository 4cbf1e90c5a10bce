"""Parameter counts and training FLOPs per token, computed from args on the meta device.

Conventions (print them next to every MFU figure):
* Parameters are counted on a meta-device model, so even 671B costs no memory. A tied embedding
  is counted once.
* *Total* parameters: every weight, the input embedding and the output head included.
* *Active* parameters per token: everything except the input embedding and the routed experts, plus
  `top_k / num_experts` of the routed expert weights. The output head counts (a full matmul per
  token); the embedding does not (one row is looked up). That is the convention of DeepSeek's
  published figures: 671B total / 37B active (V3), 236B / 21B (V2), 15.7B / 2.4B (V2-Lite).
  A tied embedding is the head, so it counts.
* `flops_per_token` = 6 * active parameters (all of them are matmul weights)
  + the attention-score term `6 * layers * n_heads * (qk_head_dim + v_head_dim) * seq_len`
  (torchtitan's convention: QK^T and PV, forward + backward, *without* halving for the causal
  mask). With `include_mtp` the MTP modules count as extra layers and their second use of the
  shared output head is added (that is the work a training step does).
* Engram (`args.engram`): its tables count in the total like an embedding; per token only the
  (N-1) x K looked-up rows (`memory_dim` values per Engram layer) are active, and they are no
  matmul, so they are left out of the FLOPs like the embedding. The rest of an Engram module
  (key/value projections, depthwise conv, norms) counts like any other weight.
* `stage_unit_costs` splits the same FLOPs by the pieces a pipeline stage can hold (embedding,
  each block, norm + head, each MTP module with its use of the head) and adds the cross-entropy's
  elementwise work, so the pipeline split balances stages by the work they do.
"""

import torch

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model


def _is_engram_table(param_name: str) -> bool:
    return param_name.endswith(".engram.table.weight")


def _is_routed_expert(param_name: str) -> bool:
    # Routed experts are the stacked `...ffn.experts.w{1,2,3}`; shared experts live under
    # `shared_experts.` and do not match the leading dot.
    return ".experts." in param_name


def _matmul_params(args: DeepSeekV3ModelArgs, param_name: str, numel: int) -> float:
    """Weights a token multiplies with: none of a lookup table (an untied embedding, Engram's
    tables), `top_k / num_experts` of the routed experts, all of the rest."""
    if (param_name == "embed.weight" and not args.tie_embeddings) or _is_engram_table(param_name):
        return 0.0
    return numel * args.moe.top_k / args.moe.num_experts if _is_routed_expert(param_name) else numel


def _param_counts(args: DeepSeekV3ModelArgs) -> dict[str, float]:
    """Total and active parameter counts of the main model and of the MTP modules, separately."""
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    expert_fraction = args.moe.top_k / args.moe.num_experts
    counts = {"total": 0, "active": 0.0, "mtp_total": 0, "mtp_active": 0.0, "engram_lookup": 0}
    for name, param in model.named_parameters():  # tied parameters are yielded once
        prefix = "mtp_" if name.startswith("mtp.") else ""
        n = param.numel()
        counts[prefix + "total"] += n
        if name == "embed.weight" and not args.tie_embeddings:
            continue
        if _is_engram_table(name):
            # A token reads one row of each of the layer's (N-1) x K heads.
            counts["engram_lookup"] += args.engram.memory_dim
            counts[prefix + "active"] += args.engram.memory_dim
        else:
            counts[prefix + "active"] += n * expert_fraction if _is_routed_expert(name) else n
    counts["head"] = model.head.weight.numel()
    return counts


def count_params(args: DeepSeekV3ModelArgs, include_mtp: bool = False) -> tuple[int, int]:
    """`(total, active)` parameter counts; MTP modules only with `include_mtp` (they are
    discarded at inference, and DeepSeek's headline 671B / 37B excludes them)."""
    c = _param_counts(args)
    total, active = c["total"], c["active"]
    if include_mtp:
        total, active = total + c["mtp_total"], active + c["mtp_active"]
    return total, round(active)


def flops_per_token(args: DeepSeekV3ModelArgs, seq_len: int, include_mtp: bool = True) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`; see the module
    docstring for the convention. `include_mtp` (default) counts the MTP modules that training runs."""
    c = _param_counts(args)
    matmul_params = c["active"] - c["engram_lookup"]
    n_attn_layers = args.n_layers
    if include_mtp and args.mtp_depth > 0:
        matmul_params += c["mtp_active"] + args.mtp_depth * c["head"]
        n_attn_layers += args.mtp_depth
    attention = 6 * n_attn_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * matmul_params + attention


# Per logit, forward + backward: max, subtract, exp, sum, log for the log-softmax, then softmax
# minus one-hot. Small next to the head's 6 x dim, but a tiny model's head is a large share of it.
CROSS_ENTROPY_FLOPS_PER_LOGIT = 8


def stage_unit_costs(args: DeepSeekV3ModelArgs, seq_len: int) -> dict[str, float | tuple[float, ...]]:
    """Training FLOPs per token of each piece a pipeline stage can hold, keyed as the fields of
    `trainer.config.pipeline_layout.PipelineCosts` (models/ does not import the trainer):
    ``embed`` (a lookup: 0), ``blocks`` (one per block: its matmuls, the active routed experts
    and its Engram projections, and the attention-score term at ``seq_len``), ``head`` (final norm,
    head and cross-entropy; a tied head too) and ``mtp`` (per module: ``eh_proj``, its norms, its
    block and a second use of the head with its cross-entropy). Without the cross-entropy they add
    up to ``flops_per_token(args, seq_len)``."""
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    pieces: dict[str, float] = {}
    for name, param in model.named_parameters():  # a tied head is yielded once, as embed.weight
        parts = name.split(".")
        if parts[0] in ("layers", "mtp"):
            piece = f"{parts[0]}.{parts[1]}"
        else:  # embed (no matmul unless tied, and then it is the head's), norm, head
            piece = "head" if parts[0] == "embed" else parts[0]
        pieces[piece] = pieces.get(piece, 0.0) + _matmul_params(args, name, param.numel())
    attention = 6 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    loss = CROSS_ENTROPY_FLOPS_PER_LOGIT * args.vocab_size
    head_use = 6 * args.dim * args.vocab_size + loss
    return {
        "embed": 0.0,
        "blocks": tuple(6 * pieces[f"layers.{i}"] + attention for i in range(args.n_layers)),
        "head": 6 * (pieces["norm"] + pieces.get("head", 0.0)) + loss,
        "mtp": tuple(6 * pieces[f"mtp.{k}"] + attention + head_use for k in range(args.mtp_depth)),
    }
