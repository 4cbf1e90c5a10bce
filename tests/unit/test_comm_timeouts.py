"""[comm] timeouts, the pure parts: which errors are collective timeouts (trainer/distributed.py
`is_collective_timeout`) and their one line (trainer/distributed.py `collective_timeout_message`). The
run that times out is tests/distributed/test_collective_timeout.py."""

import pytest
import torch.distributed as dist

from trainer.distributed import collective_timeout_message, is_collective_timeout, set_collective_timeout

# torch 2.13's gloo, as raised on CPU when a peer never joins a collective.
GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 5000ms for recv operation to complete"
)


@pytest.mark.parametrize(
    "error, timed_out",
    [
        (RuntimeError(GLOO), True),
        (dist.DistError("Socket Timeout: timed out after 300 s waiting for clients. 1/2 clients joined."), True),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), False),
        (RuntimeError("DataLoader worker timed out"), False),  # a timeout, but no collective's
        (ValueError("gloo timed out"), False),
    ],
)
def test_which_errors_are_collective_timeouts(error, timed_out):
    assert is_collective_timeout(error) is timed_out


def test_the_message_is_one_line_naming_the_key_in_force():
    line = collective_timeout_message(RuntimeError(GLOO + "\nException raised from ..."), "train_timeout_seconds",
                                      100.0, "at step 7")
    assert "\n" not in line
    assert line.startswith("error: a collective waited longer than comm.train_timeout_seconds = 100 s at step 7: ")
    assert "another rank stopped calling collectives" in line and "raise --comm.train_timeout_seconds" in line
    # torch's words, without gloo's source location.
    assert line.endswith("torch: Timed out waiting 5000ms for recv operation to complete Exception raised from ...")
    starting = collective_timeout_message(RuntimeError(GLOO), "init_timeout_seconds", 300.0, "while starting")
    assert "comm.init_timeout_seconds = 300 s while starting" in starting


def test_setting_the_timeout_without_a_process_group_is_a_no_op():
    assert not dist.is_initialized()
    set_collective_timeout(1.0)
    assert not dist.is_initialized()
