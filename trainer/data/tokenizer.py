"""The run's tokenizer: ids, BOS/EOS/pad and the special-token mode the data pipeline uses.

Each format is encoded by the library that defines it, so the ids are exactly those a
checkpoint was trained with:

* a ``.tiktoken`` file (``base64(token bytes) rank`` per line, e.g. our bundled
  ``assets/tokenizer/shakespeare.tiktoken``) by ``tiktoken``; special tokens are appended after
  the mergeable ranks, and the pre-tokenizer regex is given by the caller (default: the GPT-4
  style pattern that ``scripts/train_tokenizer.py`` trains with);
* a Hugging Face ``tokenizer.json`` (GPT-2, Llama 3, DeepSeek-V2/V3, ...) by ``tokenizers``
  (``hf_tokenizer.py``), with BOS/EOS/pad from the ``tokenizer_config.json`` beside it.

Special-token strings inside a document are text by default: data cannot inject a BOS/EOS, and
special ids only come from ``bos=``/``eos=``. With ``parse_special_tokens`` (for data already in
a chat template) they are parsed to their ids, and a document that already starts with BOS or
ends with EOS does not get a second one.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import tiktoken

from trainer.data.hf_tokenizer import HFBackend

# GPT-4 (cl100k) style split, in the spelling Llama 3 uses: without possessive quantifiers, so
# that the Oniguruma engine of HF `tokenizers` (used to train) and tiktoken's fancy-regex split
# text identically.
DEFAULT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
PAD = "<|pad|>"
DEFAULT_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, PAD)


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
        raise ValueError(
            f"{path} is not a .tiktoken file ('base64(token) rank' lines): byte {e.start} is not ASCII"
        ) from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line!r} ({e})") from None
    return ranks


class _TiktokenBackend:
    """A tiktoken ``Encoding`` in one special-token mode."""

    def __init__(self, encoding: tiktoken.Encoding, *, parse_special_tokens: bool):
        self._encoding = encoding
        self._parse = parse_special_tokens
        self.vocab_size = encoding.n_vocab

    def token_id(self, name: str) -> int | None:
        if name not in self._encoding.special_tokens_set:
            return None
        return self._encoding.encode_single_token(name)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """tiktoken encodes the batch in parallel threads."""
        if self._parse:
            return self._encoding.encode_batch(texts, allowed_special="all")
        return self._encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


class Tokenizer:
    """A tiktoken or ``tokenizers`` backend plus the BOS/EOS/PAD conventions the data pipeline needs."""

    def __init__(
        self,
        backend: _TiktokenBackend | HFBackend,
        *,
        bos_token: str,
        eos_token: str,
        pad_token: str | None = None,
        parse_special_tokens: bool = False,
    ):
        ids = {}
        for role, name in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            ids[role] = None if name is None else backend.token_id(name)
            if name is not None and ids[role] is None:
                raise ValueError(f"{role} token {name!r} is not a special token of this tokenizer")
        self._backend = backend
        self._bos_id, self._eos_id, self._pad_id = ids["bos"], ids["eos"], ids["pad"]
        self.parse_special_tokens = parse_special_tokens

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
        parse_special_tokens: bool = False,
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
        return cls(
            _TiktokenBackend(encoding, parse_special_tokens=parse_special_tokens),
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            parse_special_tokens=parse_special_tokens,
        )

    @classmethod
    def from_hf_tokenizer_json(
        cls,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        parse_special_tokens: bool = False,
    ) -> Tokenizer:
        """A HF ``tokenizer.json``, encoded by ``tokenizers`` (``hf_tokenizer.py``).

        BOS/EOS/PAD: the arguments, else ``tokenizer_config.json`` next to the file, else
        well-known names (``<｜begin▁of▁sentence｜>``, ``<|begin_of_text|>``, ``<s>``, ...).
        Without a pad token ``pad_id`` falls back to ``eos_id``.
        """
        backend = HFBackend(path, parse_special_tokens=parse_special_tokens)
        bos, eos, pad = backend.special_names()
        bos, eos, pad = bos_token or bos, eos_token or eos, pad_token or pad
        if bos is None or eos is None:
            raise ValueError(
                f"{path}: could not identify the BOS/EOS tokens (no tokenizer_config.json beside it names them, "
                "and none of the usual names is a special token); pass bos_token=... and eos_token=... explicitly"
            )
        return cls(backend, bos_token=bos, eos_token=eos, pad_token=pad, parse_special_tokens=parse_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the embedding rows the ids need)."""
        return self._backend.vocab_size

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
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: Iterable[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """Like ``encode`` for many texts; both backends encode a batch in parallel threads."""
        return [self._wrap(ids, bos, eos) for ids in self._backend.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids))

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        # A parsed document may carry its own BOS/EOS (a chat template's): not doubled.
        if bos and not (self.parse_special_tokens and ids[:1] == [self._bos_id]):
            ids.insert(0, self._bos_id)
        if eos and not (self.parse_special_tokens and ids[-1:] == [self._eos_id]):
            ids.append(self._eos_id)
        return ids


def build_tokenizer(path: str | Path, *, parse_special_tokens: bool = False) -> Tokenizer:
    """Load a tokenizer from a ``.tiktoken`` file, a ``tokenizer.json``, or a directory holding one.

    A relative path that does not exist from the working directory is also looked up relative to
    the repository root, so ``assets/tokenizer/shakespeare.tiktoken`` works from any directory.
    ``parse_special_tokens``: special-token strings inside texts become their ids (default: text).
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
            return Tokenizer.from_hf_tokenizer_json(path / "tokenizer.json", parse_special_tokens=parse_special_tokens)
        candidates = sorted(path.glob("*.tiktoken"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "neither"
            raise ValueError(
                f"tokenizer directory {path} must contain tokenizer.json or exactly one *.tiktoken file "
                f"(found: {found})"
            )
        path = candidates[0]
    if path.suffix == ".tiktoken":
        return Tokenizer.from_tiktoken_file(path, parse_special_tokens=parse_special_tokens)
    if path.suffix == ".json":
        return Tokenizer.from_hf_tokenizer_json(path, parse_special_tokens=parse_special_tokens)
    raise ValueError(f"unknown tokenizer format {path}: expected a .tiktoken file or a HF tokenizer.json")
