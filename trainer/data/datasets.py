"""Text datasets -> packed batches of token ids in a layout-independent global order.

Pipeline: documents (HF ``datasets``) -> held-out split -> per-epoch order -> ``[BOS] doc [EOS]``
token stream -> windows of ``seq_len + 1`` tokens (the *global sample stream*) -> global batches
of ``global_batch_size`` windows -> this data-parallel rank's rows of each micro-batch, as
``(inputs, labels)`` with ``inputs = w[:-1]`` and ``labels = w[1:]``.

Packing: consecutive windows overlap by one token (window ``k`` is
``stream[k * seq_len : (k + 1) * seq_len + 1]``), so every adjacent token pair of the stream is
trained on exactly once and no padding is needed. Each epoch's stream is packed on its own: the
final partial window of an epoch (fewer than ``seq_len + 1`` tokens) is dropped, and a batch may
hold windows from two epochs. A finite loader (``infinite=False``) makes one pass and drops its
final partial *global* batch, so every batch has the same shape and every layout reads the same
windows.

Documents may cross window boundaries; BOS/EOS mark them, which is what document masking in
attention keys on. An infinite loader starts the next epoch when the data runs out, with one line
in the log. A weighted mixture of datasets (``training.dataset_mix``) packs each dataset on its
own and draws each window of the global sample stream from one of them (trainer/data/mixture.py).

Held-out validation: a hub dataset's own ``validation`` (or ``test``) split when it has one, else
every ``VALIDATION_EVERY``-th document (index % 20 == 19, by position in the stream for streaming
data) of the training data. Training never sees those documents.

Global batch order (one run, any layout): step ``k`` trains on windows
``[k * G, (k + 1) * G)`` of the global sample stream, ``G = global_batch_size``, whatever the
data-parallel degree ``D``, local batch ``B`` and accumulation split ``A = G / (D * B)``.
Micro-batch ``m`` of a step holds the step's rows ``[m * D * B, (m + 1) * D * B)`` and DP rank
``r`` reads rows ``[r * B, (r + 1) * B)`` of it, i.e. row ``m * D * B + r * B + i`` of the global
batch. Every split covers each of the ``G`` rows once, so the step's summed loss and gradient are
the same sums in another order (equal up to float rounding), including with accumulation. The
ranks of one DP rank (context / tensor parallel peers) read the same rows. Every rank walks the
whole stream, but tokenises only its share of the documents (``shared_tokenize.py``).

Resumption: ``TokenDataLoader`` follows torch.distributed.checkpoint's ``Stateful`` protocol; its
state is a position in the global sample stream (epoch, document position, leftover tokens, the
HF stream position when streaming, rows already served of the current global batch), the same on
every rank. A restored loader produces exactly the windows the original would have produced next,
in any layout (another DP degree, local batch or accumulation split).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import datasets
import huggingface_hub
import numpy as np
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node

from trainer.config.combinations import LOCAL_FORMATS
from trainer.config.data_files import local_format, resolve_local_files
from trainer.data.shared_tokenize import SharedTokenizer
from trainer.data.tokenizer import Tokenizer

logger = logging.getLogger("trainer")

VALIDATION_EVERY = 20
TEXT_COLUMN = "text"
BUNDLED_CORPUS = Path(__file__).resolve().parents[2] / "assets" / "corpus" / "shakespeare.jsonl.gz"

# Documents tokenised together (tiktoken encodes a batch in parallel threads; with a token group
# the chunk is what the ranks split between them).
TOKENIZE_CHUNK = 256
# Map-style datasets keep their tokens after the first epoch up to this many tokens (1 GiB as
# int32); beyond it, documents are tokenised again when revisited.
CACHE_TOKEN_BUDGET = 1 << 28
# Loader state format: 2 = a position in the global sample stream (1 was a per-rank shard).
STATE_VERSION = 2


def build_dataloader(
    *,
    tokenizer: Tokenizer,
    dataset: str,
    dataset_path: str | None,
    seq_len: int,
    batch_size: int,
    global_batch_size: int | None = None,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    token_group: dist.ProcessGroup | None = None,
    split: str = "train",
    seed: int = 0,
    infinite: bool = True,
    shuffle: bool = True,
    streaming: bool | None = None,
) -> TokenDataLoader:
    """Build the packed token loader of one data-parallel rank.

    Args:
        dataset: ``"shakespeare"`` (bundled corpus), ``"json"`` / ``"text"`` / ``"parquet"`` /
            ``"auto"`` (local files at ``dataset_path``), or a HF hub dataset name.
        dataset_path: for local formats a file, glob or directory (``.jsonl`` counts as json,
            text files give one document per blank-line separated paragraph); for a hub dataset
            its config name (or None).
        batch_size: rows per micro-batch on this rank (the local batch).
        global_batch_size: rows per step over all DP ranks and micro-batches; a multiple of
            ``batch_size * dp_world_size`` (default: exactly that, no accumulation).
        token_group: gloo group of every rank of the job (None on one process): the ranks split
            the tokenisation between them.
        split: ``"train"`` or ``"validation"`` (the held-out documents).
        seed: training order of epoch ``e`` is the permutation drawn with ``seed + e``.
        shuffle: reshuffle the training documents every epoch (map-style data only; streams
            keep the dataset's order, and validation is always read in order).
        streaming: read with ``streaming=True``; default: True for hub datasets, False for local.
    """
    batches = batch_split(seq_len, batch_size, global_batch_size, dp_rank, dp_world_size)
    source = load_source(
        tokenizer, dataset, dataset_path, split=split, token_group=token_group, seed=seed, shuffle=shuffle,
        streaming=streaming,
    )
    return TokenDataLoader(PackedWindows(source, seq_len=seq_len, infinite=infinite), **batches)


def batch_split(
    seq_len: int, batch_size: int, global_batch_size: int | None = None, dp_rank: int = 0, dp_world_size: int = 1
) -> dict[str, int]:
    """``TokenDataLoader``'s batch arguments, checked, with the global batch size's default (one
    micro-batch per DP rank)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, dp_world_size={dp_world_size}), got {dp_rank}")
    per_micro = batch_size * dp_world_size
    global_batch_size = global_batch_size or per_micro
    if global_batch_size % per_micro:
        raise ValueError(
            f"global_batch_size = {global_batch_size} is not a multiple of batch_size x dp_world_size = "
            f"{batch_size} x {dp_world_size}"
        )
    return {
        "batch_size": batch_size, "global_batch_size": global_batch_size, "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
    }


