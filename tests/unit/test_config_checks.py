"""Config checks that need no torch: cross-section combinations, warnings, foreign option names,
and the pre-launch check `python -m trainer.config.check` that run_train.sh runs."""

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.check import main

REPO = Path(__file__).resolve().parents[2]


# A lighthouse address nothing answers at (a fault-tolerant config's other problems come first).
FT = ["--fault_tolerance.enable", "--parallelism.dp_replicate", "2", "--fault_tolerance.lighthouse", "http://127.0.0.1:1"]


def error(argv):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    return str(err.value)


@pytest.mark.parametrize(
    "name, ours",
    [
        ("expert_parallel_degree", "ep"),
        ("tensor_parallel_degree", "tp"),
        ("context_parallel_degree", "cp"),
        ("data_parallel_shard_degree", "dp_shard"),
        ("data_parallel_replicate_degree", "dp_replicate"),
    ],
)
def test_torchtitan_names_point_to_ours(tmp_path, name, ours):
    assert f"did you mean --parallelism.{ours}?" in error([f"--parallelism.{name}", "2"])
    toml = tmp_path / "tt.toml"
    toml.write_text(f"[parallelism]\n{name} = 2\n")
    assert f"did you mean parallelism.{ours}?" in error(["--config", str(toml)])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--training.dataset_path", "x.jsonl"], ["training.dataset_path = 'x.jsonl' is ignored", "--training.dataset json"]),
        (["--training.dataset", "json"], ["training.dataset = 'json' reads local files", "--training.dataset_path"]),
        (["--validation.dataset_path", "v.jsonl"], ["validation.dataset_path = 'v.jsonl' is ignored", "--validation.dataset"]),
        (
            ["--validation.dataset", "shakespeare", "--validation.dataset_path", "v.jsonl"],
            ["validation.dataset_path = 'v.jsonl' is ignored by validation.dataset = 'shakespeare'"],
        ),
        (["--validation.dataset", "text"], ["validation.dataset = 'text' reads local files"]),
    ],
)
def test_ignored_inputs_are_refused(argv, words):
    message = error(argv)
    assert "\n" not in message  # one problem, one line
    for w in words:
        assert w in message


def test_dry_run_refuses_muon_beyond_one_rank():
    message = error(["--job.dry_run", "--optimizer.name", "muon", "--dry_run.world_size", "8"])
    assert "\n" not in message
    assert "cannot rehearse optimizer.name = 'muon' at dry_run.world_size = 8" in message
    assert "--optimizer.name adamw" in message
    load_config(["--job.dry_run", "--optimizer.name", "muon", "--dry_run.world_size", "1"])


def test_inputs_that_are_used_pass():
    load_config(["--training.dataset", "json", "--training.dataset_path", "x.jsonl"])
    load_config(["--training.dataset", "json", "--training.dataset_path", "x.jsonl", "--validation.dataset_path", "v.jsonl"])
    load_config(["--training.dataset", "someone/hub-set", "--training.dataset_path", "config-name"])
    # A path under disabled validation is not read, and not an error either.
    load_config(["--validation.dataset_path", "v.jsonl", "--no-validation.enable"])


def test_warnings_name_what_is_ignored():
    warnings = load_config([
        "--training.steps", "5", "--lr_scheduler.warmup_steps", "10", "--engram.max_ngram", "4",
        "--checkpoint.interval", "7", "--quantize.emulate", "--training.time_limit_minutes", "3",
    ]).warnings()
    text = "\n".join(warnings)
    assert "lr_scheduler.warmup_steps = 10 is more than training.steps = 5" in text
    assert "engram.max_ngram = 4 is ignored: engram.enable is false" in text
    assert "checkpoint.interval = 7 is ignored: checkpoint.enable is false" in text
    assert "quantize.emulate = true is ignored: quantize.float8 is false" in text
    assert "training.time_limit_minutes stops the run without saving it" in text
    assert len(warnings) == 5


def test_no_warnings_for_defaults_bundled_configs_and_deliberate_switches():
    assert load_config([]).warnings() == []
    for toml in sorted((REPO / "train_configs").glob("*.toml")):
        assert load_config(["--config", str(toml)]).warnings() == [], toml.name
    # Switched off on purpose: its settings stay quiet.
    assert load_config(["--no-validation.enable", "--validation.steps", "3"]).warnings() == []
    assert load_config(["--engram.enable", "--engram.max_ngram", "4"]).warnings() == []


