"""Data loader: packing, held-out split, global batch order in any layout, resumption, local formats, errors."""

import gzip
import json
import re
from pathlib import Path

import datasets
import huggingface_hub.constants
import numpy as np
import pytest
import torch

from trainer.data import TokenDataLoader, build_dataloader, build_tokenizer
from trainer.data.datasets import VALIDATION_EVERY

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "assets" / "corpus" / "shakespeare.jsonl.gz"
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module", autouse=True)
def offline_hf(tmp_path_factory):
    """Offline mode and a private cache. `datasets` reads both from the environment at import
    time, so its already-imported config values are patched too."""
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(REPO / "assets" / "tokenizer" / "shakespeare.tiktoken")


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents that name themselves ("document 17 ...") with varied lengths."""
    rng = np.random.default_rng(seed)
    return [f"document {i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def loader(tok, path, **kw) -> TokenDataLoader:
    args = dict(tokenizer=tok, dataset="auto", dataset_path=str(path), seq_len=16, batch_size=2)
    return build_dataloader(**{**args, **kw})


def take(dl, n):
    return [next(dl) for _ in range(n)]


def stream_of(batches) -> list[int]:
    """Rebuild the token stream from consecutive batches (windows overlap by one token)."""
    windows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])  # [N, S + 1]
    assert torch.equal(windows[1:, 0], windows[:-1, -1]), "consecutive windows must overlap by one token"
    return torch.cat([windows[0], windows[1:, 1:].reshape(-1)]).tolist()


def documents_read(tok, dl) -> list[int]:
    """Ids ("document N") of the documents in one pass of a finite loader."""
    stream = stream_of(list(dl))
    text = tok.decode([t if t != tok.bos_id else tok.eos_id for t in stream])
    return [int(m) for m in re.findall(r"document (\d+) ", text)]


# --- packing ---------------------------------------------------------------------------------


def test_packing_contiguous_windows(tok, tmp_path):
    docs = make_docs(60)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    seq_len, bsz = 16, 3
    dl = loader(tok, path, seq_len=seq_len, batch_size=bsz, shuffle=False, infinite=False)
    train_docs = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    expected = [t for d in train_docs for t in tok.encode(d, bos=True, eos=True)]
    batches = list(dl)
    n_windows = (len(expected) - 1) // seq_len
    assert len(batches) == n_windows // bsz  # final partial window and partial batch dropped
    for b, (x, y) in enumerate(batches):
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (bsz, seq_len)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for r in range(bsz):
            k = b * bsz + r
            window = expected[k * seq_len : (k + 1) * seq_len + 1]
            assert x[r].tolist() == window[:-1] and y[r].tolist() == window[1:]
    # A finite loader rewinds after a full pass.
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, dl))


def test_bundled_corpus_and_validation_held_out(tok):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) > 500
    val_texts = {t for i, t in enumerate(texts) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1}

    def complete_docs(dl):
        stream = np.array(stream_of(list(dl)))
        bos = np.flatnonzero(stream == tok.bos_id)
        return {tok.decode(stream[a + 1 : b - 1].tolist()) for a, b in zip(bos[:-1], bos[1:])}

    common = dict(tokenizer=tok, dataset="shakespeare", dataset_path=None, seq_len=512, batch_size=4, infinite=False)
    train = complete_docs(build_dataloader(**common))
    val = complete_docs(build_dataloader(**common, split="validation"))
    assert not train & val_texts
    assert val <= val_texts and len(val) >= len(val_texts) - 2
    assert len(train) >= len(texts) - len(val_texts) - 2


# --- sharding and shuffling -----------------------------------------------------------------


def global_batches(loaders, steps):
    """Reassemble each step's global batch from one loader per DP rank: row
    ``m * D * B + r * B + i`` is row ``i`` of rank ``r``'s micro-batch ``m``."""
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(loaders[0].accum_steps):
            rows += [next(dl) for dl in loaders]
        out.append((torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])))
    return out


def layout_loaders(tok, path, dp, local, global_batch, **kw):
    return [
        loader(tok, path, batch_size=local, global_batch_size=global_batch, dp_rank=r, dp_world_size=dp, **kw)
        for r in range(dp)
    ]


