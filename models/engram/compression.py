"""Engram token compression: raw tokenizer ids -> canonical ("compressed") ids.

Tokens that differ only in case, accents, Unicode compatibility form or surrounding whitespace
share one canonical id, so n-grams such as "The cat" / " the Cat" hash to the same rows (Engram
paper, section 2.2: about 23% fewer ids on a 128k vocabulary).

Normalisation of the decoded text of one id: NFKC -> NFD -> strip accents (drop combining marks,
Unicode category Mn, like HF `StripAccents`) -> lowercase -> collapse whitespace runs to one
space -> strip. Canonical ids are assigned in first-appearance order over raw ids 0..V-1.

Two keys keep information the normal form would destroy (as in DeepSeek's Engram demo code):
* a token whose normal form is empty (pure whitespace: " ", "\\n", "\\n\\n") is keyed by its raw
  text, so a newline stays distinct from a space;
* a byte-level fragment that is not valid UTF-8 on its own (its decode holds U+FFFD) keeps an
  id of its own instead of merging every fragment into one "\\ufffd" id.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

import torch

_WHITESPACE_RUN = re.compile(r"\s+")
_REPLACEMENT_CHAR = "\ufffd"


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> collapse whitespace runs -> strip."""
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    text = text.lower()
    text = _WHITESPACE_RUN.sub(" ", text)
    return text.strip()


@dataclass(frozen=True)
class TokenCompression:
    """Raw-id -> canonical-id map of one tokenizer."""

    lookup: torch.Tensor
    """`[vocab_size]` int64: canonical id of each raw id."""
    num_compressed: int
    """|V'|: number of canonical ids (the hash multipliers are bounded by INT64_MAX // |V'|)."""
    pad_id: int
    """Canonical id of the tokenizer's pad token: left padding of the n-gram windows."""

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 raw ids of any shape -> canonical ids of the same shape and device."""
        return self.lookup.to(tokens.device)[tokens]


def build_token_compression(decode: Callable[[int], str], vocab_size: int, pad_id: int) -> TokenCompression:
    """Build the compression map from a per-id `decode` (e.g. `lambda i: tokenizer.decode([i])`).

    Deterministic in the tokenizer alone, so every rank derives the same map.
    """
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id must be in [0, vocab_size={vocab_size}), got {pad_id}")
    key_to_new: dict[object, int] = {}
    lookup = torch.empty(vocab_size, dtype=torch.int64)
    for tid in range(vocab_size):
        text = decode(tid)
        if _REPLACEMENT_CHAR in text:
            key: object = ("raw-id", tid)
        else:
            norm = normalize_token_text(text)
            key = norm if norm else ("raw-text", text)
        lookup[tid] = key_to_new.setdefault(key, len(key_to_new))
    return TokenCompression(lookup=lookup, num_compressed=len(key_to_new), pad_id=int(lookup[pad_id]))