def load_source(
    tokenizer: Tokenizer,
    dataset: str,
    dataset_path: str | None,
    *,
    split: str,
    token_group: dist.ProcessGroup | None,
    seed: int,
    shuffle: bool,
    streaming: bool | None,
) -> _MapDocuments | _StreamDocuments:
    """One dataset's documents of ``split`` (arguments as for ``build_dataloader``)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    data, held_out, name = _load_documents(dataset, dataset_path, split, streaming)
    encoder = SharedTokenizer(tokenizer, token_group)
    if isinstance(data, datasets.IterableDataset):
        return _StreamDocuments(data, encoder, name=name, held_out=held_out)
    return _MapDocuments(
        data, encoder, name=name, held_out=held_out, shuffle_seed=seed if shuffle and split == "train" else None
    )


class TokenDataLoader:
    """Iterator over this DP rank's ``(inputs, labels)`` LongTensor micro-batches of shape
    ``[batch_size, seq_len]``; ``accum_steps`` consecutive micro-batches make one global batch.

    ``windows`` is the global sample stream: ``PackedWindows`` (one dataset) or
    ``trainer.data.mixture.MixedWindows`` (several, drawn by weight). The loader is its own
    iterator and continues from its current state on every ``iter()``; a finite loader rewinds to
    the start after a complete pass, and ``reset()`` rewinds at any time (e.g. before a capped
    validation pass).
    """

    def __init__(
        self,
        windows: WindowStream,
        *,
        batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
    ):
        self.windows = windows
        self.seq_len = windows.seq_len
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.accum_steps = global_batch_size // (batch_size * dp_world_size)
        self._rank = dp_rank
        self._world_size = dp_world_size
        self.reset()

    def reset(self) -> None:
        """Rewind to the first batch of epoch 0."""
        self.windows.reset()
        self._rows: list[np.ndarray] = []
        self._micro = 0

    def __iter__(self) -> TokenDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._micro == 0:
            self._batch_start = self.windows.position()
            rows = self._read_global_batch()
            if rows is None:
                self.reset()
                raise StopIteration
            self._rows = rows
        b = self.batch_size
        batch = np.stack(self._rows[self._micro * b : (self._micro + 1) * b]).astype(np.int64)  # [B, S + 1]
        self._micro = (self._micro + 1) % self.accum_steps
        return torch.from_numpy(batch[:, :-1].copy()), torch.from_numpy(batch[:, 1:].copy())

    def _read_global_batch(self) -> list[np.ndarray] | None:
        """This rank's rows of the next global batch, micro-batch by micro-batch (None at the end
        of a finite pass). The other ranks' windows are cut from the buffer but not copied."""
        per_micro = self.batch_size * self._world_size
        rows = []
        for j in range(self.global_batch_size):
            window = self.windows.next_window()
            if window is None:
                return None
            if (j % per_micro) // self.batch_size == self._rank:
                rows.append(window)
        return rows

    def metrics(self) -> dict[str, int]:
        """Counters of the windows read so far (``tokens/<source>`` of a mixture; none for one dataset)."""
        return self.windows.metrics()

    def state_dict(self) -> dict[str, Any]:
        """The global stream position at the start of the current global batch and the rows of
        it already served: the same on every rank of every layout at a step boundary."""
        if self._micro == 0:
            return {"version": STATE_VERSION, **self.windows.position(), "rows_served": 0}
        rows_served = self._micro * self.batch_size * self._world_size
        return {"version": STATE_VERSION, **self._batch_start, "rows_served": rows_served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                "data loader state was saved per data-parallel shard by an older version; it is no position "
                "in the global sample stream, so the data order cannot continue exactly"
            )
        per_micro = self.batch_size * self._world_size
        rows_served = int(state_dict["rows_served"])
        if rows_served % per_micro:
            raise ValueError(
                f"data loader state was saved {rows_served} rows into a global batch, which is not a whole number "
                f"of this layout's micro-batches of {per_micro} rows: resume from a checkpoint at a step boundary"
            )
        self.reset()
        self.windows.set_position(state_dict)
        if rows_served:
            self._batch_start = self.windows.position()
            rows = self._read_global_batch()
            if rows is None:
                raise ValueError("data loader state points past the end of a finite pass")
            self._rows, self._micro = rows, rows_served // per_micro


