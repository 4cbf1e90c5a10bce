"""DeepSeek-V3 transformer: MLA attention, dense then MoE FFNs, optional multi-token prediction.

Single-device module; parallelism, activation checkpointing and compile are applied from outside.
Build it on the meta device and materialise with `to_empty` + `init_weights`:

    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cuda")
    model.init_weights()

Initialisation (torchtitan's depth-scaled scheme, not DeepSeek's flat std 0.006): embedding
N(0, 1); in every block the first projections (`wq*`, `wkv_*`, FFN/expert `w1`) use std 0.02 and
`wo`, FFN/expert `w2`/`w3` and the router use `init_std / sqrt(2 * (layer_id + 1))`, so deeper
blocks start with smaller residual updates; output head truncated N(0, dim**-0.5) at 3 std;
norms 1; MTP `eh_proj` 0.02.
With tied embeddings the shared matrix gets the head's N(0, dim**-0.5), since unit-std embeddings
would give logits of std sqrt(dim).
"""

from typing import NamedTuple

import torch
from torch import nn

from models.common.attention import MLA, build_attention_mask
from models.common.ffn import FeedForward
from models.common.rope import precompute_freqs_cis
from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.mtp import MTPModule, mtp_input_ids
from models.engram import Engram, LocalEngramLookup
from models.moe import MoE


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    """`[B, S, vocab]` next-token logits (in the head's dtype)."""
    mtp_logits: list[torch.Tensor]
    """One `[B, S, vocab]` per MTP depth k, predicting `labels` shifted by k + 1 (see `mtp_loss`);
    empty in eval mode, without MTP modules, or when no labels were given."""
    aux_loss: torch.Tensor
    """0-dim fp32 sum of the MoE balance losses of all blocks that ran (MTP blocks included)."""


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attn(attn_norm(x)); out = h + ffn(ffn_norm(h))`.

    The FFN is a dense `FeedForward` for `layer_id < n_dense_layers`, else an `MoE`. Blocks listed
    in `args.engram.layer_ids` first add their Engram output: `x = x + engram(x, engram_rows)`.
    """

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn = MLA(
            dim=args.dim,
            n_heads=args.n_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            softmax_scale=args.softmax_scale,
            norm_eps=args.norm_eps,
            backend=args.attn_backend,
        )
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.ffn = MoE(args.dim, args.moe_inter_dim, args.moe)
        else:
            self.ffn = FeedForward(args.dim, args.inter_dim)
        self.weight_init_std = args.init_std / (2 * (layer_id + 1)) ** 0.5
        use_engram = args.engram is not None and layer_id in args.engram.layer_ids
        self.engram = Engram(layer_id, args.dim, args.engram, args.norm_eps) if use_engram else None

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask, engram_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: `[B, S, dim]`; engram_rows: `[B, S, H, D_h]` table rows (Engram blocks only).
        Returns (`[B, S, dim]`, 0-dim fp32 aux loss; zero for dense blocks).

        The composition of the block's phases: `attention_part`, the FFN (an `MoE`'s own phases,
        models/moe/moe.py), `tail`. The overlapped schedule (trainer/parallel/moe_overlap.py)
        calls the same phases node by node."""
        h, ffn_in = self.attention_part(x, freqs_cis, attn_mask, engram_rows)
        if self.moe_enabled:
            ffn_out, aux_loss = self.ffn(ffn_in)
        else:
            ffn_out, aux_loss = self.ffn(ffn_in), h.new_zeros((), dtype=torch.float32)
        return self.tail(h, ffn_out), aux_loss

    def attention_part(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask, engram_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the FFN: (`h`, the residual stream after the attention; `ffn_in`,
        the FFN's input `ffn_norm(h)`), both `[B, S, dim]`."""
        if self.engram is not None:
            x = x + self.engram(x, engram_rows)
        h = x + self.attn(self.attn_norm(x), freqs_cis, attn_mask)
        return h, self.ffn_norm(h)

    @staticmethod
    def tail(h: torch.Tensor, ffn_out: torch.Tensor) -> torch.Tensor:
        """The block's output: the FFN's output added to the residual stream `h`."""
        return h + ffn_out

    def init_weights(self) -> None:
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.init_weights(self.weight_init_std)
        self.ffn.init_weights(self.weight_init_std)
        if self.engram is not None:
            self.engram.init_weights(self.weight_init_std)


class DeepSeekV3Model(nn.Module):
    """Embedding -> `n_layers` blocks (`layers["0"]`..) -> norm -> head, plus `mtp` modules.

    `layers` is a ModuleDict keyed by the block index so that indices (and checkpoint names)
    survive pipeline splitting and activation-checkpoint wrapping. A pipeline stage is this model
    with the blocks of other stages deleted and `embed` / `norm` / `head` / `mtp` set to None where
    it does not hold them; it runs the pieces of `forward` it holds.
    """

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: derived from args, recomputed by init_weights after to_empty.
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = (
            nn.ModuleList(
                MTPModule(args.dim, args.norm_eps, TransformerBlock(args.n_layers + k, args))
                for k in range(args.mtp_depth)
            )
            if args.mtp_depth > 0
            else None
        )
        # Engram: the table lookup is an object (embedding parallelism swaps in a sharded one).
        # The ids come from the caller, hashed on the full sequences (trainer: ParallelStep).
        self.engram_lookup = LocalEngramLookup()

    @property
    def engram_layer_ids(self) -> tuple[int, ...]:
        """The blocks of this model (or pipeline stage) that hold an Engram layer, ascending;
        slot i of `engram_ids` is block `engram_layer_ids[i]`."""
        return tuple(layer.layer_id for layer in self.layers.values() if layer.engram is not None)

    def _precompute_freqs_cis(self, device: torch.device | str | None = None) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(
            a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_factor if a.yarn_enabled else 1.0,
            a.original_seq_len, a.beta_fast, a.beta_slow, a.rope_attention_factor, device=device,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attn_mask=None,
        engram_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """tokens: `[B, S]` int64 ids; labels: `[B, S]` next-token ids (only MTP reads them).

        positions: `[S]` int64 positions of the tokens in their sequence (default `0..S-1`);
        attn_mask: a mask for `MLA` built by the caller (default: from `tokens`). Context
        parallelism passes both for its shard of the sequence (trainer/parallel/context_parallel.py).
        engram_ids: `[B, S, L, H]` Engram table rows hashed from the FULL sequence (`NgramHasher`,
        before any context split), slot i for block `engram_layer_ids[i]`; required when the
        model has Engram layers.
        Returns a `ModelOutput`. MTP runs only in training mode and when labels are given.
        """
        return self.forward_plan(tokens, labels, positions, attn_mask, engram_ids).run()

    def forward_plan(self, tokens, labels=None, positions=None, attn_mask=None, engram_ids=None) -> "ForwardPlan":
        """`forward`'s plan (pre, blocks, head) for `forward`'s arguments."""
        return _ModelPlan(self, tokens, labels, positions, attn_mask, engram_ids)

    # The pieces of `forward` that its plans (this model's, a pipeline stage's in
    # trainer/parallel/pipeline.py) run on the modules they hold: the rope rows and the mask, a run
    # of blocks, the head with MTP.
    def rope_and_mask(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attn_mask=None):
        """(rope rows `[S, rope]` of the tokens' positions, the attention mask) as `forward` takes them."""
        seqlen = tokens.shape[1]
        if positions is None:
            if seqlen > self.freqs_cis.shape[0]:
                raise ValueError(f"sequence length {seqlen} exceeds max_seq_len={self.freqs_cis.shape[0]}")
            freqs_cis = self.freqs_cis[:seqlen]
        else:
            freqs_cis = self.freqs_cis[positions]  # (S, rope) rows of these global positions
        if attn_mask is None:
            attn_mask = build_attention_mask(tokens, self.args.attn_mask_type, self.args.eos_id, self.args.attn_backend)
        return freqs_cis, attn_mask

    def forward_blocks(
        self, h: torch.Tensor, freqs_cis: torch.Tensor, attn_mask, tokens: torch.Tensor,
        engram_ids: torch.Tensor | None = None, layers=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`layers` (default: all of `self.layers`, in order) on `h`: (`[B, S, dim]`, their summed aux loss).
        `engram_ids` slot i belongs to the i-th Engram block of `layers`."""
        layers = list(self.layers.values() if layers is None else layers)
        engram_layers = [layer for layer in layers if layer.engram is not None]
        engram_rows = self._engram_rows(engram_ids, engram_layers)
        engram_slot = {layer.layer_id: i for i, layer in enumerate(engram_layers)}
        aux_loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for layer in layers:
            if layer.engram is not None:
                h, layer_aux = layer(h, freqs_cis, attn_mask, engram_rows[engram_slot[layer.layer_id]])
            else:
                h, layer_aux = layer(h, freqs_cis, attn_mask)
            aux_loss = aux_loss + layer_aux
        return h, aux_loss

    def forward_head(
        self, h: torch.Tensor, labels: torch.Tensor | None, freqs_cis: torch.Tensor, attn_mask,
        mtp_embeds: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Final norm, head and (training with labels) the MTP depths: (logits, MTP logits, MTP aux loss).
        `mtp_embeds`: the depths' embedded inputs (`mtp_embed`) where the caller computed them."""
        h = self.norm(h)
        logits = self.head(h)
        mtp_logits = []
        aux_loss = torch.zeros((), dtype=torch.float32, device=h.device)
        if self.mtp is not None and self.training and labels is not None:
            for depth, module in enumerate(self.mtp):
                emb = mtp_embeds[depth] if mtp_embeds is not None else self.mtp_embed(labels, depth)
                h, layer_aux = module(h, emb, freqs_cis, attn_mask)
                aux_loss = aux_loss + layer_aux
                mtp_logits.append(self.head(h))
        return logits, mtp_logits, aux_loss

    def mtp_embed(self, labels: torch.Tensor, depth: int) -> torch.Tensor:
        """MTP depth `depth`'s embedded input `[B, S, dim]` (what `forward_head` runs it on)."""
        return self.embed(mtp_input_ids(labels, depth))

    def _engram_rows(self, engram_ids: torch.Tensor | None, engram_layers: list):
        """Per Engram block of `engram_layers` `[B, S, H, D_h]` rows (item i may be fetched lazily), or None."""
        tables = [layer.engram.table for layer in engram_layers]
        if not tables:
            return None
        layer_ids = [layer.layer_id for layer in engram_layers]
        if engram_ids is None:
            raise ValueError(
                f"this model has Engram layers {layer_ids}: pass "
                "engram_ids=NgramHasher(engram_args, compression, layer_ids=model.engram_layer_ids)(tokens)"
            )
        if engram_ids.shape[2] != len(tables):
            raise ValueError(
                f"engram_ids has {engram_ids.shape[2]} layer slots, these blocks have {len(tables)} Engram "
                f"layers {layer_ids}"
            )
        return self.engram_lookup(tables, engram_ids)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise parameters and recompute `freqs_cis` (on `buffer_device`, default: where the
        buffer lives now). Call after `to_empty`."""
        device = buffer_device if buffer_device is not None else self.freqs_cis.device
        self.freqs_cis = self._precompute_freqs_cis(device)
        head_std = self.args.dim**-0.5
        # A pipeline stage holds only some parts (the others are None): it initialises those.
        if self.args.tie_embeddings and self.head is not None:
            # `to_empty` materialises the two owners of a tied parameter separately: tie again.
            self.head.weight = self.embed.weight
            nn.init.normal_(self.embed.weight, mean=0.0, std=head_std)
        elif self.args.tie_embeddings and self.embed is not None:
            nn.init.normal_(self.embed.weight, mean=0.0, std=head_std)
        else:
            if self.embed is not None:
                nn.init.normal_(self.embed.weight, mean=0.0, std=1.0)
            if self.head is not None:
                nn.init.trunc_normal_(self.head.weight, mean=0.0, std=head_std, a=-3 * head_std, b=3 * head_std)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.mtp is not None:
            for module in self.mtp:
                module.init_weights()


class ForwardPlan:
    """One forward of the model, or of a pipeline stage (trainer/parallel/pipeline.py), in its
    three parts: `pre()` (the inputs to the first block's input), the `blocks` in order
    (`run_blocks`), `head(h, aux, carried)` (the last block's output and the blocks' summed
    balance losses to the outputs). `run()` is the forward; whatever runs it in pieces (the
    overlapped schedule, trainer/parallel/moe_overlap.py) calls the same parts in the same order,
    so the order is written once, by whoever gives the plan. One plan is one forward's inputs.

    `pre` also sets `freqs_cis` and `attn_mask` (what every block takes beside its input) and
    returns `(h, carried)`: `carried` are the tensors the head takes from before the blocks (the
    model's embedded MTP inputs), which a caller running the head as a node of its own detaches.
    Subclasses give `embed()` (pre's part after the rope rows and the mask) and `head`.
    """

    def __init__(
        self,
        model: DeepSeekV3Model,
        blocks,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        attn_mask,
        engram_ids: torch.Tensor | None,
    ):
        self.model = model
        self.blocks = list(blocks)
        self.tokens, self.positions, self.attn_mask, self.engram_ids = tokens, positions, attn_mask, engram_ids
        self.freqs_cis = None

    def pre(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.freqs_cis, self.attn_mask = self.model.rope_and_mask(self.tokens, self.positions, self.attn_mask)
        return self.embed()

    def embed(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def run_blocks(self, h: torch.Tensor, blocks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`blocks` (default: the plan's; else a run of them, in order) on `h`: (their output,
        their summed balance losses)."""
        engram_ids = self.engram_ids
        if blocks is None:
            blocks = self.blocks
        elif engram_ids is not None:  # slot i of engram_ids is the plan's i-th Engram block
            engram = [block.layer_id for block in self.blocks if block.engram is not None]
            engram_ids = engram_ids[:, :, [engram.index(b.layer_id) for b in blocks if b.engram is not None]]
        return self.model.forward_blocks(h, self.freqs_cis, self.attn_mask, self.tokens, engram_ids, blocks)

    def head(self, h: torch.Tensor, aux: torch.Tensor, carried: list[torch.Tensor]):
        raise NotImplementedError

    def run(self):
        h, carried = self.pre()
        h, aux = self.run_blocks(h)
        return self.head(h, aux, carried)


class _ModelPlan(ForwardPlan):
    """`DeepSeekV3Model.forward`'s plan: the embedding, every block, the head with MTP."""

    def __init__(self, model: DeepSeekV3Model, tokens, labels, positions, attn_mask, engram_ids):
        super().__init__(model, model.layers.values(), tokens, positions, attn_mask, engram_ids)
        self.labels = labels

    def embed(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = self.model
        h = model.embed(self.tokens)
        # MTP's inputs are embedded beside the tokens (carried to the head): a caller that runs the
        # head as a node of its own then meets the embedding's uses in one backward, which sums
        # their gradients as the whole forward's backward does (from two backward calls they would
        # differ in the last bit).
        depths = len(model.mtp) if model.mtp is not None and model.training and self.labels is not None else 0
        return h, [model.mtp_embed(self.labels, depth) for depth in range(depths)]

    def head(self, h: torch.Tensor, aux: torch.Tensor, carried: list[torch.Tensor]) -> ModelOutput:
        logits, mtp_logits, mtp_aux = self.model.forward_head(h, self.labels, self.freqs_cis, self.attn_mask, carried)
        return ModelOutput(logits, mtp_logits, aux + mtp_aux)
