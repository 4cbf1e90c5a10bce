"""Text datasets -> packed, sharded, resumable batches of token ids.

Pipeline: documents (HF ``datasets``) -> held-out split -> per-epoch order -> data-parallel shard
-> ``[BOS] doc [EOS]`` token stream -> windows of ``seq_len + 1`` tokens -> batches of
``(inputs, labels)`` with ``inputs = w[:-1]`` and ``labels = w[1:]``.

Packing: consecutive windows overlap by one token (window ``k`` is
``stream[k * seq_len : (k + 1) * seq_len + 1]``), so every adjacent token pair of the stream is
trained on exactly once and no padding is needed. Each epoch's stream is packed on its own: the
final partial window of an epoch (fewer than ``seq_len + 1`` tokens) is dropped, and a batch may
hold windows from two epochs. A finite loader (``infinite=False``) makes one pass and drops its
final partial batch, so every batch has the same shape.

Documents may cross window boundaries; BOS/EOS mark them, which is what document masking in
attention keys on.

Held-out validation: a hub dataset's own ``validation`` (or ``test``) split when it has one, else
every ``VALIDATION_EVERY``-th document (index % 20 == 19) of the training data. Training never
sees those documents.

Sharding: rank ``r`` of ``W`` reads the documents whose position in the (shuffled) epoch order
is ``r`` mod ``W``: disjoint and complete. Streaming datasets use
``datasets.distributed.split_dataset_by_node`` (whole shards when their number divides ``W``).

Resumption: ``TokenDataLoader`` follows torch.distributed.checkpoint's ``Stateful`` protocol; its
state (epoch, document position, leftover tokens, and the HF stream position when streaming)
makes a restored loader produce exactly the batches the original would have produced next.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node

from trainer.data.tokenizer import Tokenizer

VALIDATION_EVERY = 20
TEXT_COLUMN = "text"
BUNDLED_CORPUS = Path(__file__).resolve().parents[2] / "assets" / "corpus" / "shakespeare.jsonl.gz"

# Extension -> HF builder for local files; a compression suffix after it is handled by HF.
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}

# Documents tokenised together (tiktoken encodes a batch in parallel threads).
TOKENIZE_CHUNK = 256
# Map-style datasets keep their tokens after the first epoch up to this many tokens (1 GiB as
# int32); beyond it, documents are tokenised again when revisited.
CACHE_TOKEN_BUDGET = 1 << 28


def build_dataloader(
    *,
    tokenizer: Tokenizer,
    dataset: str,
    dataset_path: str | None,
    seq_len: int,
    batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    split: str = "train",
    seed: int = 0,
    infinite: bool = True,
    shuffle: bool = True,
    streaming: bool | None = None,
) -> TokenDataLoader:
    """Build the packed token loader for one data-parallel rank.

    Args:
        dataset: ``"shakespeare"`` (bundled corpus), ``"json"`` / ``"text"`` / ``"parquet"`` /
            ``"auto"`` (local files at ``dataset_path``), or a HF hub dataset name.
        dataset_path: for local formats a file, glob or directory (``.jsonl`` counts as json,
            text files give one document per blank-line separated paragraph); for a hub dataset
            its config name (or None).
        split: ``"train"`` or ``"validation"`` (the held-out documents).
        seed: training order of epoch ``e`` is the permutation drawn with ``seed + e``.
        shuffle: reshuffle the training documents every epoch (map-style data only; streams
            keep the dataset's order, and validation is always read in order).
        streaming: read with ``streaming=True``; default: True for hub datasets, False for local.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, dp_world_size={dp_world_size}), got {dp_rank}")
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")

    data, held_out, name = _load_documents(dataset, dataset_path, split, streaming)
    if isinstance(data, datasets.IterableDataset):
        source: _MapDocuments | _StreamDocuments = _StreamDocuments(
            data, tokenizer, name=name, held_out=held_out, rank=dp_rank, world_size=dp_world_size
        )
    else:
        source = _MapDocuments(
            data,
            tokenizer,
            name=name,
            held_out=held_out,
            rank=dp_rank,
            world_size=dp_world_size,
            shuffle_seed=seed if shuffle and split == "train" else None,
        )
    return TokenDataLoader(
        source, seq_len=seq_len, batch_size=batch_size, infinite=infinite, rank=dp_rank, world_size=dp_world_size
    )


