"""Conversion between our state dict and HF / DeepSeek checkpoint names.

HF checkpoint layout (DeepSeek's released safetensors, and what `transformers` 5.x
`DeepseekV3ForCausalLM.save_pretrained` writes; in memory transformers fuses experts into
`gate_up_proj`, but it saves them per expert):

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.N.{input_layernorm, post_attention_layernorm}.weight
    model.layers.N.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}.weight
    model.layers.N.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight
    model.layers.N.mlp.{gate_proj, up_proj, down_proj}.weight              (dense layers)
    model.layers.N.mlp.gate.weight, model.layers.N.mlp.gate.e_score_correction_bias
    model.layers.N.mlp.experts.E.{gate_proj, up_proj, down_proj}.weight    (one per expert)
    model.layers.N.mlp.shared_experts.{gate_proj, up_proj, down_proj}.weight
    MTP depth k at model.layers.{n_layers + k}: the block's names above plus
    {enorm, hnorm, eh_proj, shared_head.norm}.weight and copies of the shared
    embed_tokens.weight / shared_head.head.weight.
    Engram blocks (no `transformers` model has Engram; the names follow DeepSeek's reference
    `engram_demo_v1.py` with one hyper-connection branch, hc_mult = 1, and no projection biases):
    model.layers.N.engram.{multi_head_embedding.embedding, value_proj, key_projs.0, norm1.0,
    norm2.0, short_conv.conv, short_conv.norms.0}.weight

Rope needs no permutation: HF's `rope_interleave=True` (DeepSeek's own layout) rotates the same
adjacent pairs as `models.common.rope` (see there).
"""

import dataclasses
import re

import torch

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
# Names inside one transformer block: ours -> HF (relative to `model.layers.N.`).
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "engram.table.weight": "engram.multi_head_embedding.embedding.weight",
    "engram.wv.weight": "engram.value_proj.weight",
    "engram.wk.weight": "engram.key_projs.0.weight",
    "engram.key_norm.weight": "engram.norm1.0.weight",
    "engram.query_norm.weight": "engram.norm2.0.weight",
    "engram.conv.weight": "engram.short_conv.conv.weight",
    "engram.conv_norm.weight": "engram.short_conv.norms.0.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_BLOCK_FROM_HF = {hf: ours for ours, hf in _BLOCK.items()}
# Stacked routed experts `ffn.experts.wX` [E, ...] <-> `mlp.experts.{e}.<proj>.weight`.
_EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERTS_FROM_HF = {hf: ours for ours, hf in _EXPERTS.items()}
# MTP-only names (relative to `mtp.k.` / `model.layers.{n_layers + k}.`).
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_FROM_HF = {hf: ours for ours, hf in _MTP.items()}
# With a query bottleneck our `attn.wqkv_a` stacks HF's q_a_proj and kv_a_proj_with_mqa rows
# (one matmul); the adapter maps through the two per-projection names of `_BLOCK`.
_FUSED_A = ("attn.wqkv_a.weight", ("attn.wq_a.weight", "attn.wkv_a.weight"))
# Copies of the shared embedding / head stored in every released MTP layer.
_MTP_SHARED_COPIES = {"embed_tokens.weight": "embed.weight", "shared_head.head.weight": "head.weight"}
# Our buffers with no HF counterpart: training-time routing counts, zero in a fresh load.
_COUNTS_SUFFIX = "ffn.tokens_per_expert"

_OUR_LAYER = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)\.weight")


def _format_keys(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:10])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")


