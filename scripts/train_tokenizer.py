"""Train the bundled byte-level BPE tokenizer ``assets/tokenizer/shakespeare.tiktoken``.

Trains with HF ``tokenizers`` (a dev-only dependency) on the bundled corpus, splitting text with
the same regex that ``trainer.data.tokenizer`` hands to tiktoken, then writes the vocabulary in
tiktoken's format: ``base64(token bytes) rank`` per line, the 256 single bytes first (rank =
byte value) and then one token per merge in training order. tiktoken applies merges by rank, so
this order reproduces the trained merge sequence. The special tokens (``<|begin_of_text|>``,
``<|end_of_text|>``, ``<|pad|>``) are not in the file: the loader appends them, which gives a
total vocabulary of ``--vocab-size``.

Training is deterministic: the same corpus gives a byte-identical file (ties between equally
frequent pairs are broken by token ids in the trainer).

Usage::

    python scripts/build_corpus.py --sdist ...   # if the corpus is missing
    python scripts/train_tokenizer.py [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
from pathlib import Path

from trainer.data.tokenizer import DEFAULT_PATTERN, DEFAULT_SPECIAL_TOKENS, Tokenizer, byte_level_to_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO_ROOT / "assets" / "corpus" / "shakespeare.jsonl.gz"
DEFAULT_OUTPUT = REPO_ROOT / "assets" / "tokenizer" / "shakespeare.tiktoken"


def read_texts(corpus: Path) -> list[str]:
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_ranks(texts: list[str], n_mergeable: int) -> list[bytes]:
    """Train a byte-level BPE and return its tokens in rank order."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(DEFAULT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_mergeable,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(hf.to_str())["model"]["merges"]

    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    for left, right in (m.split(" ", 1) if isinstance(m, str) else m for m in merges):
        token = byte_level_to_bytes(left) + byte_level_to_bytes(right)
        # A later merge can rebuild an existing token from other parts; it already has a rank.
        if token not in known:
            known.add(token)
            tokens.append(token)
    return tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--vocab-size", type=int, default=8192, help="total, special tokens included")
    args = parser.parse_args(argv)

    texts = read_texts(args.corpus)
    n_mergeable = args.vocab_size - len(DEFAULT_SPECIAL_TOKENS)
    tokens = train_ranks(texts, n_mergeable)
    if len(tokens) != n_mergeable:
        raise SystemExit(f"training produced {len(tokens)} tokens, expected {n_mergeable}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))

    tok = Tokenizer.from_tiktoken_file(args.output)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    chars = sum(len(t) for t in texts)
    print(
        f"wrote {args.output}: {len(tokens)} mergeable tokens + {len(DEFAULT_SPECIAL_TOKENS)} special = "
        f"{tok.vocab_size}; corpus {chars:,} chars -> {n_tokens:,} tokens ({chars / n_tokens:.2f} chars/token)"
    )


if __name__ == "__main__":
    main()