class TokenDataLoader:
    """Iterator over ``(inputs, labels)`` LongTensor batches of shape ``[batch_size, seq_len]``.

    The loader is its own iterator and continues from its current state on every ``iter()``; a
    finite loader rewinds to the start after a complete pass, and ``reset()`` rewinds at any time
    (e.g. before a capped validation pass).
    """

    def __init__(
        self,
        source: _MapDocuments | _StreamDocuments,
        *,
        seq_len: int,
        batch_size: int,
        infinite: bool,
        rank: int,
        world_size: int,
    ):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.infinite = infinite
        self._source = source
        self._rank = rank
        self._world_size = world_size
        self.reset()

    def reset(self) -> None:
        """Rewind to the first batch of epoch 0."""
        self._epoch = 0
        self._doc_pos = 0
        self._buffer = np.empty(0, dtype=np.int32)
        self._stream_state: dict | None = None
        self._docs: Iterator[tuple[int, np.ndarray]] | None = None
        self._epochs_without_window = 0

    def __iter__(self) -> TokenDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = []
        for _ in range(self.batch_size):
            window = self._next_window()
            if window is None:
                self.reset()
                raise StopIteration
            windows.append(window)
        batch = np.stack(windows).astype(np.int64)  # [B, S + 1]
        return torch.from_numpy(batch[:, :-1].copy()), torch.from_numpy(batch[:, 1:].copy())

    def _next_window(self) -> np.ndarray | None:
        span = self.seq_len + 1
        while len(self._buffer) < span:
            if self._docs is None:
                self._docs = self._source.iter_epoch(self._epoch, self._doc_pos, self._stream_state)
            item = next(self._docs, None)
            if item is None:
                if not self.infinite:
                    return None
                self._start_next_epoch()
                continue
            self._doc_pos, tokens = item
            self._buffer = np.concatenate([self._buffer, tokens])
        window = self._buffer[:span]
        # Keep the window's last token: it is the first input of the next window.
        self._buffer = self._buffer[self.seq_len :]
        self._epochs_without_window = 0
        return window

    def _start_next_epoch(self) -> None:
        self._epochs_without_window += 1
        if self._epochs_without_window > 1:
            raise ValueError(
                f"{self._source.name}: a whole epoch of rank {self._rank}'s documents has fewer than "
                f"seq_len + 1 = {self.seq_len + 1} tokens; use a smaller seq_len or more data"
            )
        self._epoch += 1
        self._doc_pos = 0
        self._buffer = np.empty(0, dtype=np.int32)
        self._stream_state = None
        self._docs = None

    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self._epoch,
            "doc_pos": self._doc_pos,
            "buffer": self._buffer.tolist(),
            "dp_rank": self._rank,
            "dp_world_size": self._world_size,
        }
        if isinstance(self._source, _StreamDocuments):
            state["stream_state"] = self._source.stream_state() if self._docs is not None else self._stream_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict["dp_rank"], state_dict["dp_world_size"])
        if saved != (self._rank, self._world_size):
            raise ValueError(
                f"data loader state was saved by rank {saved[0]} of {saved[1]}, this loader is rank "
                f"{self._rank} of {self._world_size}: the document shards differ, so it cannot continue exactly"
            )
        self.reset()
        self._epoch = int(state_dict["epoch"])
        self._doc_pos = int(state_dict["doc_pos"])
        self._buffer = np.asarray(state_dict["buffer"], dtype=np.int32)
        self._stream_state = state_dict.get("stream_state")