class DeepSeekV3StateDictAdapter:
    """Maps between our native state dict and the HF / DeepSeek checkpoint layout.

    Args:
        args: the model's args; the expected keys and shapes come from a meta-device build.
    """

    def __init__(self, args: DeepSeekV3ModelArgs):
        self.args = args
        with torch.device("meta"):
            model = DeepSeekV3Model(args)
        self.expected_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native -> HF names. Experts are unstacked into per-expert copies (so the result can go
        to `safetensors.save_file`, which rejects tensors sharing storage); MTP layers also get
        copies of the shared embedding and head, as in DeepSeek's release."""
        unknown = [k for k in state_dict if k not in self.expected_shapes]
        if unknown:
            raise KeyError(f"to_hf: keys this model (args) does not have: {_format_keys(unknown)}")
        state_dict = self._split_fused(state_dict)
        hf: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            if key in _TOP_LEVEL:
                # A tied head is the embedding; HF stores it once (`tie_word_embeddings`).
                if not (key == "head.weight" and self.args.tie_embeddings):
                    hf[_TOP_LEVEL[key]] = tensor
                continue
            kind, index, rest = _OUR_LAYER.fullmatch(key).groups()
            layer = int(index) if kind == "layers" else self.args.n_layers + int(index)
            prefix = f"model.layers.{layer}."
            if kind == "mtp":
                if rest in _MTP:
                    hf[prefix + _MTP[rest]] = tensor
                    continue
                rest = rest.removeprefix("block.")
            if rest.endswith(_COUNTS_SUFFIX):
                continue
            if rest.startswith("ffn.experts."):
                proj = _EXPERTS[rest.removeprefix("ffn.experts.")]
                for e, expert_weight in enumerate(tensor.unbind(0)):
                    hf[f"{prefix}mlp.experts.{e}.{proj}.weight"] = expert_weight.clone()
            else:
                hf[prefix + _BLOCK[rest]] = tensor
        for k in range(self.args.mtp_depth):
            prefix = f"model.layers.{self.args.n_layers + k}."
            for hf_name, ours in _MTP_SHARED_COPIES.items():
                source = "embed.weight" if self.args.tie_embeddings else ours
                if source in state_dict:
                    hf[prefix + hf_name] = state_dict[source].clone()
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF -> native names, experts stacked to `[E, ...]`.

        Tolerated: MTP layers beyond `n_layers + mtp_depth` (e.g. the released layer 61 when our
        `mtp_depth == 0`) are skipped; when the checkpoint has *no* MTP layer at all, the `mtp.*`
        keys are simply absent from the result (load it with `strict=False` and keep the freshly
        initialised MTP weights); a zero `e_score_correction_bias` is dropped when our MoE has no
        `expert_bias`. `tokens_per_expert` counts are returned as zeros. Any other missing,
        unknown or wrongly-shaped key raises with the offending names.
        """
        scaled = [k for k in hf_state_dict if k.endswith("weight_scale_inv")]
        if scaled:
            raise ValueError(
                f"from_hf: FP8 block-quantised checkpoint (e.g. {scaled[0]}); dequantise it to "
                "bf16/fp32 first (weight * weight_scale_inv per 128x128 block)"
            )
        n_layers, mtp_depth = self.args.n_layers, self.args.mtp_depth
        native: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}  # stacked native name -> {expert id: weight}
        unknown, has_mtp = [], False
        for key, tensor in hf_state_dict.items():
            if key in _TOP_LEVEL_FROM_HF:
                native[_TOP_LEVEL_FROM_HF[key]] = tensor
                continue
            match = _HF_LAYER.fullmatch(key)
            if match is None:
                unknown.append(key)
                continue
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= n_layers + mtp_depth:
                # Extra MTP layers are dropped; an extra ordinary layer means wrong args.
                if f"model.layers.{layer}.eh_proj.weight" not in hf_state_dict:
                    unknown.append(key)
                continue
            if layer < n_layers:
                prefix = f"layers.{layer}."
            else:
                has_mtp = True
                prefix = f"mtp.{layer - n_layers}."
                if rest in _MTP_SHARED_COPIES:
                    continue
                if rest in _MTP_FROM_HF:
                    native[prefix + _MTP_FROM_HF[rest]] = tensor
                    continue
                prefix += "block."
            expert = _HF_EXPERT.fullmatch(rest)
            if expert is not None and expert.group(2) in _EXPERTS_FROM_HF:
                stacked = f"{prefix}ffn.experts.{_EXPERTS_FROM_HF[expert.group(2)]}"
                experts.setdefault(stacked, {})[int(expert.group(1))] = tensor
            elif rest in _BLOCK_FROM_HF:
                native[prefix + _BLOCK_FROM_HF[rest]] = tensor
            else:
                unknown.append(key)

        for stacked, per_expert in experts.items():
            n_experts = self.expected_shapes.get(stacked, (len(per_expert),))[0]
            absent = [e for e in range(n_experts) if e not in per_expert]
            if absent or len(per_expert) != n_experts:
                raise KeyError(
                    f"from_hf: {stacked} needs experts 0..{n_experts - 1}; missing {absent}, "
                    f"found ids {sorted(per_expert)[:10]}..."
                )
            native[stacked] = torch.stack([per_expert[e] for e in range(n_experts)])  # (E, out, in)

        self._stack_fused(native)
        self._fix_optional_keys(native, has_mtp)
        unknown += [k for k in native if k not in self.expected_shapes]
        if unknown:
            raise KeyError(f"from_hf: checkpoint keys with no place in this model: {_format_keys(unknown)}")
        missing = [k for k in self.expected_shapes if k not in native and (has_mtp or not k.startswith("mtp."))]
        if missing:
            raise KeyError(f"from_hf: keys this model needs but the checkpoint lacks: {_format_keys(missing)}")
        bad = [
            f"{k}: checkpoint {tuple(v.shape)} vs model {self.expected_shapes[k]}"
            for k, v in native.items()
            if tuple(v.shape) != self.expected_shapes[k]
        ]
        if bad:
            raise ValueError("from_hf: shape mismatch (wrong args?): " + "; ".join(bad[:10]))
        return native

    def _split_fused(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`...attn.wqkv_a.weight` -> its q_a and kv_a rows under the per-projection names (copies:
        safetensors rejects tensors that share storage)."""
        fused, (q_name, kv_name) = _FUSED_A
        out = {}
        for key, tensor in state_dict.items():
            if key.endswith(fused):
                prefix = key.removesuffix(fused)
                q, kv = tensor.split([self.args.q_lora_rank, tensor.shape[0] - self.args.q_lora_rank])
                out[prefix + q_name], out[prefix + kv_name] = q.clone(), kv.clone()
            else:
                out[key] = tensor
        return out

    def _stack_fused(self, native: dict[str, torch.Tensor]) -> None:
        """The inverse of `_split_fused`, in place, where this model stacks the two projections."""
        fused, (q_name, kv_name) = _FUSED_A
        for key in [k for k in native if k.endswith(q_name)]:
            prefix = key.removesuffix(q_name)
            if prefix + fused in self.expected_shapes and prefix + kv_name in native:
                native[prefix + fused] = torch.cat([native.pop(key), native.pop(prefix + kv_name)])

    def _fix_optional_keys(self, native: dict[str, torch.Tensor], has_mtp: bool) -> None:
        """Fill what HF does not store and drop what this model does not use (in place)."""
        for key, shape in self.expected_shapes.items():
            if key.endswith(_COUNTS_SUFFIX) and (has_mtp or not key.startswith("mtp.")):
                native[key] = torch.zeros(shape, dtype=torch.float32)
        if self.args.tie_embeddings and "head.weight" not in native and "embed.weight" in native:
            native["head.weight"] = native["embed.weight"]
        for key in [k for k in native if k.endswith("ffn.expert_bias") and k not in self.expected_shapes]:
            if native[key].count_nonzero() > 0:
                raise ValueError(
                    f"from_hf: the checkpoint has a non-zero routing bias ({key}) but this model has "
                    "no expert_bias (moe.load_balance_coeff=None); set load_balance_coeff to keep it"
                )
            del native[key]


