"""Context parallelism for MLA: the sequence is split over a "context" mesh ("cp", or "ep" with
EP-as-CP), and attention exchanges only MLA's *compressed* latent.

Layout (MaxText / Megatron load balancing): a sequence of length S is cut into 2 * cp chunks;
context rank r holds chunks r and 2cp-1-r, so every rank gets one early and one late chunk and
the causal attention work is equal across ranks. Everything outside attention (embedding, norms,
FFN, router, loss) is per token and runs on the local S / cp tokens unchanged; the MoE sends those
tokens through its dispatcher (with EP-as-CP the expert all-to-all runs over the same ranks).

Attention (per MLA layer): each rank computes `wkv_a` on its tokens, applies RoPE with the
tokens' *global* positions to the shared rope key, and all-gathers
`[kv latent (kv_lora_rank) | rope key (qk_rope_head_dim)]` over the context mesh: 576 values per
token for V3 instead of 128 heads x (192 + 128) = 40960 for full K/V (`benchmarks/cp_comm_bench.py`).
Every rank then up-projects the whole latent with `wkv_b` itself (its gradient stays local,
summed by FSDP like any replicated weight) and runs its local queries against all keys with a
mask built from global positions. The all-gather's backward is a reduce-scatter (funcol's
autograd all-gather), which sums every rank's contribution to each token's latent gradient.

Engram (per Engram layer): the n-gram ids are hashed from the FULL sequence before the split
(an n-gram crosses chunk borders), and `shard_batch` keeps this rank's positions of them. The
short conv (kernel k, dilation N) at position t reads t - (k-1)N .. t, so each chunk needs the
last (k-1)N conv inputs of the chunks before it: `ConvLeftContext` all-gathers only those
(2 x (k-1)N positions per rank, whole chunks when a chunk is shorter than that).

The model stays single-device: `apply_context_parallel` sets `MLA.latent_exchange` and
`Engram.context_exchange` hooks, and `ContextParallel.shard_batch` turns a full batch into this
rank's tokens, labels, positions, attention mask (and Engram ids), which the trainer passes to
`model(tokens, labels, positions=, attn_mask=, engram_ids=)`.
Losses and router counts of the shards must be summed over the "loss" mesh (dp x cp).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from models.common.attention import MLA, document_ids
from models.engram import Engram
from trainer.loss import IGNORE_INDEX


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions `[seq_len // cp_size]` held by `cp_rank`: chunks r and 2cp-1-r of 2cp."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism over {cp_size} ranks cuts the sequence into 2 x {cp_size} equal chunks; "
            f"seq_len={seq_len} is not a multiple of {2 * cp_size}"
        )
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def gathered_positions(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """`[seq_len]` global position of each key after the latent all-gather (rank-major)."""
    return torch.cat([load_balanced_positions(seq_len, cp_size, r, device) for r in range(cp_size)])


# Newer torch renamed the autograd all-gather (the old name warns); 2.11 only has the old one.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class LatentAllGather:
    """`MLA.latent_exchange` hook: all-gathers `[kv latent | rope key]` along the sequence.

    Backward is a reduce-scatter (funcol's autograd all-gather), so each rank receives the sum
    of all ranks' gradients for its own tokens' latent.
    """

    def __init__(self, group):
        self.group = group

    def __call__(self, kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv_dim = kv.shape[-1]
        latent = torch.cat([kv, k_pe.squeeze(2)], dim=-1)  # (B, S_local, kv_lora_rank + rope)
        full = _all_gather_autograd(latent, gather_dim=1, group=self.group)
        full = funcol.wait_tensor(full)  # (B, S_local * cp, kv_lora_rank + rope), rank-major
        kv, k_pe = full.split([kv_dim, full.shape[-1] - kv_dim], dim=-1)
        return kv, k_pe.unsqueeze(2)


class ConvLeftContext:
    """`Engram.context_exchange` hook: runs the causal short conv on this rank's head-tail chunks
    with their left context gathered from the ranks that hold the preceding chunks.

    Each rank contributes the last `m = min(context, chunk)` conv inputs of its two chunks; after
    the all-gather (backward: reduce-scatter, so every rank's use of a position's input sends its
    gradient home) they are put in global chunk order, and chunk c is prefixed with the last
    `context` of the ends of chunks 0..c-1 (zeros before the sequence start, as the unsplit
    conv's padding). The chunk layout is `load_balanced_positions`, as produced by `shard_batch`.
    """

    def __init__(self, group, size: int, rank: int):
        self.group = group
        self.size = size
        self.rank = rank

    def __call__(self, x: torch.Tensor, conv, context: int) -> torch.Tensor:
        """x: `[B, S_local, dim]` conv inputs; conv: `[B', context + n, dim] -> [B', n, dim]`."""
        if context == 0:  # kernel 1: nothing crosses a chunk border
            return conv(x)
        bsz, s_local, dim = x.shape
        chunk = s_local // 2
        m = min(context, chunk)
        head, tail = x[:, :chunk], x[:, chunk:]
        ends = torch.cat([head[:, chunk - m :], tail[:, chunk - m :]], dim=1)  # (B, 2m, dim)
        full = funcol.wait_tensor(_all_gather_autograd(ends, gather_dim=1, group=self.group))
        full = full.unflatten(1, (self.size, 2, m))  # rank-major: rank r holds chunks r, 2cp-1-r
        # Global chunk order: heads of ranks 0..cp-1 are chunks 0..cp-1, tails of ranks cp-1..0 the rest.
        ordered = torch.cat([full[:, :, 0], full[:, :, 1].flip(1)], dim=1)  # (B, 2cp, m, dim)
        pad = x.new_zeros(bsz, context, dim)

        def left_of(c: int) -> torch.Tensor:
            return torch.cat([pad, ordered[:, :c].flatten(1, 2)], dim=1)[:, -context:]

        head_in = torch.cat([left_of(self.rank), head], dim=1)
        tail_in = torch.cat([left_of(2 * self.size - 1 - self.rank), tail], dim=1)
        out = conv(torch.cat([head_in, tail_in], dim=0))  # both chunks in one conv call
        return torch.cat(out.split(bsz, dim=0), dim=1)


class CPBatch(NamedTuple):
    tokens: torch.Tensor
    """`[B, S / cp]` this rank's input ids."""
    labels: torch.Tensor
    """`[B, S / cp]` next-token targets of those positions."""
    positions: torch.Tensor
    """`[S / cp]` their global positions (for RoPE)."""
    attn_mask: object
    """Mask of the local queries against the gathered keys (bool `[B|1, 1, S/cp, S]` or BlockMask)."""
    mtp_labels: list[torch.Tensor]
    """Per MTP depth k, `[B, S / cp]` targets `labels[i + k + 1]` (shifted on the *full* sequence,
    then sharded; IGNORE_INDEX past the end). Score them with a plain cross-entropy, not `mtp_loss`
    (which shifts within the local shard)."""
    engram_ids: torch.Tensor | None = None
    """`[B, S / cp, L, H]` this rank's rows of the Engram ids hashed from the full sequence."""


class ContextParallel:
    """Splits batches for one context rank and builds the matching attention masks.

    Args:
        mesh: the 1-D context mesh ("cp", or "ep" with EP-as-CP).
        mask_type, eos_id, backend: the model's `attn_mask_type`, `eos_id`, `attn_backend`.
        mtp_depth: the model's MTP depth (its targets are shifted before sharding).
    """

    def __init__(self, mesh, mask_type: str, eos_id: int, backend: str, mtp_depth: int = 0):
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.mask_type = mask_type
        self.eos_id = eos_id
        self.backend = backend
        self.mtp_depth = mtp_depth

    @classmethod
    def for_model(cls, mesh, args) -> ContextParallel:
        """The splitter matching a model's `DeepSeekV3ModelArgs`."""
        return cls(mesh, args.attn_mask_type, args.eos_id, args.attn_backend, args.mtp_depth)

    def shard_batch(
        self, tokens: torch.Tensor, labels: torch.Tensor, engram_ids: torch.Tensor | None = None
    ) -> CPBatch:
        """tokens, labels: the full `[B, S]` batch (identical on every context rank); engram_ids:
        `NgramHasher(tokens)` of that full batch (n-grams cross the chunk borders), or None."""
        seq_len = tokens.shape[1]
        device = tokens.device
        q_pos = load_balanced_positions(seq_len, self.size, self.rank, device)
        kv_pos = gathered_positions(seq_len, self.size, device)
        mtp_labels = []
        for k in range(self.mtp_depth):
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, : seq_len - k - 1] = labels[:, k + 1 :]
            mtp_labels.append(shifted[:, q_pos])
        return CPBatch(
            tokens=tokens[:, q_pos],
            labels=labels[:, q_pos],
            positions=q_pos,
            attn_mask=self.attention_mask(tokens, q_pos, kv_pos),
            mtp_labels=mtp_labels,
            engram_ids=None if engram_ids is None else engram_ids[:, q_pos],
        )

    def attention_mask(self, tokens: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor):
        """Causal (and, for "block_causal", same-document) mask of queries at global positions
        `q_pos` against keys at `kv_pos`; document ids come from the full `tokens`."""
        doc = document_ids(tokens, self.eos_id) if self.mask_type == "block_causal" else None
        if self.backend == "sdpa":
            allowed = kv_pos[None, :] <= q_pos[:, None]  # (S_q, S_kv)
            if doc is None:
                return allowed[None, None]  # (1, 1, S_q, S_kv), broadcast over batch and heads
            same_doc = doc[:, q_pos][:, :, None] == doc[:, kv_pos][:, None, :]  # (B, S_q, S_kv)
            return (allowed & same_doc).unsqueeze(1)
        from torch.nn.attention.flex_attention import create_block_mask

        bsz = tokens.shape[0] if doc is not None else None

        def mask_mod(b, h, q_idx, kv_idx):
            causal = kv_pos[kv_idx] <= q_pos[q_idx]
            if doc is None:
                return causal
            return causal & (doc[b, q_pos[q_idx]] == doc[b, kv_pos[kv_idx]])

        return create_block_mask(mask_mod, bsz, None, q_pos.numel(), kv_pos.numel(), device=tokens.device)


def apply_context_parallel(model: nn.Module, context_mesh) -> ContextParallel:
    """Installs the latent all-gather in every MLA of `model` (MTP blocks included) and the conv
    left-context exchange in every Engram, and returns the batch splitter. `context_mesh` is
    `ParallelDims.mesh("context")`."""
    args = model.args
    if args.mtp_depth > 1:
        # MTP depth k > 0 embeds labels shifted by k inside the model, which a sharded
        # sequence cannot do locally.
        raise ValueError(
            f"context parallelism supports mtp_depth <= 1 (the V3 setting), got {args.mtp_depth}; "
            "set --model.mtp_depth 1 or 0"
        )
    group = context_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MLA):
            module.latent_exchange = LatentAllGather(group)
        elif isinstance(module, Engram):
            module.context_exchange = ConvLeftContext(group, context_mesh.size(), context_mesh.get_local_rank())
    return ContextParallel.for_model(context_mesh, args)
