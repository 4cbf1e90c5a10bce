"""Multi-token prediction (DeepSeek-V3 report, section 2.2).

Module k (0-based, D modules in sequence) at position i combines the previous depth's hidden
state h^k_i with the embedding of the token k + 1 steps ahead and predicts the token k + 2 steps
ahead. With inputs t_1..t_S and labels t_2..t_{S+1} (the inputs shifted left by one):

    module k input tokens at i : labels[i + k]
    mtp_logits[k] at i predicts: labels[i + k + 1]

so the loss of depth k pairs `mtp_logits[k][:, : S - k - 1]` with `labels[:, k + 1 :]`; the last
k + 1 positions have no target (`mtp_loss` does this). The modules share the model's embedding and
output head; each has its own output norm (`norm`, HF release name `shared_head.norm`).

Conventions taken from the released weights / their inference users (vLLM, SGLang) where they
differ from the report's notation:
* `eh_proj` sees `cat([enorm(embedding), hnorm(h)])`, embedding first (the report writes h first);
* the h fed to module 0 is the main model's *final-normed* hidden state (what the head sees), and
  module k > 0 gets module k - 1's normed output.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MTPModule(nn.Module):
    """One MTP depth: `enorm`, `hnorm`, `eh_proj` (2 dim -> dim), a transformer `block`, `norm`.

    Args:
        block: the transformer block of this depth (built by the model so it matches its own
            blocks; it returns `(h, aux_loss)`).
    """

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(
        self, h: torch.Tensor, emb: torch.Tensor, freqs_cis: torch.Tensor, attn_mask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h, emb: `[B, S, dim]`. Returns (normed hidden state `[B, S, dim]`, block aux loss)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # (B, S, 2 dim) -> (B, S, dim)
        x, aux_loss = self.block(x, freqs_cis, attn_mask)
        return self.norm(x), aux_loss

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()


def mtp_input_ids(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Token ids module `depth` embeds: `labels[:, depth:]`, right-padded with id 0 to `[B, S]`.

    Ignored labels (negative, e.g. -100) are replaced by id 0 so the lookup is valid; the padded
    and ignored positions only feed predictions whose targets are out of range or ignored, or
    act as ordinary context for later positions.
    """
    ids = labels.clamp(min=0)
    if depth == 0:
        return ids
    pad = ids.new_zeros(ids.shape[0], min(depth, ids.shape[1]))
    return torch.cat([ids[:, depth:], pad], dim=1)


def mtp_loss(
    mtp_logits: list[torch.Tensor], labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of all MTP depths and the number of scored targets.

    Returns `(loss_sum, n_valid)`: `loss_sum` is a 0-dim fp32 sum over depths and positions,
    `n_valid` a 0-dim int64 count of non-ignored targets over depths. Sum reduction lets the
    trainer divide by the *global* valid count (after an all-reduce over data ranks and
    gradient-accumulation micro-batches). `lambda * loss_sum / n_valid` is the report's
    `lambda / D * sum_k L_k` up to weighting each depth by its number of valid targets.
    """
    loss_sum = labels.new_zeros((), dtype=torch.float32)
    n_valid = labels.new_zeros((), dtype=torch.int64)
    seqlen = labels.shape[1]
    for k, logits in enumerate(mtp_logits):
        shift = k + 1
        if shift >= seqlen:
            break
        preds = logits[:, : seqlen - shift].flatten(0, 1).float()  # (B * (S - shift), V)
        targets = labels[:, shift:].flatten()  # (B * (S - shift),)
        loss_sum = loss_sum + F.cross_entropy(preds, targets, ignore_index=ignore_index, reduction="sum")
        n_valid = n_valid + (targets != ignore_index).sum()
    return loss_sum, n_valid
