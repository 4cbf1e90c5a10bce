"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3) with SDPA or flex-attention kernels.

Masks are built once per forward at the model level (`build_attention_mask`) and handed to every
layer, so the document ids are computed once, not once per layer:

* ``"causal"``: SDPA gets no mask and ``is_causal=True`` (lets it pick the fused kernels);
  flex gets a causal `BlockMask`.
* ``"block_causal"``: packed documents separated by an EOS token; a token attends causally inside
  its own document only. The EOS token belongs to the document it ends. SDPA gets a bool mask
  ``[B, 1, S, S]`` (True = attend); flex gets a document `BlockMask` (skips empty blocks, so it is
  the fast choice for long packed sequences on GPU).
"""

import functools
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import nn

from models.common.rope import apply_rotary_emb

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# What `build_attention_mask` returns and `MLA.forward` consumes.
AttentionMask = Union[torch.Tensor, "BlockMask", None]

ATTN_BACKENDS = ("sdpa", "flex")
ATTN_MASK_TYPES = ("causal", "block_causal")


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the packed document each token belongs to, `[B, S]` int64.

    An exclusive cumsum of EOS flags: the EOS itself still carries the id of the document it
    closes, and the next token starts a new one.
    """
    is_eos = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(is_eos, dim=1) - is_eos


@functools.cache
def _compiled_flex_attention():
    # Imported lazily: flex attention needs a recent torch and only pays off compiled on GPU.
    # Compiled once per process (flex is very slow uncompiled); the cache holds no model state.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _check_flex_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError(
            f"attn_backend='flex' needs a CUDA device, got {device.type!r}; "
            "use attn_backend='sdpa' on CPU (it supports both mask types)."
        )


def build_attention_mask(tokens: torch.Tensor, mask_type: str, eos_id: int, backend: str) -> AttentionMask:
    """The mask every attention layer of one forward uses (see the module docstring)."""
    if mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {mask_type!r}")
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    bsz, seqlen = tokens.shape
    if backend == "sdpa":
        if mask_type == "causal":
            return None
        doc = document_ids(tokens, eos_id)
        same_doc = doc[:, :, None] == doc[:, None, :]  # (B, S_q, S_kv)
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=tokens.device).tril()
        return (same_doc & causal).unsqueeze(1)  # (B, 1, S_q, S_kv), broadcast over heads

    _check_flex_device(tokens.device)
    from torch.nn.attention.flex_attention import create_block_mask

    if mask_type == "causal":

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return create_block_mask(mask_mod, None, None, seqlen, seqlen, device=tokens.device)

    doc = document_ids(tokens, eos_id)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return create_block_mask(doc_mask_mod, bsz, None, seqlen, seqlen, device=tokens.device)


