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
