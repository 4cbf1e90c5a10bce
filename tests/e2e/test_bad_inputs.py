"""User mistakes through run_train.sh, as a user makes them: each fails fast with exit code 2 and
one `error:` line per failing process that names the key or the file, and no traceback.

Mistakes in the launch environment (NGPU, LOG_RANK, RESTARTS), the config file (encoding, layout, keys), the
dump folder and local data files (missing or empty) are caught before any process starts (by
run_train.sh and the pre-launch check); the others (data files that do not parse, a model the
layout cannot split) by every worker, whose lines run_train.sh prints as `[rankN] ...` instead of
the launcher's traceback. One worker-side mistake goes through run_train.sh at 1 and 2 processes;
the others, whose lines take the same way, run in this process (`run_in_process`), as do the resumes.
Resuming with another data shape, or past a damaged checkpoint folder, is no mistake but is logged."""

import base64
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from in_process import run_main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--no-validation.enable", "--lr_scheduler.warmup_steps", "0", "--no-job.print_config",
]


def run_train(tmp_path, ngpu, *args, **env):
    env = {
        **os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "MASTER_PORT": "", **env,
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
        (2, ["--parallelism.pp_schedule", "1f1b"], ["parallelism.pp_schedule = '1f1b'", "GPipe, 1F1B", "'1F1B'?"]),
        # The flavor's shape is read without torch: heads tp does not divide are refused before launch.
        (3, ["--parallelism.tp", "3", "--training.seq_len", "33"], ["parallelism.tp = 3", "n_heads = 4"]),
        # Launched, it would compile for minutes and then fail in DTensor's backward (docs/compile.md).
        (2, ["--parallelism.tp", "2", "--training.compile"], ["parallelism.tp = 2 with training.compile", "drop --training.compile"]),
    ],
)
def test_config_mistakes_fail_before_launch(tmp_path, ngpu, args, names):
    proc, seconds = run_train(tmp_path, ngpu, *args)
    assert_refused(proc, seconds, ngpu, *names, prelaunch=True)
    assert proc.stderr.startswith("config error: ")
    assert not (tmp_path / "run").exists()


def launch_files(tmp_path):
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf[training]\nsteps = 1\n")
    (tmp_path / "latin1.toml").write_bytes('[job]\ndescription = "café"\n'.encode("latin-1"))
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty.jsonl").write_text("")


@pytest.mark.parametrize(
    "ngpu, env, args, names",
    [
        (1, {"CONFIG_FILE": "latin1.toml"}, [], ["latin1.toml is not UTF-8", "line 2", "convert it"]),
        (2, {"CONFIG_FILE": "latin1.toml"}, [], ["latin1.toml is not UTF-8", "line 2", "convert it"]),
        (1, {"CONFIG_FILE": "bom.toml"}, [], ["bom.toml starts with a UTF-8 byte-order mark", "without BOM"]),
        (2, {"CONFIG_FILE": "bom.toml"}, [], ["bom.toml starts with a UTF-8 byte-order mark", "without BOM"]),
        (1, {}, ["--job.dump_folder", "a_file/run"], ["job.dump_folder = 'a_file/run'", "is a file", "--job.dump_folder"]),
        (2, {}, ["--job.dump_folder", "a_file/run"], ["job.dump_folder = 'a_file/run'", "is a file", "--job.dump_folder"]),
        ("two", {}, [], ["NGPU=two", "positive integer", "NGPU=2"]),
        (2, {"LOG_RANK": "5"}, [], ["LOG_RANK=5", "0..1 with NGPU=2", "LOG_RANK=0"]),
        (1, {"LOG_RANK": "0,x"}, [], ["LOG_RANK=0,x", "0..0 with NGPU=1"]),
        (2, {"RESTARTS": "-1"}, [], ["RESTARTS=-1", "integer 0..1000", "RESTARTS=3"]),
        (1, {"RESTARTS": "2"}, [], ["RESTARTS=2", "checkpoint.enable is off", "pass --checkpoint.enable"]),
        (2, {}, ["--training.dataset", "json", "--training.dataset_path", "empty.jsonl"],
         ["training.dataset_path", "empty.jsonl is empty"]),
    ],
)
def test_launch_mistakes_fail_before_launch(tmp_path, ngpu, env, args, names):
    launch_files(tmp_path)
    proc, seconds = run_train(tmp_path, ngpu, *args, **env)
    assert_refused(proc, seconds, 1, *names, prelaunch=True)
    assert proc.stderr.startswith("config error: ")
    assert not (tmp_path / "run").exists()


