"""Byte-level BPE tokenizer on top of ``tiktoken``.

Two sources are supported:

* a ``.tiktoken`` file (``base64(token bytes) rank`` per line, e.g. our bundled
  ``assets/tokenizer/shakespeare.tiktoken``); special tokens are appended after the mergeable
  ranks, and the pre-tokenizer regex is given by the caller (default: the GPT-4 style pattern
  that ``scripts/train_tokenizer.py`` trains with);
* a Hugging Face ``tokenizer.json`` of a byte-level BPE (GPT-2, Llama 3, DeepSeek-V3, ...),
  converted on load: tiktoken's token ids *are* its merge ranks, so the conversion checks that
  the HF merge order agrees with the vocabulary ids.

Special-token strings inside ordinary text are always encoded as text: data can never inject a
BOS/EOS. Special ids are only produced through ``bos=``/``eos=`` or ``bos_id``/``eos_id``.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import tiktoken

# GPT-4 (cl100k) style split, in the spelling Llama 3 uses: without possessive quantifiers, so
# that the Oniguruma engine of HF `tokenizers` (used to train) and tiktoken's fancy-regex split
# text identically.
DEFAULT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's split, applied by HF's ByteLevel pre-tokenizer when `use_regex` is true.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
PAD = "<|pad|>"
DEFAULT_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, PAD)

# Names used by common HF tokenizers, most specific first.
_BOS_NAMES = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<|startoftext|>", "<s>", "<|endoftext|>")
_EOS_NAMES = ("<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>", "<|endoftext|>")
_PAD_NAMES = ("<｜▁pad▁｜>", "<|pad|>", "<|finetune_right_pad_id|>", "<pad>", "[PAD]")


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable unicode map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def byte_level_to_bytes(token: str) -> bytes:
    """Bytes of a byte-level BPE vocabulary entry such as ``'Ġthe'`` -> ``b' the'``."""
    decoder = byte_level_decoder()
    try:
        return bytes(decoder[ch] for ch in token)
    except KeyError as e:
        raise ValueError(
            f"vocabulary entry {token!r} has character {e.args[0]!r} outside the byte-level alphabet; "
            "only byte-level BPE tokenizers (GPT-2 / Llama 3 / DeepSeek-V3 style) can be converted"
        ) from None


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    try:
        text = Path(path).read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a .tiktoken file ('base64(token) rank' lines): byte {e.start} is not ASCII") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line!r} ({e})") from None
    return ranks


class Tokenizer:
    """A tiktoken ``Encoding`` plus the BOS/EOS/PAD conventions the data pipeline needs."""

    def __init__(
        self, encoding: tiktoken.Encoding, *, bos_token: str, eos_token: str, pad_token: str | None = None
    ):
        specials = encoding.special_tokens_set
        for role, name in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            if name is not None and name not in specials:
                raise ValueError(f"{role} token {name!r} is not a special token; known: {sorted(specials)}")
        self._encoding = encoding
        self._bos_id = encoding.encode_single_token(bos_token)
        self._eos_id = encoding.encode_single_token(eos_token)
        self._pad_id = None if pad_token is None else encoding.encode_single_token(pad_token)

    @classmethod
    def from_tiktoken_file(
        cls,
        path: str | Path,
        pattern: str = DEFAULT_PATTERN,
        special_tokens: Sequence[str] | None = None,
        *,
        bos_token: str = BEGIN_OF_TEXT,
        eos_token: str = END_OF_TEXT,
        pad_token: str | None = PAD,
    ) -> Tokenizer:
        """Load mergeable ranks from ``path`` and append ``special_tokens`` after them, in order.

        With the default special tokens the vocabulary is ``len(ranks) + 3``; pass
        ``pad_token=None`` when the given special tokens have no pad token.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken file not found: {path}")
        ranks = load_tiktoken_ranks(path)
        if not ranks:
            raise ValueError(f"{path} holds no tokens")
        specials = list(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        first = max(ranks.values()) + 1
        encoding = tiktoken.Encoding(
            name=path.stem,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={name: first + i for i, name in enumerate(specials)},
        )
        return cls(encoding, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)

    @classmethod
    def from_hf_tokenizer_json(
        cls,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> Tokenizer:
        """Convert a HF byte-level BPE ``tokenizer.json`` for use with tiktoken.

        * Ranks are the HF vocabulary ids; every merge must create a token whose id is larger than
          its parts' ids, in increasing id order (tiktoken applies merges by rank).
        * All ``added_tokens`` become special tokens (never matched inside text).
        * BOS/EOS/PAD: the arguments, else ``tokenizer_config.json`` next to the file, else
          well-known names (``<｜begin▁of▁sentence｜>``, ``<|begin_of_text|>``, ``<s>``, ...).
          Without a pad token ``pad_id`` falls back to ``eos_id``.
        * Pre-tokenizer: the regex of the ``Split`` step(s). Limitation: a ``Sequence`` of several
          Splits (DeepSeek-V3: digits, then CJK runs, then the main pattern) is applied by HF one
          after another, but tiktoken takes one regex, so they are joined as alternatives in
          order. That is exact unless a later pattern would match across text an earlier one
          isolates (e.g. Latin letters directly followed by CJK in DeepSeek-V3's pattern), where
          the ids may differ from HF's; decoding stays lossless either way.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
            raise ValueError(f"{path} is not a HF tokenizer.json: {e}") from None
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: only BPE models can be converted, got model type {model.get('type')!r}")
        if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError(f"{path}: byte_fallback / subword prefix or suffix BPE is not byte-level BPE")
        normalizer = spec.get("normalizer")
        if normalizer and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
            raise ValueError(f"{path}: normalizer {normalizer.get('type')!r} cannot be reproduced by tiktoken")

        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        ranks = _ranks_from_hf_model(model, skip=set(added), source=path)
        overlap = set(added.values()) & set(ranks.values())
        if overlap:
            raise ValueError(f"{path}: added tokens share ids with the BPE vocabulary: {sorted(overlap)[:5]}")
        pattern = _pattern_from_pre_tokenizer(spec.get("pre_tokenizer"), source=path)

        config = _read_tokenizer_config(path.parent / "tokenizer_config.json")
        bos = bos_token or _pick_special(config.get("bos_token"), _BOS_NAMES, added)
        eos = eos_token or _pick_special(config.get("eos_token"), _EOS_NAMES, added)
        pad = pad_token or _pick_special(config.get("pad_token"), _PAD_NAMES, added)
        if bos is None or eos is None:
            raise ValueError(
                f"{path}: could not identify the BOS/EOS tokens among the added tokens "
                f"{sorted(added)[:20]}; pass bos_token=... and eos_token=... explicitly"
            )
        encoding = tiktoken.Encoding(
            name=path.parent.name or "hf", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
        )
        return cls(encoding, bos_token=bos, eos_token=eos, pad_token=pad)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the embedding table size)."""
        return self._encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """The pad token's id, or ``eos_id`` for tokenizers without one (packed batches need no
        padding; the id only matters to callers that pad, and they mask it out of the loss)."""
        return self._eos_id if self._pad_id is None else self._pad_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._encoding.encode_ordinary(text)
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Iterable[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """Like ``encode`` for many texts; tiktoken encodes them in parallel threads."""
        return [self._wrap(ids, bos, eos) for ids in self._encoding.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids.insert(0, self._bos_id)
        if eos:
            ids.append(self._eos_id)
        return ids


def build_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a ``.tiktoken`` file, a ``tokenizer.json``, or a directory holding one.

    A relative path that does not exist from the working directory is also looked up relative to
    the repository root, so ``assets/tokenizer/shakespeare.tiktoken`` works from any directory.
    """
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        repo_path = Path(__file__).resolve().parents[2] / path
        if repo_path.exists():
            path = repo_path
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return Tokenizer.from_hf_tokenizer_json(path / "tokenizer.json")
        candidates = sorted(path.glob("*.tiktoken"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "neither"
            raise ValueError(
                f"tokenizer directory {path} must contain tokenizer.json or exactly one *.tiktoken file "
                f"(found: {found})"
            )
        path = candidates[0]
    if path.suffix == ".tiktoken":
        return Tokenizer.from_tiktoken_file(path)
    if path.suffix == ".json":
        return Tokenizer.from_hf_tokenizer_json(path)
    raise ValueError(f"unknown tokenizer format {path}: expected a .tiktoken file or a HF tokenizer.json")


def _ranks_from_hf_model(model: dict, *, skip: set[str], source: Path) -> dict[bytes, int]:
    vocab: dict[str, int] = {tok: i for tok, i in model["vocab"].items() if tok not in skip}
    ranks: dict[bytes, int] = {}
    for tok, i in vocab.items():
        b = byte_level_to_bytes(tok)
        if b in ranks:
            raise ValueError(f"{source}: ids {ranks[b]} and {i} both decode to {b!r}")
        ranks[b] = i
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{source}: the vocabulary lacks single-byte tokens for bytes {missing[:10]}")

    last_new = -1
    seen: set[int] = set()
    for n, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        try:
            ids = vocab[left], vocab[right], vocab[left + right]
        except KeyError as e:
            raise ValueError(f"{source}: merge #{n} {left!r} + {right!r} uses unknown token {e.args[0]!r}") from None
        a, b, result = ids
        if result <= max(a, b):
            raise ValueError(
                f"{source}: merge #{n} {left!r} + {right!r} -> id {result} is not above its parts' ids "
                f"({a}, {b}); tiktoken ranks merges by id, so this tokenizer cannot be converted"
            )
        # A merge may re-create a token an earlier merge made (another pair of parts): it keeps
        # the earlier rank in tiktoken, matching when HF would first have produced it.
        if result in seen:
            continue
        if result < last_new:
            raise ValueError(
                f"{source}: merge #{n} {left!r} + {right!r} -> id {result} comes after a merge that made "
                f"id {last_new}; tiktoken needs merges in increasing id order"
            )
        seen.add(result)
        last_new = result
    return ranks


def _pattern_from_pre_tokenizer(pre: dict | None, *, source: Path) -> str:
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    patterns: list[str] = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            if str(step.get("behavior", "")).lower() != "isolated" or step.get("invert"):
                raise ValueError(f"{source}: only Split(behavior='Isolated', invert=False) is supported, got {step}")
            pat = step["pattern"]
            patterns.append(pat["Regex"] if "Regex" in pat else re.sub(r"([\\.+*?()|\[\]{}^$#&\-~])", r"\\\1", pat["String"]))
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise ValueError(f"{source}: ByteLevel(add_prefix_space=True) cannot be reproduced by tiktoken")
            if step.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        else:
            raise ValueError(f"{source}: pre-tokenizer {kind!r} is not supported (only Split and ByteLevel)")
    if not patterns:
        raise ValueError(f"{source}: no Split or ByteLevel(use_regex=True) pre-tokenizer found to take the regex from")
    return "|".join(patterns)


def _read_tokenizer_config(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _pick_special(configured: str | dict | None, names: Sequence[str], added: dict[str, int]) -> str | None:
    if isinstance(configured, dict):
        configured = configured.get("content")
    if configured in added:
        return configured
    return next((name for name in names if name in added), None)
