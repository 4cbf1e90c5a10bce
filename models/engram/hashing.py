"""Multi-head n-gram hashing of canonical token ids (Engram paper, section 2.2).

For Engram layer l, with canonical ids x' (left-padded with the canonical pad id at row start):

    m_j      = 2 r_j + 1,  r_j ~ U[0, (INT64_MAX // |V'|) // 2)   (j = 0..N-1; seeded per layer)
    mix_n(t) = XOR_{j<n} (x'_{t-j} * m_j)                          (n = 2..N)
    id_{n,k} = mix_n(t) mod p_{l,n,k}                               (k = 0..K-1)

Each product is below |V'| * (2 * half + 1) <= INT64_MAX, so nothing overflows int64, and XOR of
non-negative int64 stays non-negative. The primes p are distinct across all layers, orders and
heads: walk layers (ascending), then orders, then heads, each taking the next unused prime >=
`base_size`. Row ids returned to the model are *global* rows of the layer's stacked table: head h
(order-major: h = (n - 2) * K + k) adds the offset sum(p_0..p_{h-1}).

Everything here is a pure function of `EngramArgs` and the compression map, so every rank gets
identical primes, multipliers and ids without communicating.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from models.engram.args import EngramArgs
from models.engram.compression import TokenCompression

INT64_MAX = 2**63 - 1
# Per-layer seed stride (as in DeepSeek's Engram demo): seed_l = seed + 10007 * layer_id.
_LAYER_SEED_STRIDE = 10007


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def find_primes(args: EngramArgs) -> dict[int, list[int]]:
    """{layer_id: [p_h for the (N-1)*K heads, order-major]}, all distinct and >= base_size."""
    used: set[int] = set()
    primes: dict[int, list[int]] = {}
    for layer_id in args.layer_ids:
        layer_primes = []
        for _order in range(2, args.max_ngram + 1):
            candidate = args.base_size
            for _head in range(args.heads_per_order):
                while not is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                layer_primes.append(candidate)
        primes[layer_id] = layer_primes
    return primes


def hash_multipliers(args: EngramArgs, num_compressed: int) -> dict[int, torch.Tensor]:
    """{layer_id: `[N]` int64 odd multipliers m_j = 2 r_j + 1}, from a per-layer seeded generator."""
    half_bound = max(1, (INT64_MAX // num_compressed) // 2)
    out = {}
    for layer_id in args.layer_ids:
        gen = torch.Generator(device="cpu").manual_seed(args.seed + _LAYER_SEED_STRIDE * layer_id)
        r = torch.randint(0, half_bound, (args.max_ngram,), generator=gen, dtype=torch.int64)
        out[layer_id] = 2 * r + 1
    return out


def head_offsets(primes: list[int]) -> list[int]:
    """Exclusive cumsum of the head sizes: first row of each head in the stacked table."""
    offsets, total = [], 0
    for p in primes:
        offsets.append(total)
        total += p
    return offsets


def shifted_windows(x: torch.Tensor, n: int, pad_id: int) -> list[torch.Tensor]:
    """[x_{t-0}, x_{t-1}, ..., x_{t-(n-1)}], each `[B, S]`, left-padded with `pad_id`."""
    seqlen = x.shape[1]
    out = [x]
    for k in range(1, n):
        pad = x.new_full((x.shape[0], min(k, seqlen)), pad_id)
        out.append(torch.cat([pad, x[:, : max(seqlen - k, 0)]], dim=1))
    return out


class NgramHasher(nn.Module):
    """Raw token ids `[B, S]` -> global table rows `[B, S, L, (N-1)*K]` of Engram layers.

    Slot i of dim 2 is `layer_ids[i]`: all of `args.layer_ids` by default, or an ascending subset
    (the Engram layers of one pipeline stage), hashed exactly as the whole set hashes them.
    Buffers are non-persistent (derived data), built on CPU at construction; `.to(device)` moves
    them.
    """

    def __init__(self, args: EngramArgs, compression: TokenCompression, layer_ids: tuple[int, ...] | None = None):
        super().__init__()
        layers = tuple(args.layer_ids if layer_ids is None else layer_ids)
        if not layers or [i for i in args.layer_ids if i in layers] != list(layers):
            raise ValueError(f"NgramHasher layer_ids {layers} must be a non-empty ascending subset of {args.layer_ids}")
        self.args = args
        self.layer_ids = layers
        self.num_compressed = compression.num_compressed
        self.pad_id = compression.pad_id
        # Primes are drawn over all layers (each layer's depend on the ones before it).
        primes = find_primes(args)
        mults = hash_multipliers(args, compression.num_compressed)
        heads_per_order = args.heads_per_order
        self.register_buffer("compress", compression.lookup.clone(), persistent=False)
        self.register_buffer("multipliers", torch.stack([mults[l] for l in layers]), persistent=False)  # [L, N]
        # [L, N-1, K] moduli and offsets, order-major like the table's head layout.
        self.register_buffer(
            "primes",
            torch.tensor([primes[l] for l in layers], dtype=torch.int64).view(len(layers), -1, heads_per_order),
            persistent=False,
        )
        self.register_buffer(
            "offsets",
            torch.tensor([head_offsets(primes[l]) for l in layers], dtype=torch.int64).view(
                len(layers), -1, heads_per_order
            ),
            persistent=False,
        )

    def select(self, layer_ids: tuple[int, ...]) -> "NgramHasher | None":
        """The hasher of some of these layers (a pipeline stage's), hashing them exactly as this
        one does; None for no layers."""
        if not layer_ids:
            return None
        if [i for i in self.layer_ids if i in layer_ids] != list(layer_ids):
            raise ValueError(f"NgramHasher.select: {layer_ids} must be an ascending subset of {self.layer_ids}")
        slots = [self.layer_ids.index(i) for i in layer_ids]
        sub = copy.deepcopy(self)
        sub.layer_ids = tuple(layer_ids)
        for name in ("multipliers", "primes", "offsets"):
            setattr(sub, name, getattr(self, name)[slots])
        return sub

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: `[B, S]` raw ids of the FULL sequence (before any context-parallel split)."""
        if tokens.dim() != 2:
            raise ValueError(f"NgramHasher expects [B, S] token ids, got shape {tuple(tokens.shape)}")
        x = self.compress[tokens]  # [B, S] canonical ids
        windows = shifted_windows(x, self.args.max_ngram, self.pad_id)  # N x [B, S]
        per_layer = []
        for slot in range(self.multipliers.shape[0]):
            m = self.multipliers[slot]
            mix = windows[0] * m[0]
            heads = []
            for n in range(2, self.args.max_ngram + 1):
                mix = torch.bitwise_xor(mix, windows[n - 1] * m[n - 1])  # mix_n
                rows = mix.unsqueeze(-1) % self.primes[slot, n - 2] + self.offsets[slot, n - 2]  # [B, S, K]
                heads.append(rows)
            per_layer.append(torch.cat(heads, dim=-1))  # [B, S, (N-1) K]
        return torch.stack(per_layer, dim=2)  # [B, S, L, (N-1) K]