@pytest.mark.parametrize("streaming", [False, True])
def test_global_batch_order_is_layout_independent(tok, tmp_path, streaming):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(80))
    kw = dict(seq_len=8, streaming=streaming)
    reference = global_batches(layout_loaders(tok, path, 1, 6, 6, **kw), 20)  # crosses epochs
    for dp, local in ((2, 3), (3, 2), (6, 1), (2, 1), (1, 2), (3, 1)):
        loaders = layout_loaders(tok, path, dp, local, 6, **kw)
        assert loaders[0].accum_steps == 6 // (dp * local)
        for (x0, y0), (x1, y1) in zip(reference, global_batches(loaders, 20), strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_finite_pass_same_windows_in_every_layout(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(60))
    kw = dict(seq_len=4, infinite=False, split="validation")
    reference = [x for x, _ in layout_loaders(tok, path, 1, 4, 4, **kw)[0]]
    assert reference
    loaders = layout_loaders(tok, path, 2, 1, 4, **kw)
    passes = [[x for x, _ in dl] for dl in loaders]
    assert len(passes[0]) == len(passes[1]) == 2 * len(reference)  # only whole global batches
    rebuilt = [torch.cat([passes[r][2 * k + m] for m in range(2) for r in range(2)]) for k in range(len(reference))]
    assert all(torch.equal(a, b) for a, b in zip(reference, rebuilt))


def test_shuffle_is_deterministic_per_epoch(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(60))
    a, b = loader(tok, path, seed=3), loader(tok, path, seed=3)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(take(a, 30), take(b, 30)))
    assert not torch.equal(next(loader(tok, path, seed=4))[0], next(loader(tok, path, seed=3))[0])

    def epoch_docs(epoch):
        dl = loader(tok, path, seed=3, seq_len=4, batch_size=1, infinite=False)
        dl.load_state_dict({**dl.state_dict(), "epoch": epoch})
        return documents_read(tok, dl)

    e0, e1 = epoch_docs(0), epoch_docs(1)
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert e0 == epoch_docs(0)


# --- resumption ------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_state_restore_continues_exactly(tok, tmp_path, streaming):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    kw = dict(seq_len=32, batch_size=2, dp_rank=1, dp_world_size=2, streaming=streaming)
    reference = take(loader(tok, path, **kw), 40)
    # One epoch is ~11 steps of 4 windows here, so these cut points cross epoch boundaries.
    for k in (0, 1, 3, 7, 8, 9, 15, 22):
        original = loader(tok, path, **kw)
        take(original, k)
        state = json.loads(json.dumps(original.state_dict()))  # plain Python values only
        restored = loader(tok, path, **kw)
        restored.load_state_dict(state)
        for (x0, y0), (x1, y1), (x2, y2) in zip(reference[k : k + 12], take(original, 12), take(restored, 12)):
            assert torch.equal(x0, x1) and torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("streaming", [False, True])
def test_state_restores_into_another_layout(tok, tmp_path, streaming):
    """A position saved at a step boundary by 2 ranks x 2 micro-batches continues exactly on 1 rank
    and on 4 ranks, and the state is the same on every rank."""
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    kw = dict(seq_len=16, streaming=streaming)
    reference = global_batches(layout_loaders(tok, path, 1, 8, 8, **kw), 14)
    saving = layout_loaders(tok, path, 2, 2, 8, **kw)
    global_batches(saving, 5)
    states = [json.loads(json.dumps(dl.state_dict())) for dl in saving]
    assert states[0] == states[1]
    for dp, local in ((1, 8), (4, 1), (2, 4)):
        restored = layout_loaders(tok, path, dp, local, 8, **kw)
        for dl in restored:
            dl.load_state_dict(states[0])
        for (x0, _), (x1, _) in zip(reference[5:], global_batches(restored, 9), strict=True):
            assert torch.equal(x0, x1)


