"""Weighted data mixtures (trainer/data/mixture.py, trainer/config/data_mix.py): the draw's shares,
the same windows in every layout and after a resume into another layout, per-source epochs and
token counts, per-source validation, and bad entries refused with one line before launch."""

import json
import logging

import datasets
import numpy as np
import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.config.check import main as check_main
from trainer.config.data_mix import parse_mixture
from trainer.data import build_tokenizer
from trainer.data.mixture import MixtureSampler, build_mixture_dataloader
from trainer.validate import MixtureValidator, Validator

SEQ = 16
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("assets/tokenizer/shakespeare.tiktoken")


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """Three sources, one per local format; the small text file runs out first."""
    folder = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    prose = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 80)))) for _ in range(80)]
    datasets.Dataset.from_dict({"text": prose}).to_parquet(folder / "prose.parquet")
    code = [f"def f{i}(): return " + " ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for i in range(60)]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    (folder / "notes.txt").write_text("\n\n".join(f"note {i}: " + " ".join(WORDS[i % 7 :]) for i in range(30)))
    return [
        f"0.5 parquet {folder / 'prose.parquet'}",
        f"0.3 json {folder / 'code.jsonl'}",
        f"0.2 text {folder / 'notes.txt'}",
    ]


def mixture(tok, entries, batch_size=8, dp_rank=0, dp_world_size=1, seed=7):
    return build_mixture_dataloader(
        tokenizer=tok,
        sources=parse_mixture(entries),
        seq_len=SEQ,
        batch_size=batch_size,
        global_batch_size=8,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
    )


def global_batches(loaders, steps):
    """The global batches of ``steps`` steps as [8, SEQ] inputs: each rank's micro-batches put back
    in the loader's row order (micro-batch m, then rank r)."""
    out = []
    for _ in range(steps):
        per_rank = [[next(dl)[0] for _ in range(dl.accum_steps)] for dl in loaders]
        out.append(torch.cat([mb[m] for m in range(loaders[0].accum_steps) for mb in per_rank]))
    return out


@pytest.mark.parametrize("seed", [0, 1, 42, 1234])
def test_draw_shares_follow_the_weights(seed):
    sampler = MixtureSampler([0.5, 0.3, 0.2], seed)
    counts = np.bincount([sampler.source_of(k) for k in range(10_000)], minlength=3)
    shares = counts / 10_000
    assert np.all(np.abs(shares - [0.5, 0.3, 0.2]) <= 0.01 * np.array([0.5, 0.3, 0.2])), shares
    # Integer arithmetic, the same on every CPU: the low-discrepancy draw is a few windows off.
    assert np.abs(counts - [5000, 3000, 2000]).max() <= 3, counts
    # Unnormalised weights draw the same: only their ratios count.
    scaled = MixtureSampler([5, 3, 2], seed)
    assert all(scaled.source_of(k) == sampler.source_of(k) for k in range(1000))


def test_token_counts_match_the_draw(tok, entries):
    dl = mixture(tok, entries)
    batches = global_batches([dl], 25)  # 200 windows
    sampler = MixtureSampler([0.5, 0.3, 0.2], 7)
    counts = np.bincount([sampler.source_of(k) for k in range(200)], minlength=3)
    names = [s.name for s in parse_mixture(entries)]
    assert dl.metrics() == {f"tokens/{n}": int(c) * SEQ for n, c in zip(names, counts)}
    assert len(batches) == 25


def test_same_windows_in_every_layout_and_after_a_resume_into_another(tok, entries):
    one = mixture(tok, entries)
    reference = global_batches([one], 6)
    two = [mixture(tok, entries, batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]  # 2 micro-batches each
    assert all(torch.equal(a, b) for a, b in zip(reference, global_batches(two, 6)))
    # Step 3's checkpoint of the 1-rank run, resumed on 2 ranks, continues with steps 4-6 bit for bit.
    restarted = mixture(tok, entries)
    global_batches([restarted], 3)
    state = restarted.state_dict()
    resumed = [mixture(tok, entries, batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for dl in resumed:
        dl.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(reference[3:], global_batches(resumed, 3)))
    assert resumed[0].metrics() == one.metrics()
    # Mid-step (after one of rank 0's two micro-batches): the saved rows continue exactly too.
    mid = mixture(tok, entries, batch_size=2, dp_rank=0, dp_world_size=2)
    mid.load_state_dict(state)
    next(mid)
    again = mixture(tok, entries, batch_size=2, dp_rank=0, dp_world_size=2)
    again.load_state_dict(mid.state_dict())
    assert torch.equal(next(again)[0], reference[3][4:6])


def test_a_source_that_runs_out_restarts_and_says_so(tok, entries, caplog):
    dl = mixture(tok, entries)
    with caplog.at_level(logging.INFO, logger="trainer"):
        global_batches([dl], 40)
    restarts = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert restarts and all("notes.txt" in m for m in restarts), restarts
    assert "restarts as epoch 1" in restarts[0]
    position = json.loads(dl.state_dict()["mixture"])["sources"]
    assert position[parse_mixture(entries)[2].name]["epoch"] == len(restarts)


@pytest.mark.slow
def test_streaming_bundled_source_resumes_and_a_changed_mixture_loads(tok, entries, caplog, monkeypatch):
    # The bundled corpus read as a stream: its HF position goes through the state's JSON.
    import trainer.data.datasets as ds

    load = ds._load_documents
    monkeypatch.setattr(ds, "_load_documents", lambda d, p, split, streaming: load(d, p, split, d == "shakespeare"))
    streamed = ["0.5 shakespeare", *entries[1:]]
    dl = mixture(tok, streamed)
    global_batches([dl], 3)
    state = dl.state_dict()
    assert json.loads(state["mixture"])["sources"]["shakespeare"]["stream_state"] is not None
    reference = global_batches([dl], 2)
    resumed = mixture(tok, streamed)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(reference, global_batches([resumed], 2)))
    # Another mixture: the common sources continue, a new one starts, a dropped one is named.
    changed = mixture(tok, [*streamed[:2], entries[2].replace("text", "auto", 1)])
    with caplog.at_level(logging.INFO, logger="trainer"):
        changed.load_state_dict(state)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "auto:" in messages and "is new to this run" in messages
    assert "text:" in messages and "is not in training.dataset_mix" in messages


def test_validation_per_source_and_weighted_mean():
    class Fixed(Validator):
        def __init__(self, loss):
            self.loss, self.ema = loss, None

        def evaluate(self):
            return self.loss

    record = MixtureValidator({"a": (0.5, Fixed(2.0)), "b": (0.3, Fixed(3.0)), "c": (0.2, Fixed(5.0))}).record()
    assert record == pytest.approx({"val_loss": 2.9, "val_loss/a": 2.0, "val_loss/b": 3.0, "val_loss/c": 5.0})

    class WithEMA(Fixed):  # ema.validate: each source also scored with the averaged weights
        def record(self):
            return {"val_loss": self.loss, "val_loss_ema": self.loss - 1}

    record = MixtureValidator({"a": (0.75, WithEMA(2.0)), "b": (0.25, WithEMA(6.0))}).record()
    assert record == pytest.approx(
        {"val_loss": 3.0, "val_loss/a": 2.0, "val_loss/b": 6.0, "val_loss_ema": 2.0, "val_loss_ema/a": 1.0, "val_loss_ema/b": 5.0}
    )


@pytest.mark.parametrize(
    "entry, words",
    [
        ("0 shakespeare", ["weight must be a positive number, got 0"]),
        ("-0.5 shakespeare", ["weight must be a positive number"]),
        ("nan shakespeare", ["weight must be a positive number"]),
        ("half shakespeare", ["the weight 'half' is not a number", "WEIGHT DATASET [PATH]"]),
        ("0.5", ["has no dataset"]),
        ("0.5 shakespear", ["unknown source 'shakespear'", "did you mean '0.5 shakespeare'"]),
        ("0.5 jsonl data.jsonl", ["unknown source 'jsonl'", "did you mean '0.5 json data.jsonl'"]),
        ("0.5 data/code.jsonl", ["unknown source 'data/code.jsonl'", "'0.5 json data/code.jsonl'"]),
        ("0.5 json", ["'json' reads local files: add the path"]),
        ("0.5 shakespeare x.txt", ["takes no path", "'0.5 json x.txt'"]),
    ],
)
def test_bad_entries_are_one_line(entry, words):
    with pytest.raises(ConfigError) as err:
        load_config(["--training.dataset_mix", f"1 shakespeare,{entry}"])
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


def test_config_conflicts_and_duplicates():
    with pytest.raises(ConfigError, match="names 'shakespeare' twice"):
        load_config(["--training.dataset_mix", "1 shakespeare,2 shakespeare"])
    with pytest.raises(ConfigError, match="training.dataset_mix replaces training.dataset = 'json'"):
        load_config(
            [
                "--training.dataset_mix",
                "1 shakespeare",
                "--training.dataset",
                "json",
                "--training.dataset_path",
                "a.jsonl",
            ]
        )
    with pytest.raises(ConfigError, match="validation uses each source of training.dataset_mix"):
        load_config(["--training.dataset_mix", "1 shakespeare", "--validation.dataset_path", "v.jsonl"])
    cfg = load_config(["--training.dataset_mix", "0.7 shakespeare, 0.3 someone/hub-set en"])
    assert [(s.weight, s.dataset, s.path) for s in parse_mixture(cfg.training.dataset_mix)] == [
        (0.7, "shakespeare", None),
        (0.3, "someone/hub-set", "en"),
    ]


def test_prelaunch_check_refuses_a_missing_file(capsys, tmp_path, entries):
    run = ["--world-size", "1", "--job.dump_folder", str(tmp_path / "run")]
    assert check_main([*run, "--training.dataset_mix", ",".join(entries)]) == 0
    assert check_main([*run, "--training.dataset_mix", f"1 shakespeare,1 json {tmp_path / 'nope.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "training.dataset_mix source 'json:" in err and "does not exist" in err
    assert check_main([*run, "--training.dataset_mix", "1 shakespeare,x shakespeare"]) == 2
    assert "is not a number" in capsys.readouterr().err