@pytest.mark.parametrize(
    "world, argv, words",
    [
        (2, ["--parallelism.tp", "4"], ["dp_replicate x cp x tp = 1 x 1 x 4 = 4 does not divide the world size 2"]),
        (2, ["--parallelism.cp", "2", "--training.seq_len", "102"], ["training.seq_len = 102", "2 x parallelism.cp = 4", "104"]),
        (2, ["--parallelism.tp", "2", "--training.seq_len", "101"], ["training.seq_len = 101", "parallelism.tp = 2"]),
        (4, ["--parallelism.dp_shard", "4", "--parallelism.ep", "3"], ["parallelism.ep = 3 must divide"]),
        (2, ["--training.global_batch_size", "24"], ["global_batch_size = 24", "8 x 2", "multiple of 16"]),
        (2, ["--training.stpes", "3"], ["did you mean --training.steps"]),
        # Measured to fail only after minutes of compiling (issue 44).
        (2, ["--parallelism.tp", "2", "--training.compile"], ["parallelism.tp = 2 with training.compile", "drop --training.compile"]),
        # Advice the same check accepts (issue 44): no dp_shard that ep cannot divide, no
        # micro-batch count the schedule refuses.
        (
            2000, ["--model.flavor", "671B", "--parallelism.pp", "16", "--parallelism.ep", "64", "--parallelism.dp_shard", "128"],
            ["!= world size 2000; use a world size that is a multiple of 1024", "dp_shard = 125 would leave"],
        ),
        (
            4, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.dp_shard", "2",
                "--training.local_batch_size", "2"],
            ["pick pp_microbatches in none: raise local_batch_size"],
        ),
        (
            4, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.dp_shard", "2",
                "--training.local_batch_size", "6"],
            ["pick pp_microbatches in [6]"],
        ),
        # Pipeline layouts torch's schedules would refuse (issue 20).
        (4, ["--parallelism.pp", "3"], ["parallelism.pp = 3 does not divide the world size 4", "[1, 2, 4]"]),
        (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Looped"], ["pp_schedule = 'Looped'", "LoopedBFS"]),
        (2, ["--parallelism.pp", "2", "--parallelism.pp_microbatches", "1"], ["pp_microbatches = 1 is fewer than the 2"]),
        (
            2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_microbatches", "2"],
            ["fewer than the 4 stages"],
        ),
        (
            2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble", "--parallelism.pp_stages_per_rank", "3"],
            ["V schedule: it needs exactly 2 stages per rank"],
        ),
        (2, ["--parallelism.pp", "2", "--parallelism.pp_stages_per_rank", "2"], ["'1F1B' runs one stage per rank"]),
        (
            2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble", "--training.compile"],
            ["compiled block is one autograd node", "Interleaved1F1B"],
        ),
        (2, ["--parallelism.pp", "2", "--parallelism.pp_layout", "Et*3|Lt*3"], ["exactly one L, at the end"]),
        # The MoE all-to-all overlap (issue 31): what it does not run, one line each.
        (2, ["--parallelism.moe_overlap"], ["parallelism.moe_overlap overlaps the expert-parallel", "ep > 1"]),
        (
            2, ["--parallelism.moe_overlap", "--parallelism.ep", "2", "--training.compile"],
            ["moe_overlap runs each MoE block eagerly node by node: drop --training.compile"],
        ),
        (
            2, ["--parallelism.moe_overlap", "--parallelism.ep", "2", "--activation_checkpoint.mode", "full"],
            ["never recomputes a block", "--activation_checkpoint.mode none", "drop --parallelism.moe_overlap"],
        ),
        (
            4, ["--parallelism.moe_overlap", "--parallelism.ep", "2", "--parallelism.pp", "2"],
            ["moe_overlap with pp needs pp_schedule DualPipeV", "--parallelism.pp_schedule DualPipeV"],
        ),
        # Read from the flavor table without torch: the debug model has 6 blocks and 4 heads, 671B 256 experts.
        (8, ["--parallelism.pp", "8"], ["8 stages", "only 6 blocks"]),
        (4, ["--parallelism.pp", "4", "--parallelism.pp_stages_per_rank", "2", "--parallelism.pp_schedule", "Interleaved1F1B"],
         ["8 stages", "only 6 blocks"]),
        (8, ["--parallelism.tp", "8", "--training.seq_len", "64"], ["parallelism.tp = 8 must divide the model's n_heads = 4"]),
        (64, ["--model.flavor", "671B", "--parallelism.pp", "64", "--training.local_batch_size", "64"], ["64 stages", "only 61 blocks"]),
        (2, ["--model.flavor", "671b"], ["model.flavor", "did you mean '671B'"]),
        (1, ["--model.name", "llama3"], ["model.name = 'llama3' is not allowed", "deepseek_v3"]),
        (2, ["--parallelism.pp", "2", "--parallelism.pp_layout", "Et*3|t*3X"], ["cannot read 'X'"]),
        (4, ["--parallelism.pp", "2", "--training.local_batch_size", "3"], ["pp_microbatches = 2 must divide training.local_batch_size = 3"]),
        # run_train.sh's RESTARTS: a restart resumes from the newest checkpoint (issue 34).
        (2, ["--restarts", "1"], ["RESTARTS=1", "checkpoint.enable is off", "pass --checkpoint.enable", "unset RESTARTS"]),
        (
            2, ["--restarts=2", "--checkpoint.enable", "--checkpoint.load_step", "4"],
            ["RESTARTS=2 with checkpoint.load_step = 4", "load step 4 again", "drop --checkpoint.load_step"],
        ),
        # Fault-tolerant replica groups (issue 43): each launch is one dp_replicate slice.
        (2, ["--fault_tolerance.enable"], ["needs parallelism.dp_replicate >= 2", "--parallelism.dp_replicate 2"]),
        (
            2, [*FT, "--fault_tolerance.replica_id", "2"],
            ["fault_tolerance.replica_id = 2 is not one of the parallelism.dp_replicate = 2", "pick 0 .. 1"],
        ),
        (2, [*FT, "--fault_tolerance.min_replicas", "3"], ["min_replicas = 3 is more than", "pick 1 .. 2"]),
        (2, [*FT, "--parallelism.pp", "2"], ["fault_tolerance with parallelism.pp = 2", "--parallelism.pp 1"]),
        (2, [*FT, "--optimizer.qk_clip"], ["fault_tolerance with optimizer.qk_clip", "drop --optimizer.qk_clip"]),
        (2, [*FT, "--job.dry_run"], ["job.dry_run with fault_tolerance", "drop --fault_tolerance.enable"]),
        (2, [*FT, "--ema.enable"], ["fault_tolerance with ema.enable", "drop --ema.enable"]),
        # The job's layout is the launch's world times the groups: 2 x 3 ranks cannot hold ep 4.
        (3, [*FT, "--parallelism.ep", "4"], ["parallelism.ep = 4 must divide dp_shard x cp = 3 x 1"]),
        (2, ["--fault_tolerance.enable", "--parallelism.dp_replicate", "2"], ["needs the torchft lighthouse's address"]),
    ],
)
def test_prelaunch_check_refuses_with_one_line(capsys, monkeypatch, tmp_path, world, argv, words):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert main(["--world-size", str(world), "--job.dump_folder", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and err.count("\n") == 1
    for w in words:
        assert w in err


def test_prelaunch_check_passes_good_layouts(capsys, tmp_path):
    run = ["--job.dump_folder", str(tmp_path / "run")]
    assert main(["--world-size", "4", *run, "--parallelism.ep", "2", "--training.global_batch_size", "64"]) == 0
    assert main(["--world-size=2", *run, "--parallelism.cp", "2", "--training.seq_len", "104"]) == 0
    assert main(["--world-size", "2", *run, "--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV"]) == 0
    # The zero-bubble schedules with data and context parallelism (issue 30).
    for flags in (["--parallelism.dp_shard", "2", "--parallelism.ep", "2"], ["--parallelism.dp_replicate", "2"],
                  ["--parallelism.cp", "2"]):
        for schedule in ("DualPipeV", "ZBVZeroBubble", "InterleavedZeroBubble"):
            argv = ["--parallelism.pp", "2", "--parallelism.pp_schedule", schedule, *flags]
            assert main(["--world-size", "4", *run, *argv]) == 0, argv
    # The MoE all-to-all overlap inside DualPipeV's OVERLAP_F_B actions (issue 31).
    overlap = ["--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.ep", "2", "--parallelism.moe_overlap"]
    assert main(["--world-size", "4", *run, *overlap]) == 0
    assert main(["--world-size", "4", *run, "--parallelism.pp", "4", "--parallelism.pp_layout", "Et|t*2|t*2|tL"]) == 0
    assert main(["--world-size", "4", *run, "--parallelism.pp", "2", "--parallelism.cp", "2"]) == 0
    assert main(["--world-size", "4", *run, "--parallelism.pp", "2", "--parallelism.ep", "2", "--parallelism.ep_as_cp"]) == 0
    assert main(["--world-size", "64", *run, "--model.flavor", "671B", "--parallelism.pp", "8", "--parallelism.ep", "8"]) == 0
    assert main(["--world-size", "2", *run, "--restarts", "3", "--checkpoint.enable"]) == 0
    assert main(["--world-size", "2", *run, "--restarts", "0", "--checkpoint.load_step", "4"]) == 0
    # MuonClip under tensor parallelism (with FSDP) and compile (issue 32).
    clip = ["--optimizer.name", "muon", "--optimizer.qk_clip"]
    assert main(["--world-size", "4", *run, *clip, "--parallelism.tp", "2", "--parallelism.dp_shard", "2"]) == 0
    assert main(["--world-size", "2", *run, *clip, "--training.compile"]) == 0
    assert capsys.readouterr().err == ""


def test_a_dry_run_is_checked_against_the_world_it_rehearses(capsys, tmp_path):
    """`run_train.sh --job.dry_run` (issue 44): the layout is checked against dry_run.world_size,
    not NNODES x NGPU, and the check tells run_train.sh to launch one process; a taken port does
    not matter to a run that starts no rendezvous."""
    layout = ["--parallelism.pp", "2", "--parallelism.dp_shard", "4", "--parallelism.ep", "2"]
    dry = ["--job.dry_run", "--dry_run.world_size", "8", "--job.dump_folder", str(tmp_path / "run"), *layout]
    with _held_port() as port:
        assert main(["--world-size", "2", "--free-port", f"127.0.0.1:{port}", "--print-launch", *dry]) == 0
    assert capsys.readouterr().out == "dry_run\n"
    assert main(["--world-size", "2", "--print-launch", "--job.dump_folder", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == "train\n"
    assert main(["--world-size", "8", *dry, "--dry_run.world_size", "16"]) == 2
    assert "!= world size 16" in capsys.readouterr().err
    # No advice from a world that has no ranks.
    assert main(["--world-size", "1", "--job.dry_run", "--dry_run.world_size", "-8"]) == 2
    assert capsys.readouterr().err == "config error: dry_run.world_size must be >= 1, got -8.\n"


def test_prelaunch_check_needs_a_world_size():
    with pytest.raises(SystemExit, match="--world-size must be a positive integer"):
        main(["--training.steps", "3"])


def test_prelaunch_check_runs_without_torch(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from trainer.config.check import main\n"
        f"sys.exit(main(['--world-size', '2', '--job.dump_folder', {str(tmp_path)!r}, '--parallelism.pp', '2', "
        "'--parallelism.pp_stages_per_rank', '4', '--parallelism.pp_schedule', 'Interleaved1F1B']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: ") and "Traceback" not in proc.stderr
    assert "the pipeline has 8 stages" in proc.stderr  # the flavor's block count, read without torch


def test_config_files_must_be_utf8_without_bom(tmp_path):
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"bom.toml starts with a UTF-8 byte-order mark.*without BOM"):
        load_config(["--config", str(bom)])
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[training]\nsteps = 3\n[job]\ndescription = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.toml is not UTF-8 text \(byte 0xe9 on line 4\)"):
        load_config(["--config", str(latin)])


@contextlib.contextmanager
def _held_port():
    """A loopback port another program listens on, while the block runs."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_prelaunch_check_refuses_a_taken_port(capsys, tmp_path):
    run = ["--job.dump_folder", str(tmp_path / "run")]
    with _held_port() as port:
        assert main(["--world-size", "2", "--free-port", f"127.0.0.1:{port}", *run]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: MASTER_PORT={port} is in use on MASTER_ADDR=127.0.0.1") and "unset MASTER_PORT" in err
    assert main(["--world-size", "2", f"--free-port=127.0.0.1:{port}", *run]) == 0  # released


def test_prelaunch_check_refuses_a_taken_port_on_the_multinode_rendezvous_host(capsys, tmp_path):
    # Node 0 hosts the store on every address of the node: a listener on loopback alone takes it.
    run = ["--job.dump_folder", str(tmp_path / "run")]
    with _held_port() as port:
        assert main(["--world-size", "4", "--rendezvous-host-port", str(port), *run]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: MASTER_PORT={port} is in use on this node") and err.count("\n") == 1
    assert "hosts the multi-node rendezvous (NODE_RANK=0); set a free MASTER_PORT, the same on every node" in err
    assert main(["--world-size", "4", f"--rendezvous-host-port={port}", *run]) == 0  # released


def test_prelaunch_check_needs_a_lighthouse_that_answers(capsys, tmp_path):
    """A replica group that cannot reach the lighthouse fails before launch, naming the address; the
    check is a TCP connect, so a listening socket stands in for the lighthouse here."""
    run = ["--job.dump_folder", str(tmp_path / "run")]
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        address = ["--fault_tolerance.lighthouse", f"http://127.0.0.1:{port}"]
        assert main(["--world-size", "2", *run, *FT[:-2], *address, "--parallelism.ep", "2"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["--world-size", "2", *run, *FT[:-2], *address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"fault_tolerance.lighthouse http://127.0.0.1:{port}: no lighthouse answers there" in err
    assert "torchft_lighthouse --min_replicas 1" in err
