"""User mistakes through run_train.sh, as a user makes them: each fails fast with exit code 2 and
one `error:` line per failing process that names the key or the file, and no traceback.

Layout and config mistakes are caught by the pre-launch check before any process starts; the
others (files that turn out unreadable, a model the layout cannot split) by every worker, whose
lines run_train.sh prints as `[rankN] ...` instead of the launcher's traceback."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--no-validation.enable", "--lr_scheduler.warmup_steps", "0", "--no-job.print_config",
]


def run_train(tmp_path, ngpu, *args):
    env = {
        **os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "MASTER_PORT": str(20000 + (os.getpid() * 7 + ngpu) % 20000),
    }
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path / "run"), *SMALL, *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    return proc, time.perf_counter() - start


def assert_refused(proc, seconds, ngpu, *names, prelaunch):
    # `seconds` only goes into a failure's message: no test asserts a duration (a busy machine
    # stretches any); a refusal before launch shows in the run folder that was not created.
    out = proc.stdout + proc.stderr + f"\n(exit {proc.returncode} after {seconds:.1f} s)"
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # The message lines: the one of the pre-launch check or of a single process, or run_train.sh's
    # "[rankN] ..." per failing worker (the workers' live output is prefixed "[rankN]:").
    messages = [line for line in proc.stderr.splitlines() if re.match(r"(config )?error: |\[rank\d+\] ", line)]
    if prelaunch or ngpu == 1:
        assert len(messages) == 1, proc.stderr
    else:
        assert 1 <= len(messages) <= ngpu and all(m.startswith("[rank") for m in messages), proc.stderr
    for message in messages:
        for name in names:
            assert name in message, message


@pytest.mark.parametrize(
    "ngpu, args, names",
    [
        (2, ["--parallelism.tp", "4"], ["parallelism", "x tp = 1 x 1 x 4 = 4 does not divide the world size 2"]),
        (1, ["--parallelism.ep", "2"], ["parallelism.ep = 2 must divide"]),
        (2, ["--parallelism.cp", "2", "--training.seq_len", "102"], ["training.seq_len = 102", "parallelism.cp"]),
        (2, ["--parallelism.expert_parallel_degree", "2"], ["did you mean --parallelism.ep?"]),
        (1, ["--parallelism.data_parallel_shard_degree", "2"], ["did you mean --parallelism.dp_shard?"]),
        (1, ["--training.dataset_path", "x.jsonl"], ["training.dataset_path = 'x.jsonl' is ignored"]),
        (2, ["--training.dataset_path", "x.jsonl"], ["training.dataset_path = 'x.jsonl' is ignored"]),
        (2, ["--parallelism.expert_parallel_comm_backend", "deepep"], ["parallelism.expert_parallel_comm_backend"]),
    ],
)
def test_config_mistakes_fail_before_launch(tmp_path, ngpu, args, names):
    proc, seconds = run_train(tmp_path, ngpu, *args)
    assert_refused(proc, seconds, ngpu, *names, prelaunch=True)
    assert proc.stderr.startswith("config error: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ngpu", [1, 2])
def test_rerun_into_a_used_run_folder_is_refused(tmp_path, ngpu):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    proc, seconds = run_train(tmp_path, ngpu)
    assert_refused(proc, seconds, ngpu, "job.dump_folder", "--checkpoint.enable", prelaunch=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"


def bad_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text("this is not json\n{{{\n")
    (tmp_path / "random.tiktoken").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize(
    "ngpu, args, names",
    [
        (1, ["--training.dataset", "json", "--training.dataset_path", "bad.jsonl"], ["bad.jsonl", "json"]),
        (2, ["--training.dataset", "json", "--training.dataset_path", "bad.jsonl"], ["bad.jsonl", "json"]),
        (1, ["--training.dataset", "someone/no-such-dataset"], ["'someone/no-such-dataset'", "Offline"]),
        (1, ["--model.tokenizer_path", "random.tiktoken"], ["random.tiktoken"]),
        (2, ["--model.tokenizer_path", "random.tiktoken"], ["random.tiktoken"]),
        (1, ["--checkpoint.initial_load_path", "hf", "--checkpoint.initial_load_format", "hf"], ["model.safetensors"]),
        (3, ["--parallelism.tp", "3", "--training.seq_len", "33"], ["parallelism.tp = 3", "n_heads = 4"]),
    ],
)
def test_worker_side_mistakes_give_one_line_per_rank(tmp_path, ngpu, args, names):
    bad_files(tmp_path)
    proc, seconds = run_train(tmp_path, ngpu, *args)
    assert_refused(proc, seconds, ngpu, *names, prelaunch=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(tmp_path):
    proc, seconds = run_train(tmp_path, 1, "--training.device", "cuda")
    assert_refused(proc, seconds, 1, "training.device = 'cuda'", "--training.device cpu", prelaunch=False)