def _unchanged_max_logit(q: torch.Tensor, k: torch.Tensor, running: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
    """`MLA._record_max_logit`'s branch for steps that do not record (a copy: a `torch.cond`
    branch may not return its input)."""
    return running.clone()


class MLA(nn.Module):
    """Multi-head Latent Attention.

    Queries go through a low-rank bottleneck (`wq_a` -> `q_norm` -> `wq_b`) when `q_lora_rank > 0`,
    else one projection `wq`. Keys/values are compressed to a `kv_lora_rank` latent plus one shared
    (MQA-style) rope key by `wkv_a`, normalised by `kv_norm` and expanded per head by `wkv_b`.
    With the query bottleneck, `wq_a` and `wkv_a` are one `wqkv_a` (their rows stacked: one matmul).
    Each head's query/key is `[nope | rope]` (`qk_nope_head_dim + qk_rope_head_dim`); values are
    `v_head_dim` wide.

    Args:
        softmax_scale: multiplier of q.k; the caller passes `qk_head_dim**-0.5`, times
            `yarn_softmax_factor` when the model uses YaRN, whatever the sequence length
            (`DeepSeekV3ModelArgs.softmax_scale`, see `models.common.rope`).
    """

    forward_statistics = ("max_logit",)  # models/common/forward_stats.py

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        norm_eps: float = 1e-6,
        backend: str = "sdpa",
    ):
        super().__init__()
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = softmax_scale
        self.backend = backend
        # Fetched here, not in forward: a cache lookup inside a torch.compile'd block would be traced.
        self.flex_attention = _compiled_flex_attention() if backend == "flex" else None
        # Context parallelism sets this to a callable `(kv [B, S, kv_lora_rank], k_pe [B, S, 1, rope])
        # -> the same for the whole sequence` (trainer/parallel/context_parallel.py): only the
        # compressed latent crosses ranks, queries stay local. None = single device.
        self.latent_exchange = None
        # QK-clip (trainer/optim/qk_clip.py) installs both tensors; None = no recording. On a step whose
        # `record_max_logit` (a 0-d bool tensor on the CPU) is True, `max_logit` (`[H]`, this
        # module's heads, on the activations' device) is folded with the per-head max of the
        # pre-softmax logits of every forward. Tensors, not a Python bool: compiled, the flag is
        # read by the graph (`torch.cond`) instead of guarded, so clip and non-clip steps run one
        # graph, traced once.
        self.record_max_logit: torch.Tensor | None = None
        self.max_logit: torch.Tensor | None = None

        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
            self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        else:
            # DeepSeek's wq_a and wkv_a both read x: one matmul over their stacked rows reads x once
            # (and sums one input gradient in backward). HF names split it back (state_dict_adapter).
            self.wqkv_a = nn.Linear(dim, q_lora_rank + kv_lora_rank + qk_rope_head_dim, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: AttentionMask) -> torch.Tensor:
        """x: `[B, S, dim]`; freqs_cis: `[S, qk_rope_head_dim]` rows for these positions;
        attn_mask: from `build_attention_mask` for this model's backend."""
        bsz, seqlen, _ = x.shape
        if self.q_lora_rank == 0:
            q = self.wq(x)
            kv = self.wkv_a(x)  # (B, S, kv_lora_rank + rope): latent + the single shared rope key
        else:
            q_a, kv = self.wqkv_a(x).split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q = self.wq_b(self.q_norm(q_a))
        # Heads as -1 everywhere: under tensor parallelism this module sees only its local heads.
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)

        kv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)  # (B, S, 1, rope)
        if self.latent_exchange is not None:
            kv, k_pe = self.latent_exchange(kv, k_pe)  # key length S -> S_kv (all context ranks)
        kv = self.wkv_b(self.kv_norm(kv))
        kv = kv.view(bsz, kv.shape[1], -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, S, H, qk_head_dim)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # (B, S, H, qk_head_dim)
        # (B, S, H, D) -> (B, H, S, D), the layout both kernels expect
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.max_logit is not None:
            self._record_max_logit(q, k, attn_mask)

        if self.backend == "sdpa":
            # The flash kernels (CUDA and CPU) need equal q/k/v head dims; MLA's values are
            # narrower (128 vs 192 in V3), which would drop SDPA to slower kernels or, on CPU, to the
            # math path that materialises [B, H, S, S]. Zero-padding v is exact: the padded output
            # columns are zero and sliced off.
            pad = self.qk_head_dim - self.v_head_dim
            if pad > 0:
                v = F.pad(v, (0, pad))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, scale=self.softmax_scale
            )
            if pad > 0:
                out = out[..., : self.v_head_dim]
        else:
            _check_flex_device(x.device)
            out = self.flex_attention(q, k, v, block_mask=attn_mask, scale=self.softmax_scale)
        out = out.transpose(1, 2).flatten(2)  # (B, H, S, v_head_dim) -> (B, S, H * v_head_dim)
        return self.wo(out)

    @torch.no_grad()
    def _record_max_logit(self, q: torch.Tensor, k: torch.Tensor, attn_mask: AttentionMask) -> None:
        """Folds this forward's per-head max logit into `max_logit` when `record_max_logit` is set.

        Eager, a plain `if` on the CPU flag. Compiled, a `torch.cond` on it: both branches are in
        the one graph and the flag is only read when the graph runs, so toggling it between steps
        neither recompiles nor breaks the graph (a Python bool would be guarded: a second graph).
        """
        operands = (q.detach(), k.detach(), self.max_logit)
        if attn_mask is not None:
            operands += (attn_mask,)
        if torch.compiler.is_compiling():
            folded = torch.cond(self.record_max_logit, self._fold_max_logit, _unchanged_max_logit, operands)
        elif self.record_max_logit:
            folded = self._fold_max_logit(*operands)
        else:
            return
        self.max_logit.copy_(folded)

    def _fold_max_logit(
        self, q: torch.Tensor, k: torch.Tensor, running: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`max(running, this forward's per-head max logit)`. A separate pass: the fused SDPA kernels
        never expose their logits. One sequence at a time bounds the `[H, S, S]` buffer."""
        if attn_mask is None:  # is_causal: SDPA's top-left aligned causal mask
            attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        per_sequence = []
        for b in range(q.shape[0]):
            logits = torch.matmul(q[b].float(), k[b].float().transpose(-2, -1)) * self.softmax_scale
            mask = attn_mask[b] if attn_mask.ndim == 4 else attn_mask
            per_sequence.append(logits.masked_fill(~mask, float("-inf")).amax(dim=(1, 2)))
        return torch.maximum(running, torch.stack(per_sequence).amax(dim=0))

    def init_weights(self, init_std: float) -> None:
        # torchtitan's scheme: input projections at 0.02, the output projection (which writes into
        # the residual stream) at the caller's depth-scaled std.
        in_projs = [self.wkv_b]
        in_projs += [self.wq, self.wkv_a] if self.q_lora_rank == 0 else [self.wqkv_a, self.wq_b]
        for linear in in_projs:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank > 0:
            self.q_norm.reset_parameters()