class WindowStream(Protocol):
    """A global sample stream of ``seq_len + 1``-token windows with a resumable position."""

    seq_len: int

    def reset(self) -> None: ...

    def next_window(self) -> np.ndarray | None: ...

    def position(self) -> dict[str, Any]: ...

    def set_position(self, position: dict[str, Any]) -> None: ...

    def metrics(self) -> dict[str, int]: ...


class PackedWindows:
    """One dataset's documents packed into windows (the module docstring's packing), epoch after
    epoch when ``infinite``. Its position (epoch, document position, leftover tokens, HF stream
    position) is the loader state of a one-dataset run."""

    def __init__(self, source: _MapDocuments | _StreamDocuments, *, seq_len: int, infinite: bool):
        self.source = source
        self.seq_len = seq_len
        self.infinite = infinite
        self.reset()

    def reset(self) -> None:
        self.set_position({"epoch": 0, "doc_pos": 0, "buffer": [], "stream_state": None})

    def set_position(self, position: dict[str, Any]) -> None:
        self._epoch = int(position["epoch"])
        self._doc_pos = int(position["doc_pos"])
        self._buffer = np.asarray(position["buffer"], dtype=np.int32)
        self._stream_state: dict | None = position["stream_state"]
        self._docs: Iterator[tuple[int, np.ndarray]] | None = None
        self._epochs_without_window = 0

    def position(self) -> dict[str, Any]:
        """Where the stream stands (before the next window)."""
        stream_state = self._stream_state
        if isinstance(self.source, _StreamDocuments) and self._docs is not None:
            stream_state = self.source.stream_state()
        return {
            "epoch": self._epoch, "doc_pos": self._doc_pos, "buffer": self._buffer.tolist(), "stream_state": stream_state
        }

    def metrics(self) -> dict[str, int]:
        return {}

    def next_window(self) -> np.ndarray | None:
        span = self.seq_len + 1
        while len(self._buffer) < span:
            if self._docs is None:
                self._docs = self.source.iter_epoch(self._epoch, self._doc_pos, self._stream_state)
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
                f"{self.source.name}: a whole epoch has fewer than seq_len + 1 = {self.seq_len + 1} tokens; "
                "use a smaller seq_len or more data"
            )
        logger.info(
            "data: %s ran out after %d documents of epoch %d; it restarts as epoch %d",
            self.source.name, self._doc_pos, self._epoch, self._epoch + 1,
        )
        self._epoch += 1
        self._doc_pos = 0
        self._buffer = np.empty(0, dtype=np.int32)
        self._stream_state = None
        self._docs = None


