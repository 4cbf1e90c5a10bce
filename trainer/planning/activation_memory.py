"""What a block holds for its backward, per local token, under each activation-checkpointing mode,
and what a waiting weight pass holds: the activation side of the memory estimate (trainer/planning/memory.py
adds model states, buffers and the schedule's peaks). Torch-free arithmetic on the model's shapes.
"""

from __future__ import annotations

from models.deepseek_v3 import DeepSeekV3ModelArgs
from trainer.config.activation_checkpoint import CHEAP_PARTS, recompute_module_set


def layer_activation_bytes(
    a: DeepSeekV3ModelArgs, moe: bool, tp: int, cp: int, act_bytes: int, cpu_norms: bool = False
) -> float:
    """Bytes saved for backward per *local* token of one block (no checkpointing): what autograd
    keeps, read with ``saved_tensors_hooks`` and deduplicated by storage (tests/unit/test_memory.py
    checks it on the debug model and proxy_1b, bf16 and fp32). The up-projections' outputs are
    split and concatenated into q, k and v, so SDPA's inputs stay, not wq_b's or wkv_b's outputs.

    ``cpu_norms``: ``nn.RMSNorm`` on CPU (the dry run's device too) keeps each norm's input in fp32
    (a copy below fp32) and its normalized fp32 rows, 8 bytes per element whatever the compute
    dtype; CUDA's fused kernel keeps the input and one fp32 value per row."""
    d, heads, low_cpu = a.dim, a.n_heads / tp, cpu_norms and act_bytes < 4
    norm_inputs = 2 * d / tp + a.q_lora_rank + a.kv_lora_rank  # attn_norm, ffn_norm, q_norm, kv_norm
    kept = (
        d  # attn_norm's (all-gathered) output, the down-projections' input
        + a.q_lora_rank + a.kv_lora_rank  # q_norm's and kv_norm's outputs (wq_b's and wkv_b's inputs)
        + (0 if low_cpu else a.qk_rope_head_dim)  # the rest of wkv_a's output, kept with kv_norm's input
        + heads * a.qk_head_dim  # q after the rope concat
        + cp * heads * 2 * a.qk_head_dim  # k and zero-padded v for all keys
        + heads * a.qk_head_dim + heads * a.v_head_dim  # the attention output (v's width padded), wo input
        + d  # ffn_norm's output
    )
    fp32 = heads + a.qk_rope_head_dim  # the attention's logsumexp, the rotated k_pe
    if moe:
        m = a.moe
        # Dispatched rows, w1 and w3 outputs, silu, their product, and the shared experts' four.
        kept += m.top_k * (d + 4 * a.moe_inter_dim) + 4 * m.num_shared_experts * a.moe_inter_dim / tp
        # Each routed row's output is kept in fp32 by the combine (it upcasts before weighting by
        # the router's score); the router's fp32 input (a copy below fp32), sigmoid scores and the
        # normalised top-k weights (twice).
        fp32 += m.top_k * d + (d if act_bytes < 4 else 0) + m.num_experts + 2 * m.top_k
    else:
        kept += 4 * a.inter_dim / tp
    return kept * act_bytes + fp32 * 4 + norm_inputs * (8 if cpu_norms else act_bytes)


