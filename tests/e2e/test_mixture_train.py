"""A weighted mixture of three sources (the bundled corpus, a jsonl file, a text file) trained as a
user runs it: the same per-step losses, per-source token counts and per-source validation losses
in 1 process and in dp_shard 2 x ep 2 (run_train.sh, 2 processes), a checkpoint resumed in the same
layout repeating the uninterrupted run bit for bit, and the 2-process run's checkpoint resumed in 1
process continuing on the same samples (trainer/data/mixture.py).

Launches are the cost (tests/e2e/test_layout_parity.py): one run_train.sh launch; the 1-process
runs go through `trainer.train.main` in this process. The text source's training part is smaller
than its share of ten steps, so it restarts (and says so in the log); the held-out documents of
the local sources (every 20th) are long enough for one validation batch each.

Bound: rel 1e-5 across layouts (sharding only reorders fp32 sums), exact within one layout.
"""

import json
import shutil
from pathlib import Path

import pytest
from in_process import COMMON, assert_close, run_layout

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
RUN = [
    *COMMON,
    "--training.steps",
    "10",
    "--validation.freq",
    "5",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
    "--checkpoint.keep_latest_k",
    "0",
]
SINGLE = ["--training.local_batch_size", "8"]
DP2_EP2 = ["--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.local_batch_size", "2"]


def _long(i: int) -> str:
    return f"held out {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(200))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> the run's records by step; the runs share the data files and checkpoints."""
    root = tmp_path_factory.mktemp("mixture")
    # Every 20th document (19, 39, ...) is held out for validation: those are long, the rest short.
    code = [_long(i) if i % 20 == 19 else f"def f{i}(): return {WORDS[i % 15]}" for i in range(60)]
    (root / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    notes = [_long(i) if i % 20 == 19 else f"note {i}: {' '.join(WORDS[:4])}" for i in range(40)]
    (root / "notes.txt").write_text("\n\n".join(notes))
    mix = ["--training.dataset_mix", f"0.5 shakespeare,0.3 json {root / 'code.jsonl'},0.2 text {root / 'notes.txt'}"]
    cache: dict[str, dict[int, dict]] = {}

    def get(name: str, nproc: int, flags: list[str], start_from: Path | None = None) -> dict[int, dict]:
        if name not in cache:
            if start_from is not None:
                shutil.copytree(start_from, root / name / "checkpoint" / start_from.name)
            cache[name] = run_layout(root / name, nproc, [*RUN, *mix, *flags])
        return cache[name]

    get.root = root
    return get


def _step5(runs, name: str) -> Path:
    return runs.root / name / "checkpoint" / "step-5"


def test_losses_tokens_and_validation_per_source_match_one_process(runs):
    single = runs("single", 1, SINGLE)
    sharded = runs("dp2_ep2", 2, DP2_EP2)
    tokens = [k for k in single[10] if k.startswith("tokens/")]
    val = [k for k in single[10] if k.startswith("val_loss/")]
    assert len(tokens) == len(val) == 3
    for step in range(1, 11):
        assert_close(f"step {step} loss", sharded[step]["loss"], single[step]["loss"])
        assert {k: sharded[step][k] for k in tokens} == {k: single[step][k] for k in tokens}
        assert sum(single[step][k] for k in tokens) == step * 8 * 32
    for step in (0, 5, 10):
        for key in ["val_loss", *val]:
            assert_close(f"step {step} {key}", sharded[step][key], single[step][key])
    shares = [single[10][k] / (10 * 8 * 32) for k in tokens]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.05)  # 80 windows: a few windows from the weights
    assert single[5]["loss"] < single[1]["loss"]
    log = (runs.root / "single" / "train.log").read_text()
    assert "notes.txt ran out after" in log and "it restarts as epoch 1" in log


def test_checkpoint_resumes_exactly_and_into_another_layout(runs):
    single = runs("single", 1, SINGLE)
    sharded = runs("dp2_ep2", 2, DP2_EP2)
    same = runs("single_resumed", 1, SINGLE, start_from=_step5(runs, "single"))
    other = runs("dp2_ep2_resumed_in_single", 1, SINGLE, start_from=_step5(runs, "dp2_ep2"))
    assert sorted(s for s in same if "loss" in same[s]) == list(range(6, 11))
    for step in range(6, 11):
        assert same[step]["loss"] == single[step]["loss"]  # bit for bit
        assert_close(f"dp2 x ep2 resumed in 1 process, step {step}", other[step]["loss"], sharded[step]["loss"])
        tokens = {k: v for k, v in single[step].items() if k.startswith("tokens/")}
        assert {k: other[step][k] for k in tokens} == {k: same[step][k] for k in tokens} == tokens
    assert same[10]["val_loss"] == single[10]["val_loss"]
    for name in ("single_resumed", "dp2_ep2_resumed_in_single"):
        log = (runs.root / name / "train.log").read_text()
        assert "resumed from" in log and "not restored" not in log