class _MapDocuments:
    """Documents of a map-style dataset: per-epoch order, tokens cached once."""

    def __init__(
        self,
        data: datasets.Dataset,
        encoder: SharedTokenizer,
        *,
        name: str,
        held_out: str | None,
        shuffle_seed: int | None,
    ):
        _check_columns(data.column_names, name)
        self.name = name
        self._texts = data.select_columns([TEXT_COLUMN])
        self._encoder = encoder
        ids = np.arange(len(data))
        if held_out == "train":
            ids = ids[ids % VALIDATION_EVERY != VALIDATION_EVERY - 1]
        elif held_out == "validation":
            ids = ids[ids % VALIDATION_EVERY == VALIDATION_EVERY - 1]
        if len(ids) == 0:
            raise ValueError(
                f"{name}: no documents in this split (of {len(data)}; every {VALIDATION_EVERY}th is held out "
                "for validation)"
            )
        self._doc_ids = ids
        self._shuffle_seed = shuffle_seed
        # Filled in the same order on every rank (all of them tokenise the same chunks), so every
        # rank decides alike whether a chunk needs the shared tokenisation.
        self._cache: dict[int, np.ndarray] = {}
        self._cached_tokens = 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices of the documents of epoch ``epoch``, in reading order."""
        ids = self._doc_ids
        if self._shuffle_seed is not None:
            ids = ids[np.random.default_rng(self._shuffle_seed + epoch).permutation(len(ids))]
        return ids

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
        for idx, tokens in zip(todo, self._encoder.encode(texts)):
            out[idx] = tokens
            if self._cached_tokens + len(tokens) <= CACHE_TOKEN_BUDGET:
                self._cache[idx] = tokens
                self._cached_tokens += len(tokens)
        return out


class _StreamDocuments:
    """Documents of a streaming dataset, read in the dataset's order (the whole stream on every
    rank: only the tokenisation is split)."""

    def __init__(self, data: datasets.IterableDataset, encoder: SharedTokenizer, *, name: str, held_out: str | None):
        if data.column_names is not None:
            _check_columns(data.column_names, name)
        self.name = name
        self._data = data
        self._encoder = encoder
        self._held_out = held_out
        self._state: dict | None = None

    def iter_epoch(self, epoch: int, start: int, stream_state: dict | None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(stream documents read so far, tokens)``; ``stream_state`` is HF's position
        after the first ``start`` documents. Every epoch reads the stream in the same order.
        Held-out documents count in the position (the split is by position in the stream).
        Documents are read a chunk ahead (for the shared tokenisation); HF's position after each
        is kept so that ``stream_state`` reports the one after the last document handed out."""
        # A fresh wrapper per epoch (a split over one node is the whole stream): an
        # IterableDataset keeps a loaded state for every later iter().
        live = split_dataset_by_node(self._data, rank=0, world_size=1)
        if stream_state is not None:
            live.load_state_dict(stream_state)
        self._state = stream_state
        pos = start
        examples = iter(live)
        while True:
            texts, marks = [], []
            for example in examples:
                pos += 1
                is_validation = (pos - 1) % VALIDATION_EVERY == VALIDATION_EVERY - 1
                if (self._held_out == "train" and is_validation) or (self._held_out == "validation" and not is_validation):
                    continue
                if TEXT_COLUMN not in example:
                    _check_columns(list(example), self.name)
                texts.append(example[TEXT_COLUMN] or "")
                marks.append((pos, live.state_dict()))
                if len(texts) == TOKENIZE_CHUNK:
                    break
            if not texts:
                return
            for (doc_pos, state), tokens in zip(marks, self._encoder.encode(texts)):
                self._state = state
                yield doc_pos, tokens

    def stream_state(self) -> dict | None:
        """HF's position after the last document handed out."""
        return self._state


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
    if dataset in LOCAL_FORMATS:
        builder, files = resolve_local_files(dataset, dataset_path)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            data = datasets.load_dataset(builder, data_files=files, split="train", streaming=bool(streaming), **kwargs)
        except Exception as e:  # whatever the builder meets in a file it cannot parse
            raise ValueError(_unreadable_local(dataset_path, files, builder, e)) from None
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


def _unreadable_local(dataset_path: str, files: list[str], builder: str, error: Exception) -> str:
    cause = (error.__cause__ or error) if isinstance(error, datasets.exceptions.DatasetGenerationError) else error
    # HF's json builder meets a file without a single record as a bare StopIteration.
    why = "it holds no records" if isinstance(cause, StopIteration) else f"{type(cause).__name__}: {cause}"
    named = {local_format(Path(f)) for f in files}
    if len(named) == 1 and None not in named and named != {builder}:
        (name_says,) = named
        fix = f"its name says {name_says}: pass --training.dataset {name_says} (or auto)"
    else:
        fix = "fix the file or pick its format with --training.dataset json/text/parquet"
    return f"dataset_path {dataset_path} cannot be read as {builder} ({why}); {fix}"