class _MapDocuments:
    """Documents of a map-style dataset: per-epoch order, rank shard, tokens cached once."""

    def __init__(
        self,
        data: datasets.Dataset,
        tokenizer: Tokenizer,
        *,
        name: str,
        held_out: str | None,
        rank: int,
        world_size: int,
        shuffle_seed: int | None,
    ):
        _check_columns(data.column_names, name)
        self.name = name
        self._texts = data.select_columns([TEXT_COLUMN])
        self._tokenizer = tokenizer
        ids = np.arange(len(data))
        if held_out == "train":
            ids = ids[ids % VALIDATION_EVERY != VALIDATION_EVERY - 1]
        elif held_out == "validation":
            ids = ids[ids % VALIDATION_EVERY == VALIDATION_EVERY - 1]
        if len(ids) <= rank:
            raise ValueError(
                f"{name}: {len(ids)} documents in this split (of {len(data)}; every {VALIDATION_EVERY}th is "
                f"held out for validation) leave none for data-parallel rank {rank} of {world_size}"
            )
        self._doc_ids = ids
        self._rank = rank
        self._world_size = world_size
        self._shuffle_seed = shuffle_seed
        self._cache: dict[int, np.ndarray] = {}
        self._cached_tokens = 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices of this rank's documents in epoch ``epoch``, in reading order."""
        ids = self._doc_ids
        if self._shuffle_seed is not None:
            ids = ids[np.random.default_rng(self._shuffle_seed + epoch).permutation(len(ids))]
        return ids[self._rank :: self._world_size]

    def iter_epoch(self, epoch: int, start: int, stream_state: dict | None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(documents read so far, tokens)`` from position ``start`` of the epoch; the
        position alone locates a map-style document, so ``stream_state`` is always None here."""
        order = self.epoch_order(epoch)
        fresh: dict[int, np.ndarray] = {}
        for pos in range(start, len(order)):
            idx = int(order[pos])
            tokens = self._cache.get(idx)
            if tokens is None:
                if idx not in fresh:
                    fresh = self._tokenize(order[pos : pos + TOKENIZE_CHUNK])
                tokens = fresh[idx]
            yield pos + 1, tokens

    def _tokenize(self, indices: np.ndarray) -> dict[int, np.ndarray]:
        todo = [int(i) for i in indices if int(i) not in self._cache]
        texts = [t or "" for t in self._texts[todo][TEXT_COLUMN]]
        out = {}
        for idx, ids in zip(todo, self._tokenizer.encode_batch(texts, bos=True, eos=True)):
            tokens = np.asarray(ids, dtype=np.int32)
            out[idx] = tokens
            if self._cached_tokens + len(tokens) <= CACHE_TOKEN_BUDGET:
                self._cache[idx] = tokens
                self._cached_tokens += len(tokens)
        return out


class _StreamDocuments:
    """Documents of a streaming dataset, read in the dataset's order, one rank's share."""

    def __init__(
        self,
        data: datasets.IterableDataset,
        tokenizer: Tokenizer,
        *,
        name: str,
        held_out: str | None,
        rank: int,
        world_size: int,
    ):
        if data.column_names is not None:
            _check_columns(data.column_names, name)
        self.name = name
        self._data = data
        self._tokenizer = tokenizer
        self._held_out = held_out
        self._rank = rank
        self._world_size = world_size
        self._live: datasets.IterableDataset | None = None

    def iter_epoch(self, epoch: int, start: int, stream_state: dict | None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(stream documents read so far, tokens)``; ``stream_state`` is HF's position
        after the first ``start`` documents. Every epoch reads the stream in the same order.
        Held-out documents count in the position: the split is by position in this rank's
        stream, so with a different world size the held-out set differs."""
        # A fresh split per epoch: an IterableDataset keeps a loaded state for every later iter().
        live = split_dataset_by_node(self._data, rank=self._rank, world_size=self._world_size)
        if stream_state is not None:
            live.load_state_dict(stream_state)
        self._live = live
        pos = start
        for example in live:
            pos += 1
            is_validation = (pos - 1) % VALIDATION_EVERY == VALIDATION_EVERY - 1
            if (self._held_out == "train" and is_validation) or (self._held_out == "validation" and not is_validation):
                continue
            if TEXT_COLUMN not in example:
                _check_columns(list(example), self.name)
            text = example[TEXT_COLUMN] or ""
            yield pos, np.asarray(self._tokenizer.encode(text, bos=True, eos=True), dtype=np.int32)

    def stream_state(self) -> dict:
        """HF's position after the last document handed out (the stream is read lazily)."""
        return self._live.state_dict()


def _check_columns(columns: list[str], name: str) -> None:
    if TEXT_COLUMN not in columns:
        raise ValueError(f"{name} has no {TEXT_COLUMN!r} column; its columns are {sorted(columns)}")


def _load_documents(
    dataset: str, dataset_path: str | None, split: str, streaming: bool | None
) -> tuple[datasets.Dataset | datasets.IterableDataset, str | None, str]:
    """Return (documents, which part of them to keep by index or None for all, display name)."""
    if dataset == "shakespeare":
        if not BUNDLED_CORPUS.is_file():
            raise FileNotFoundError(
                f"bundled corpus missing: {BUNDLED_CORPUS}; rebuild it with `python scripts/build_corpus.py`"
            )
        data = datasets.load_dataset("json", data_files=str(BUNDLED_CORPUS), split="train", streaming=bool(streaming))
        return data, split, "shakespeare"
    if dataset in ("json", "text", "parquet", "auto"):
        builder, files = _resolve_local_files(dataset, dataset_path)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            data = datasets.load_dataset(builder, data_files=files, split="train", streaming=bool(streaming), **kwargs)
        except datasets.exceptions.DatasetGenerationError as e:
            cause = e.__cause__ or e
            raise ValueError(
                f"{dataset_path} cannot be read as {builder} ({type(cause).__name__}: {cause}); "
                f"fix the file or pick its format with --training.dataset json/text/parquet"
            ) from None
        return data, split, f"{builder} dataset {dataset_path}"
    return _load_hub(dataset, dataset_path, split, streaming=True if streaming is None else streaming)


def _load_hub(
    name: str, config: str | None, split: str, *, streaming: bool
) -> tuple[datasets.Dataset | datasets.IterableDataset, str | None, str]:
    try:
        if not datasets.config.HF_HUB_OFFLINE:
            # One request first: load_dataset retries an unreachable hub or a misspelt name for ~30 s.
            huggingface_hub.HfApi().dataset_info(name, timeout=10)
        splits = datasets.load_dataset(name, config, streaming=streaming)
    except Exception as e:  # DatasetNotFoundError, ConnectionError, FileNotFoundError, ... all mean the same here
        offline = " Offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)." if datasets.config.HF_HUB_OFFLINE else ""
        raise ValueError(
            f"could not load dataset {name!r}{f' (config {config!r})' if config else ''} from the Hugging Face "
            f"Hub: {type(e).__name__}: {e}.{offline} To use local data instead, pass dataset='json', 'text', "
            "'parquet' or 'auto' with dataset_path=<file, glob or directory>, or dataset='shakespeare' for "
            "the bundled corpus."
        ) from e
    own_validation = next((s for s in ("validation", "test") if s in splits), None)
    display = f"hub dataset {name}" + (f"/{config}" if config else "")
    if "train" not in splits:
        raise ValueError(f"{display} has no 'train' split; its splits are {sorted(splits)}")
    if split == "validation" and own_validation is not None:
        return splits[own_validation], None, f"{display} [{own_validation}]"
    return splits["train"], None if own_validation else split, display


def _local_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    return LOCAL_FORMATS.get(suffixes[-1]) if suffixes else None


def _resolve_local_files(fmt: str, dataset_path: str | None) -> tuple[str, list[str]]:
    """Expand ``dataset_path`` (file, glob or directory) to files and pick the HF builder."""
    if not dataset_path:
        raise ValueError(f"dataset={fmt!r} needs dataset_path (a file, a glob or a directory)")
    path = Path(dataset_path).expanduser()
    if glob.has_magic(dataset_path):
        files = [Path(f) for f in sorted(glob.glob(str(path), recursive=True)) if Path(f).is_file()]
        if not files:
            raise FileNotFoundError(f"no files match dataset_path {dataset_path!r}")
    elif path.is_dir():
        wanted = set(LOCAL_FORMATS.values()) if fmt == "auto" else {fmt}
        files = sorted(f for f in path.rglob("*") if f.is_file() and _local_format(f) in wanted)
        if not files:
            kinds = "/".join(ext for ext, b in LOCAL_FORMATS.items() if fmt in ("auto", b))
            raise FileNotFoundError(f"dataset_path directory {path} has no {kinds} files")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"dataset_path does not exist: {path}")
    if fmt != "auto":
        return fmt, [str(f) for f in files]
    formats = {_local_format(f) for f in files}
    if len(formats) != 1 or None in formats:
        raise ValueError(
            f"cannot auto-detect the format of {dataset_path!r} (found {sorted(map(str, formats))}); "
            f"use files ending in {sorted(LOCAL_FORMATS)} (optionally compressed) or pass dataset='json'/'text'/'parquet'"
        )
    return formats.pop(), [str(f) for f in files]
