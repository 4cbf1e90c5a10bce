"""A worker's files for run_train.sh (trainer/launch_files.py): written only under the script's
multi-process launches (TRAINER_LAUNCH_DIR), one per rank and kind in the folder of torchrun's
attempt; elsewhere a user mistake is printed. A restarted worker names why the attempt before it
ended, from torchrun's line in launcher.log and that attempt's files."""

from pathlib import Path

from trainer.launch_files import previous_attempt_failure, report_user_error, write_launch_file


def test_files_only_under_run_train(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRAINER_LAUNCH_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not write_launch_file("pid", "123")
    assert report_user_error("config error: x") == 2
    assert capsys.readouterr().err == "config error: x\n"

    monkeypatch.setenv("TRAINER_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert report_user_error("config error: y") == 2
    assert capsys.readouterr().err == ""
    assert write_launch_file("exit", "0")
    assert {p.name: p.read_text() for p in (tmp_path / "attempt0").iterdir()} == {
        "rank3.err": "config error: y\n", "rank3.exit": "0\n",
    }
    # A restart writes beside the first attempt's files, which stay as they were.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert write_launch_file("exit", "0")
    assert sorted(p.name for p in (tmp_path / "attempt1").iterdir()) == ["rank3.exit"]
    assert (tmp_path / "attempt0" / "rank3.err").exists()


def _torchrun_failed(launch: Path, code: int, pid: int) -> None:
    line = (f"E1207 14:08:47.734000 29785 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] "
            f"failed (exitcode: {code}) local_rank: 1 (pid: {pid}) of binary: /usr/bin/python3\n")
    with open(launch / "launcher.log", "a") as log:
        log.write(line)


def test_a_restart_names_the_rank_and_how_the_attempt_before_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert previous_attempt_failure() is None  # a first attempt
    first = tmp_path / "attempt0"
    first.mkdir()
    (first / "rank0.pid").write_text("4320\n")
    (first / "rank1.pid").write_text("4321\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert previous_attempt_failure() is None  # torchrun said nothing of a failure
    _torchrun_failed(tmp_path, -9, 4321)
    assert previous_attempt_failure() == "rank 1 died of SIGKILL"
    # The newest failure counts; a worker's one-line error is quoted.
    (first / "rank0.err").write_text("error: a collective waited longer than comm.train_timeout_seconds\n")
    _torchrun_failed(tmp_path, 2, 4320)
    assert previous_attempt_failure() == "rank 0 stopped: error: a collective waited longer than comm.train_timeout_seconds"
    _torchrun_failed(tmp_path, 1, 999)
    assert previous_attempt_failure() == "the worker with pid 999 exited with code 1"
