"""A Hugging Face ``tokenizer.json``, encoded by the library that defines the format: ``tokenizers``.

Reproducing a tokenizer.json with another engine is not exact: DeepSeek-V3's pre-tokenizer is a
``Sequence`` of three ``Split`` steps applied one after another (digit groups, then CJK runs, then
the main pattern), and no single regex splits text as they do (joined into one alternation,
``"return  12"`` became ``[3916, 223, 223, 736]`` instead of DeepSeek's ``[3916, 262, 736]``). So
the file's own normalizer, pre-tokenizer, model and decoder run, in Rust, and the ids are the
ones the checkpoint was trained on by construction.

Special tokens inside a document's text:

* text (the default): ``encode_special_tokens`` is set, ``tokenizers``' own switch that encodes
  the strings of *special* added tokens (BOS, EOS, ...) as ordinary text, so raw data cannot
  inject a document boundary. Added tokens that the file marks ``"special": false`` (DeepSeek-V3's
  chat markers such as ``<｜User｜>``) are vocabulary entries ``tokenizers`` always matches;
  they are matched in both modes, as in ``transformers``.
* parsed: special-token strings become their ids (data already in a chat template).

The template post-processor (which would add BOS itself) is not applied: the data pipeline adds
BOS/EOS around each document.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

# Names used by common HF tokenizers, most specific first, for files without a
# tokenizer_config.json beside them.
BOS_NAMES = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<|startoftext|>", "<s>", "<|endoftext|>")
EOS_NAMES = ("<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>", "<|endoftext|>")
PAD_NAMES = ("<｜▁pad▁｜>", "<|pad|>", "<|finetune_right_pad_id|>", "<pad>", "[PAD]")


class HFBackend:
    """Encoding and decoding of one ``tokenizer.json`` with ``tokenizers``, in one special-token mode."""

    def __init__(self, path: str | Path, *, parse_special_tokens: bool):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {self.path}")
        try:
            self._hf = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable or invalid files
            raise ValueError(f"{self.path} is not a tokenizer.json that `tokenizers` can load: {e}") from None
        self._hf.encode_special_tokens = not parse_special_tokens
        vocab = self._hf.get_vocab(with_added_tokens=True)
        # Ids may have gaps (added tokens placed past the model's vocabulary): the embedding needs
        # a row for the largest id.
        self.vocab_size = max(vocab.values()) + 1
        self._specials = {t.content for t in self._hf.get_added_tokens_decoder().values() if t.special}

    def token_id(self, name: str) -> int | None:
        """Id of the special (or any vocabulary) token ``name``, None if the file has no such token."""
        return self._hf.token_to_id(name)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``tokenizers`` encodes the batch on its own thread pool (Rayon)."""
        return [e.ids for e in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=False)

    def special_names(self, config_dir: Path | None = None) -> tuple[str | None, str | None, str | None]:
        """BOS, EOS and pad token names: ``tokenizer_config.json`` beside the file, else the
        well-known names among the file's tokens."""
        config = read_tokenizer_config((config_dir or self.path.parent) / "tokenizer_config.json")
        return tuple(
            self._pick(config.get(key), names)
            for key, names in (("bos_token", BOS_NAMES), ("eos_token", EOS_NAMES), ("pad_token", PAD_NAMES))
        )

    def _pick(self, configured: str | dict | None, names: Sequence[str]) -> str | None:
        if isinstance(configured, dict):  # {"__type": "AddedToken", "content": ...}
            configured = configured.get("content")
        if configured is not None and self.token_id(configured) is not None:
            return configured
        return next((name for name in names if name in self._specials), None)


def read_tokenizer_config(path: Path) -> dict:
    """``tokenizer_config.json`` as a dict ({} when absent); a file that does not parse is named."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from None