def to_hf_config(args: DeepSeekV3ModelArgs) -> dict:
    """A `config.json` dict for HF `DeepseekV3Config` describing the same model.

    HF DeepseekV3 routes with sigmoid scores only, so softmax-routed args (the V2 shapes) raise.
    `rope_scaling` and `max_position_embeddings` are the model's own (`rope_type`, YaRN fields),
    never the training length `max_seq_len`: `args_from_hf_config` reads back the same values, and
    `transformers` computes the same rope table and softmax scale. A model with Engram gets an extra
    `"engram"` entry (the `EngramArgs` fields; `transformers` ignores it): pass it back as
    `args_from_hf_config(config, engram=config["engram"])`.
    """
    moe = args.moe
    if moe.score_func != "sigmoid":
        raise ValueError(
            f"to_hf_config: HF DeepseekV3 supports only sigmoid routing, got score_func={moe.score_func!r}"
        )
    rope_scaling = None
    if args.yarn_enabled:
        rope_scaling = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
        }
        # 0 is our mark of an absent key (transformers then leaves that factor out).
        rope_scaling.update({k: getattr(args, k) for k in ("mscale", "mscale_all_dim") if getattr(args, k)})
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "num_nextn_predict_layers": args.mtp_depth,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_group": moe.num_expert_groups,
        "topk_group": moe.num_limited_groups,
        "norm_topk_prob": moe.route_norm,
        "routed_scaling_factor": moe.route_scale,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": args.n_dense_layers,
        "q_lora_rank": args.q_lora_rank if args.q_lora_rank > 0 else None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "rms_norm_eps": args.norm_eps,
        "initializer_range": args.init_std,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "eos_token_id": args.eos_id,
        **({"engram": dataclasses.asdict(args.engram)} if args.engram is not None else {}),
    }
