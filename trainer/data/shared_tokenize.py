"""Tokenisation shared by the ranks of a job.

Every rank walks the same *global* document stream (the data order does not depend on the
layout, trainer/data/datasets.py), but a rank only needs the tokens of its own rows. Where a
row starts in the packed stream depends on the token count of every earlier document, so some
rank has to tokenise every document. Rather than each rank tokenising the whole global batch
(``world`` times the work), the documents of a chunk are split round-robin over the ranks,
each rank encodes its share, and the token arrays are all-gathered over a gloo group: the
tokeniser's cost per rank is its ``1 / world`` share, and the exchange moves int32 arrays
(4 bytes per token), which costs less than encoding the text again. Reading the documents'
text (not their tokens) stays on every rank: it is what locates the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch.distributed as dist

from trainer.data.tokenizer import Tokenizer


class SharedTokenizer:
    """Encodes documents as ``[BOS] doc [EOS]`` int32 arrays, the work split over ``group``.

    Args:
        tokenizer: the run's tokenizer (the same on every rank).
        group: a gloo process group of all the ranks that read this stream (every rank calls
            ``encode`` with the same documents in the same order), or None for one process.
    """

    def __init__(self, tokenizer: Tokenizer, group: dist.ProcessGroup | None = None):
        self.tokenizer = tokenizer
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        own = self.tokenizer.encode_batch(list(texts[self.rank :: self.world]), bos=True, eos=True)
        mine = [np.asarray(ids, dtype=np.int32) for ids in own]
        if self.world == 1:
            return mine
        shares: list[list[np.ndarray] | None] = [None] * self.world
        dist.all_gather_object(shares, mine, group=self.group)
        out: list[np.ndarray] = [np.empty(0, dtype=np.int32)] * len(texts)
        for r, share in enumerate(shares):
            out[r :: self.world] = share
        return out