def block_activation_bytes(
    a: DeepSeekV3ModelArgs, moe: bool, ac: str, parts: tuple[str, ...] = (), tp: int = 1, cp: int = 1,
    act_bytes: int = 4, fp32_norms: bool = False,
) -> float:
    """Bytes one block holds for its backward per *local* token between its forward and its
    backward: ``none`` what autograd saves (``layer_activation_bytes``), ``full`` its input, and
    ``modules`` (``parts``, named sets expanded) its input plus the outputs its per-op policy keeps
    (trainer/parallel/activation_checkpoint.py): every matmul's, attention kernel's and
    all-to-all's outside the chosen parts, and the norms' and experts' activation outputs unless
    chosen; the cheap ops between them (rope, concatenations, residual sums, gathers of routed
    rows, routing) are recomputed."""
    if ac == "none":
        return layer_activation_bytes(a, moe, tp, cp, act_bytes, fp32_norms)
    d, heads = a.dim, a.n_heads / tp
    if ac == "full":
        return d / tp * act_bytes
    if ac != "modules":
        raise ValueError(f"block_activation_bytes models none, full and modules, not {ac!r}")
    kept = d / tp  # the block's input, which the checkpoint keeps
    lse = 0.0  # the attention kernel's fp32 logsumexp, per head
    if a.q_lora_rank:
        kept += a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim  # wqkv_a
    else:
        kept += heads * a.qk_head_dim + a.kv_lora_rank + a.qk_rope_head_dim  # wq, wkv_a
    if "mla_up_proj" not in parts:
        kept += (heads * a.qk_head_dim if a.q_lora_rank else 0) + cp * heads * (a.qk_nope_head_dim + a.v_head_dim)
    if "core_attn" not in parts:
        kept += heads * a.qk_head_dim  # the output, v zero-padded to the query width
        lse = heads * 4
    kept += d  # wo
    if moe and "moe" not in parts:
        m = a.moe
        kept += m.num_experts + m.top_k * (2 * a.moe_inter_dim + d)  # router logits; w1, w3, w2 of each routed row
        if "moe_act" not in parts:
            kept += m.top_k * 2 * a.moe_inter_dim  # silu and the product
        if m.num_shared_experts and "shared_experts" not in parts:
            kept += 2 * m.num_shared_experts * a.moe_inter_dim / tp + d
    elif not moe and "mlp" not in parts:
        kept += 2 * a.inter_dim / tp + d
    norms = 0.0
    if "layernorm" not in parts:  # x^2, x * rstd and its product with the weight of the block's norms
        widths = 2 * d / tp + a.q_lora_rank + a.kv_lora_rank
        kept += 3 * widths
        norms = 2 * 4 * widths if fp32_norms else 0.0
    return kept * act_bytes + lse + norms


def weight_grad_output_bytes(a: DeepSeekV3ModelArgs, moe: bool, tp: int = 1, act_bytes: int = 4) -> float:
    """Bytes a waiting weight pass of one block holds per *local* token: torch's input pass keeps,
    for the weight pass, the gradient of the output of every op that uses a weight (its
    ``param_groups``' ``grads``, trainer/parallel/pipeline_step.py `cap_deferred_weight_passes`), in
    the compute dtype, whatever the checkpointing: each matmul's output width, each norm's (the
    product with its weight), the router's logits and the routed experts' rows."""
    d, heads = a.dim, a.n_heads / tp
    width = 2 * d / tp + d  # attn_norm and ffn_norm products, wo's output
    if a.q_lora_rank:
        width += 2 * a.q_lora_rank + heads * a.qk_head_dim  # wq_a, q_norm, wq_b
    else:
        width += heads * a.qk_head_dim  # wq
    width += a.kv_lora_rank + a.qk_rope_head_dim + a.kv_lora_rank  # wkv_a, kv_norm
    width += heads * (a.qk_nope_head_dim + a.v_head_dim)  # wkv_b
    if moe:
        m = a.moe
        width += m.num_experts + m.top_k * (2 * a.moe_inter_dim + d)  # router; w1, w3, w2 of each routed row
        width += (2 * m.num_shared_experts * a.moe_inter_dim / tp + d) if m.num_shared_experts else 0
    else:
        width += 2 * a.inter_dim / tp + d
    return width * act_bytes


def recomputed_parts(ac: str, recompute_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The block parts a per-op mode recomputes: ``modules`` the named ones; ``op`` keeps every
    matmul's, attention kernel's and all-to-all's output and recomputes the rest, which is
    ``modules`` with the cheap parts chosen (trainer/parallel/activation_checkpoint.py's
    ``CHEAP_PARTS``: the same policy by construction); the other modes none."""
    if ac == "modules":
        return recompute_module_set(recompute_modules)
    return CHEAP_PARTS if ac == "op" else ()


def checkpointed_blocks(ac: str, n_blocks: int, n_layers: int, selective_every: int) -> list[bool]:
    """Which of a rank's ``n_blocks`` blocks (its stages' ``n_layers`` layers in the model's order,
    then the MTP blocks) are checkpointed: none under ``none``; under ``selective`` every
    ``selective_every``-th layer of the rank counted from its first (trainer/parallel/activation_checkpoint.py
    wraps the rank's model, all its stages' layers together), never an MTP block; all under the
    other modes."""
    if ac == "none":
        return [False] * n_blocks
    if ac != "selective":
        return [True] * n_blocks
    return [i < n_layers and i % selective_every == 0 for i in range(n_blocks)]
