"""Where a run writes (trainer.run_folder): a fresh run gets a new folder of its own under
job.dump_folder, a resumable run continues job.dump_folder itself, and a dump folder that cannot
be created is refused naming the key, before anything is written."""

import pytest

from trainer.config import ConfigError
from trainer.config.dump_folder import check_dump_folder
from trainer.run_folder import latest_run_folder, open_run_folder


def test_fresh_runs_get_folders_of_their_own(tmp_path):
    dump = tmp_path / "outputs"
    assert latest_run_folder(dump) == dump
    first = open_run_folder(str(dump), resumable=False, is_rank0=True)
    second = open_run_folder(str(dump), resumable=False, is_rank0=True)
    assert first.parent == second.parent == dump and first != second and second.is_dir()
    (first / "metrics.jsonl").write_text("{}\n")
    assert latest_run_folder(dump) == second
    # Resumable runs continue the dump folder itself, however many fresh runs it holds.
    assert open_run_folder(str(dump), resumable=True, is_rank0=True) == dump


def test_latest_run_folder_orders_by_time_then_suffix(tmp_path):
    for name in ("20261125-101500-10", "20261125-101500-2", "20261125-101500", "20251231-235959-99", "notes"):
        (tmp_path / name).mkdir()
    assert latest_run_folder(tmp_path).name == "20261125-101500-10"


def test_other_ranks_take_rank0s_folder(tmp_path):
    chosen = open_run_folder(str(tmp_path / "a"), resumable=False, is_rank0=True)
    # A rank on another node with a disk of its own: rank 0's name, created there too.
    other = open_run_folder(str(tmp_path / "b"), resumable=False, is_rank0=False,
                            share=lambda mine: (str(tmp_path / "b" / chosen.name), None))
    assert other == tmp_path / "b" / chosen.name and other.is_dir()
    with pytest.raises(ConfigError, match="rank 0 says no"):
        open_run_folder(str(tmp_path / "c"), resumable=False, is_rank0=False, share=lambda mine: (None, "rank 0 says no"))


def test_a_dump_folder_that_cannot_be_created_names_the_key(tmp_path):
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "runs")
    with pytest.raises(ConfigError, match=r"job.dump_folder = .*file/runs.* is a file; pass --job.dump_folder"):
        check_dump_folder(bad)
    for resumable in (False, True):
        with pytest.raises(ConfigError, match=r"job.dump_folder = .*cannot be created"):
            open_run_folder(bad, resumable=resumable, is_rank0=True)
    check_dump_folder(str(tmp_path / "new" / "deeper"))
    assert not (tmp_path / "new").exists()
