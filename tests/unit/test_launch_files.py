"""A worker's files for run_train.sh (trainer/launch_files.py): written only under the script's
multi-process launches (TRAINER_LAUNCH_DIR), one per rank and kind; elsewhere a user mistake is
printed."""

from trainer.launch_files import report_user_error, write_launch_file


def test_files_only_under_run_train(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRAINER_LAUNCH_DIR", raising=False)
    assert not write_launch_file("pid", "123")
    assert report_user_error("config error: x") == 2
    assert capsys.readouterr().err == "config error: x\n"

    monkeypatch.setenv("TRAINER_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert report_user_error("config error: y") == 2
    assert capsys.readouterr().err == ""
    assert write_launch_file("exit", "0")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"rank3.err": "config error: y\n", "rank3.exit": "0\n"}