def test_state_restore_mid_batch_and_old_format(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    original = loader(tok, path, batch_size=1, global_batch_size=4)
    take(original, 6)  # half-way through the second global batch
    state = original.state_dict()
    restored = loader(tok, path, batch_size=2, global_batch_size=4)
    restored.load_state_dict(state)
    assert torch.equal(torch.cat([x for x, _ in take(original, 2)]), next(restored)[0])
    with pytest.raises(ValueError, match="not a whole number"):
        loader(tok, path, batch_size=4, global_batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="older version"):
        loader(tok, path).load_state_dict({"epoch": 0, "doc_pos": 0, "buffer": [], "dp_rank": 0, "dp_world_size": 2})


# --- local formats ---------------------------------------------------------------------------


def test_local_formats(tok, tmp_path):
    docs = make_docs(45)
    expected = [t for i, d in enumerate(docs) if i % 20 != 19 for t in tok.encode(d, bos=True, eos=True)]
    first = torch.tensor(expected[:17])

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "d.json").write_text(json.dumps([{"text": d} for d in docs]))
    write_jsonl(tmp_path / "d.jsonl", docs)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write((tmp_path / "d.jsonl").read_text())
    (tmp_path / "d.txt").write_text("\n\n".join(docs) + "\n")
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_dict({"text": docs[:20]}).to_parquet(str(tmp_path / "pq" / "a.parquet"))
    datasets.Dataset.from_dict({"text": docs[20:]}).to_parquet(str(tmp_path / "pq" / "b.parquet"))

    cases = [
        ("json", tmp_path / "json"),
        ("json", tmp_path / "d.jsonl"),
        ("auto", tmp_path / "d.jsonl.gz"),
        ("text", tmp_path / "d.txt"),
        ("parquet", tmp_path / "pq"),
        ("auto", tmp_path / "pq" / "*.parquet"),
        ("auto", tmp_path / "json"),
    ]
    for fmt, path in cases:
        x, y = next(loader(tok, path, dataset=fmt, shuffle=False))
        assert torch.equal(x[0], first[:-1]) and torch.equal(y[0], first[1:]), (fmt, path)


# --- errors ----------------------------------------------------------------------------------


def test_clear_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        loader(tok, tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="no files match"):
        loader(tok, tmp_path / "*.parquet")
    with pytest.raises(ValueError, match="needs dataset_path"):
        build_dataloader(tokenizer=tok, dataset="json", dataset_path=None, seq_len=8, batch_size=1)

    write_jsonl(tmp_path / "c.jsonl", make_docs(25), key="content")
    with pytest.raises(ValueError, match=r"no 'text' column.*content"):
        loader(tok, tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match=r"no 'text' column.*content"):
        next(loader(tok, tmp_path / "c.jsonl", streaming=True))

    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="cannot auto-detect"):
        loader(tok, tmp_path / "notes.md")

    write_jsonl(tmp_path / "few.jsonl", make_docs(3))
    with pytest.raises(ValueError, match="no documents in this split"):
        loader(tok, tmp_path / "few.jsonl", split="validation")
    with pytest.raises(ValueError, match="fewer than seq_len"):
        next(loader(tok, tmp_path / "few.jsonl", seq_len=4096))

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl is empty"):
        loader(tok, tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank.jsonl cannot be read as json"):
        loader(tok, tmp_path / "blank.jsonl")
    wrong_format = r"few.jsonl cannot be read as parquet .*its name says json: pass --training.dataset json"
    with pytest.raises(ValueError, match=wrong_format):
        loader(tok, tmp_path / "few.jsonl", dataset="parquet")

    with pytest.raises(ValueError, match=r"could not load dataset 'someone/no-such-dataset'.*Offline.*dataset_path"):
        build_dataloader(tokenizer=tok, dataset="someone/no-such-dataset", dataset_path=None, seq_len=8, batch_size=1)


# --- shared tokenisation ---------------------------------------------------------------------


def _shared_encode_worker(rank: int, world: int, init_file: str, texts: list[str], out: str) -> None:
    import torch.distributed as dist

    from trainer.data.shared_tokenize import SharedTokenizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokenizer = build_tokenizer(REPO / "assets" / "tokenizer" / "shakespeare.tiktoken")
        tokens = SharedTokenizer(tokenizer, dist.group.WORLD).encode(texts)
        Path(f"{out}.{rank}").write_text(json.dumps([t.tolist() for t in tokens]))
    finally:
        dist.destroy_process_group()


def test_shared_tokenisation_gives_every_rank_all_documents(tok, tmp_path):
    """Three ranks split 7 documents (uneven shares, one empty document): each gets every
    document's tokens, in order, as one process encodes them."""
    texts = make_docs(6) + [""]
    out = str(tmp_path / "tokens")
    torch.multiprocessing.spawn(
        _shared_encode_worker, args=(3, str(tmp_path / "init"), texts, out), nprocs=3, join=True
    )
    want = [tok.encode(t, bos=True, eos=True) for t in texts]
    for rank in range(3):
        assert json.loads(Path(f"{out}.{rank}").read_text()) == want