def bad_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text("this is not json\n{{{\n")
    (tmp_path / "docs.jsonl").write_text('{"text": "a line of text"}\n' * 50)
    (tmp_path / "random.tiktoken").write_bytes(bytes(range(256)) * 8)
    # The bundled tokenizer (8189 ranks + 3 specials = the debug flavor's 8192 rows) and one token more.
    bundled = (REPO / "assets" / "tokenizer" / "shakespeare.tiktoken").read_text()
    (tmp_path / "big.tiktoken").write_text(bundled + base64.b64encode(b"zzqzzq").decode() + " 8189\n")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize("ngpu", [1, 2])
def test_worker_side_mistakes_give_one_line_per_rank(tmp_path, ngpu):
    # Every worker-side mistake reaches the user this way: trainer.train's main turns the
    # OSError/ValueError into one line, run_train.sh prints it per rank.
    bad_files(tmp_path)
    proc, seconds = run_train(tmp_path, ngpu, "--training.dataset", "json", "--training.dataset_path", "bad.jsonl")
    assert_refused(proc, seconds, ngpu, "bad.jsonl", "json", prelaunch=False)


@pytest.mark.parametrize(
    "args, names",
    [
        (["--training.dataset", "parquet", "--training.dataset_path", "docs.jsonl"],
         ["dataset_path docs.jsonl cannot be read as parquet", "--training.dataset json"]),
        (["--training.dataset", "someone/no-such-dataset"], ["'someone/no-such-dataset'", "Offline"]),
        (["--model.tokenizer_path", "random.tiktoken"], ["random.tiktoken"]),
        (["--model.tokenizer_path", "big.tiktoken"], ["big.tiktoken has 8193 ids", "'debugmodel' embeds 8192"]),
        (["--checkpoint.initial_load_path", "hf", "--checkpoint.initial_load_format", "hf"], ["model.safetensors"]),
    ],
)
def test_worker_side_mistakes_name_the_file(tmp_path, capfd, args, names):
    """Each reaches the user as the bad.jsonl launches above show; only the message differs."""
    bad_files(tmp_path)
    proc, seconds = run_in_process(tmp_path, capfd, *args)
    assert_refused(proc, seconds, 1, *names, prelaunch=False)


def run_in_process(tmp_path, capfd, *args):
    """`trainer.train.main` as an NGPU=1 run_train.sh execs it, from tmp_path (tests/e2e/in_process.py),
    as a completed process."""
    start = time.perf_counter()
    code = run_main(tmp_path, "--job.dump_folder", str(tmp_path / "run"), *SMALL, *args)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err), time.perf_counter() - start


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(tmp_path, capfd):
    proc, seconds = run_in_process(tmp_path, capfd, "--training.device", "cuda")
    assert_refused(proc, seconds, 1, "training.device = 'cuda'", "--training.device cpu", prelaunch=False)


def test_resume_notes_changed_shapes_and_warns_of_a_checkpoint_without_metadata(tmp_path):
    """Not mistakes to refuse, but worth a line: a resume that changes the sequence length or the
    global batch (the docs ask to keep them), and a step-N folder that lost its .metadata.
    Both runs in this process (the quickest way to a checkpoint and back: the lines come from the
    Trainer's resume, whatever the number of processes; a resume in another layout through
    run_train.sh: tests/e2e/test_layout_parity.py::test_checkpoint_resumes_in_another_layout)."""
    run = tmp_path / "run"
    common = [*SMALL, "--job.dump_folder", str(run), "--checkpoint.enable", "--checkpoint.interval", "1"]
    assert run_main(tmp_path, *common, "--training.steps", "2") == 0  # saves steps 1 and 2
    (run / "checkpoint" / "step-2" / ".metadata").unlink()
    # The resume doubles the global batch (local batch 2 -> 4) and takes seq_len 32 -> 48.
    assert run_main(tmp_path, *common, "--training.steps", "3", "--training.seq_len", "48",
                    "--training.local_batch_size", "4") == 0
    log = (run / "train.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert f"skipping {run / 'checkpoint' / 'step-2'}: it has no .metadata" in log, log[-3000:]
    assert f"resumed from {run / 'checkpoint' / 'step-1'} (step 1)" in log
    assert "note: resumed with training.seq_len 32 -> 48, training.global_batch_size 2 -> 4" in log
