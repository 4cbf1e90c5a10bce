"""One training step reads device values back to the host at most three times, and the MoE
combine uses no atomic scatter (index_add / index_put): both stall or serialise a GPU."""

import ast
import inspect
import re
import textwrap

import pytest
import torch

from tests.helpers import ATOMIC_OPS, profiled_step, step_trainer
from trainer.config import load_config
from trainer.diagnostics import HostReadCounter
from trainer.loss import IGNORE_INDEX
from trainer.parallel import ParallelDims, ParallelStep
from trainer.trainer import Trainer

pytestmark = pytest.mark.numerics  # docs/numerics.md

LAYOUT_NAMES = {"tp", "cp", "ep", "dp", "world_size", "parallel_dims", "context_parallel", "fsdp", "hsdp"}


@pytest.fixture(scope="module")
def local_step(tmp_path_factory):
    trainer = step_trainer(tmp_path_factory.mktemp("sync"))
    try:
        yield profiled_step(trainer)
    finally:
        trainer.close()


def test_one_step_reads_the_device_at_most_three_times(local_step):
    stats, reads, _ = local_step
    assert sum(reads.values()) <= 3, dict(reads)
    assert stats["loss"] > 0 and stats["grad_norm"] > 0


def test_one_step_has_no_atomic_scatter(local_step):
    _, _, ops = local_step
    assert not {op: n for op, n in ops.items() if op in ATOMIC_OPS}


def test_the_counter_sees_host_reads():
    x = torch.arange(4.0)
    with HostReadCounter("cpu") as mode:
        x.sum().item(), x.tolist(), float(x[0]), int(x[1]), bool(x[2]), x.nonzero(), x[x > 1]
    assert sum(mode.counts.values()) == 7, dict(mode.counts)


def test_train_step_has_no_branch_on_the_layout():
    # The layout's share of a step belongs to ParallelStep (trainer/parallel/step.py).
    source = textwrap.dedent(inspect.getsource(Trainer.train_step))
    branches = [ast.unparse(node.test) for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.If, ast.IfExp))]
    assert branches  # the parse found the step's own branches (MTP, NaN skip)

    def on_layout(branch: str) -> bool:
        names = set(re.findall(r"\w+", branch))
        return bool(names & LAYOUT_NAMES) or any(n.endswith(("_enabled", "_degree", "_mesh")) for n in names)

    assert not [b for b in branches if on_layout(b)], branches


def test_parallel_step_on_one_process_is_the_plain_computation():
    dims = ParallelDims.from_config(load_config([]).parallelism, 1)
    model = torch.nn.Linear(4, 3)
    step = ParallelStep(model, dims)
    inputs = torch.randint(0, 10, (2, 8))
    labels = inputs.clone()
    labels[0, :3] = IGNORE_INDEX
    micro, n_valid, n_mtp = step.prepare([(inputs, labels)], mtp_depth=1)
    assert micro[0].inputs is inputs and micro[0].labels is labels
    assert micro[0].model_kwargs == {"engram_ids": None}
    assert (n_valid.item(), n_mtp.item()) == (13, 12)  # MTP depth 0 scores labels[:, 1:]
    assert list(step.microbatches(micro)) == micro
    assert step.reduce_losses(torch.tensor(1.0), torch.tensor(2.0)).tolist() == [1.0, 2.0]
    counts = torch.arange(4.0)
    assert step.global_sum(counts) is counts

    model(torch.randn(5, 4)).square().sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    params = list(model.parameters())
    norm = step.finish_grads(params, max_norm=0.1)
    expected = torch.cat([g.flatten() for g in reference]).norm()
    torch.testing.assert_close(norm, expected)
    for p, g in zip(params, reference):
        torch.testing.assert_close(p.grad, g * (0.1 / (expected + 1e-6)))
