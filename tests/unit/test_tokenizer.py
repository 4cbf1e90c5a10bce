"""Tokenizer: bundled tiktoken vocabulary, round trips, specials, HF tokenizer.json through `tokenizers`."""

import gzip
import json
from pathlib import Path

import pytest

from trainer.data.tokenizer import (
    DEFAULT_PATTERN,
    Tokenizer,
    build_tokenizer,
    load_tiktoken_ranks,
)

REPO = Path(__file__).resolve().parents[2]
TIKTOKEN_FILE = REPO / "assets" / "tokenizer" / "shakespeare.tiktoken"
CORPUS = REPO / "assets" / "corpus" / "shakespeare.jsonl.gz"

TRICKY = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing   ",
    "tabs\tand\r\nwindows\rnewlines\n\n\n   \n",
    "x" * 1000 + " " * 300,
    "naïve café — “quotes” ½ ∑ 中文字符 日本語 한국어 עברית العربية 🙂👍🏽 e\u0301",
    "numbers 1234567 3.14159 1,000,000",
    "<|begin_of_text|>",
    "text <|end_of_text|> more <|pad|>",
    "<｜begin▁of▁sentence｜><s></s>[PAD]",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(TIKTOKEN_FILE)


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_vocab_and_special_ids(tok):
    n_mergeable = len(load_tiktoken_ranks(TIKTOKEN_FILE))
    assert n_mergeable == 8192 - 3
    assert tok.vocab_size == 8192
    specials = [tok.bos_id, tok.eos_id, tok.pad_id]
    assert len(set(specials)) == 3
    assert all(n_mergeable <= i < tok.vocab_size for i in specials)


def test_round_trip_corpus(tok, corpus_texts):
    sample = corpus_texts[::15]
    for text, ids in zip(sample, tok.encode_batch(sample)):
        assert tok.decode(ids) == text
        assert ids == tok.encode(text)
    # The tokenizer was trained on this corpus: it should compress it well.
    assert sum(map(len, sample)) / sum(len(ids) for ids in tok.encode_batch(sample)) > 3.0


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_strings(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_strings_are_ordinary_text(tok):
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    for text in ("<|begin_of_text|>", "a<|end_of_text|>b", "<|pad|>"):
        assert not specials & set(tok.encode(text))
    assert tok.encode("") == []
    assert tok.encode("", bos=True, eos=True) == [tok.bos_id, tok.eos_id]
    assert tok.encode("hi", bos=True, eos=True) == [tok.bos_id, *tok.encode("hi"), tok.eos_id]
    assert tok.encode_batch(["a", ""], bos=True) == [[tok.bos_id, *tok.encode("a")], [tok.bos_id]]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_custom_special_tokens():
    tok = Tokenizer.from_tiktoken_file(
        TIKTOKEN_FILE, special_tokens=["<s>", "</s>"], bos_token="<s>", eos_token="</s>", pad_token=None
    )
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (8189, 8190, 8191)
    assert tok.pad_id == tok.eos_id
    with pytest.raises(ValueError, match="not a special token"):
        Tokenizer.from_tiktoken_file(TIKTOKEN_FILE, special_tokens=["<s>"], bos_token="<s>", eos_token="</s>")


def test_build_tokenizer_paths(tmp_path, monkeypatch):
    # Repo-relative paths work from any working directory.
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer("assets/tokenizer/shakespeare.tiktoken").vocab_size == 8192
    # A directory with exactly one .tiktoken file.
    (tmp_path / "tk").mkdir()
    (tmp_path / "tk" / "v.tiktoken").write_bytes(TIKTOKEN_FILE.read_bytes())
    assert build_tokenizer(tmp_path / "tk").vocab_size == 8192

    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_tokenizer(tmp_path / "does-not-exist.tiktoken")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="tokenizer.json or exactly one"):
        build_tokenizer(tmp_path / "empty")
    (tmp_path / "vocab.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown tokenizer format"):
        build_tokenizer(tmp_path / "vocab.bin")
    (tmp_path / "bad.tiktoken").write_text("not-base64!! x\n")
    with pytest.raises(ValueError, match="bad.tiktoken:1"):
        build_tokenizer(tmp_path / "bad.tiktoken")


# --- HF tokenizer.json (`tokenizers`) ----------------------------------------------------------------

DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
COMPARE = [
    "To be, or not to be, that is the question:",
    "  Whether 'tis nobler in the mind\n\n\tto suffer 12345 slings",
    "naïve café 中文 🙂 e\u0301 — ½",
    "I'LL, you've, we'd... ok?!  \r\n done",
]


def _train_hf(texts, *, splits, specials, vocab_size=700):
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    hf.decoder = decoders.ByteLevel()  # as real byte-level BPE files have: bytes back to text
    return hf


@pytest.mark.parametrize(
    "splits,specials",
    [
        ([DEFAULT_PATTERN], ["<|begin_of_text|>", "<|end_of_text|>"]),
        # DeepSeek-V3 style: digit groups split first, then the main pattern; DeepSeek's names.
        ([r"\p{N}{1,3}", DEFAULT_PATTERN], [DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜▁pad▁｜>"]),
    ],
)
def test_hf_tokenizer_json_matches_tokenizers(tmp_path, corpus_texts, splits, specials):
    hf = _train_hf(corpus_texts[:40], splits=splits, specials=specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(tmp_path)
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.bos_id == hf.token_to_id(specials[0])
    assert tok.eos_id == hf.token_to_id(specials[1])
    expected_pad = specials[2] if len(specials) > 2 else specials[1]
    assert tok.pad_id == hf.token_to_id(expected_pad)
    for text in [*COMPARE, *corpus_texts[40:45]]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    # `tokenizers` matches special tokens inside text by default; we encode them as text unless asked.
    inside = f"x {specials[0]} y"
    assert tok.bos_id in hf.encode(inside, add_special_tokens=False).ids
    assert tok.bos_id not in tok.encode(inside) and tok.decode(tok.encode(inside)) == inside
    parsed = build_tokenizer(tmp_path, parse_special_tokens=True)
    assert parsed.encode(inside) == hf.encode(inside, add_special_tokens=False).ids


def test_hf_tokenizer_json_uses_tokenizer_config_and_explicit_names(tmp_path, corpus_texts):
    hf = _train_hf(corpus_texts[:10], splits=[DEFAULT_PATTERN], specials=["<A>", "<B>"], vocab_size=300)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    with pytest.raises(ValueError, match="pass bos_token"):
        Tokenizer.from_hf_tokenizer_json(path)
    tok = Tokenizer.from_hf_tokenizer_json(path, bos_token="<B>", eos_token="<A>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 0, 0)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<A>"}, "eos_token": "<B>", "pad_token": None})
    )
    tok = Tokenizer.from_hf_tokenizer_json(path)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    with pytest.raises(ValueError, match="not a special token of this tokenizer"):
        Tokenizer.from_hf_tokenizer_json(path, bos_token="<C>")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_hf_tokenizer_json(path)


def test_hf_tokenizer_json_bad_files(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer.json that `tokenizers` can load"):
        Tokenizer.from_hf_tokenizer_json(path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        Tokenizer.from_hf_tokenizer_json(tmp_path / "missing" / "tokenizer.json")


def test_parse_special_tokens_tiktoken(tok):
    parsed = build_tokenizer(TIKTOKEN_FILE, parse_special_tokens=True)
    text = "<|begin_of_text|>hi<|pad|>there<|end_of_text|>"
    hi, there = tok.encode("hi"), tok.encode("there")
    assert parsed.encode(text) == [tok.bos_id, *hi, tok.pad_id, *there, tok.eos_id]
    # BOS/EOS the document already has are not doubled; the pipeline's are added where missing.
    assert parsed.encode(text, bos=True, eos=True) == parsed.encode(text)
    assert parsed.encode("hi", bos=True, eos=True) == [tok.bos_id, *hi, tok.eos_id]
    assert parsed.decode(parsed.encode(text)) == text
    # Text mode (the default): the same string stays text and gets the pipeline's BOS/EOS.
    ids = tok.encode(text, bos=True, eos=True)
    assert ids.count(tok.bos_id) == 1 and ids.count(tok.eos_id) == 1 and tok.pad_id not in ids
