"""House rule: torch's private names (``torch._x``, ``from torch.a._b import c``, ``obj._attr`` where
no module of ours defines ``_attr``) are used only in the files listed below, each for a reason no
public API covers, and FSDP's internals only in trainer/parallel/fsdp.py. A private name can change
in any torch release; the list keeps the places a torch upgrade must check few and known.
Checked on the source with ``ast``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "models")

# file -> why it needs torch's private names (no public API does the job in torch 2.11-2.13).
ALLOWED = {
    "models/engram/table.py": "a DTensor shard's offset in the table (compute_local_shape_and_global_offset)",
    "models/moe/experts.py": "torch._grouped_mm, the grouped GEMM of the experts",
    "trainer/checkpoint/safe_load.py": "DCP's metadata path and element setter, to load .metadata without pickle",
    "trainer/diagnostics/collectives.py": "a dispatch mode reading c10d's operators and process-group names",
    "trainer/diagnostics/memory_tracker.py": "MemTracker and ModTracker internals, DTensor's shape propagation",
    "trainer/diagnostics/weight_casts.py": "a dispatch mode counting aten._to_copy",
    "trainer/distributed.py": "the process-group registry (_world), the strided-shard placement, the fake store",
    "trainer/dry_run.py": "fake tensors, a dispatch mode for the grouped GEMM, the pipeline schedule's warm-up",
    "trainer/optim/muon.py": "torch.optim.Muon's Newton-Schulz kernel and foreach ops",
    "trainer/parallel/activation_checkpoint.py": "per-op SAC's op list and dispatch-mode stacking",
    "trainer/parallel/compile.py": "dynamo configuration",
    "trainer/parallel/context_parallel.py": "functional collectives with autograd",
    "trainer/parallel/engram_parallel.py": "state-dict hooks of the sharded table",
    "trainer/parallel/expert_parallel.py": "mark_unbacked on the split sizes (no recompiles)",
    "trainer/parallel/fsdp.py": "FSDP2 internals: per-parameter meshes, unit states, manual reduction",
    "trainer/parallel/grad_norm.py": "foreach norm and scale",
    "trainer/parallel/parallel_dims.py": "DeviceMesh._flatten (no public flatten in 2.11)",
    "trainer/parallel/pipeline_overlap.py": "the pipelining runtime's actions, p2p waits and stage caches",
    "trainer/parallel/pipeline_step.py": "the pipelining runtime's actions and their order",
    "trainer/parallel/weight_pass.py": "the pipelining runtime's weight-pass bookkeeping",
    "trainer/parallel/tensor_parallel.py": "functional collectives with autograd",
    "trainer/parallel/weight_init.py": "a placement's _split_tensor, to initialise a shard as its slice",
    "trainer/profiling.py": "the CUDA memory history recorder",
}
FSDP_HOME = "trainer/parallel/fsdp.py"
STDLIB_ROOTS = {"os", "sys", "atexit"}  # their _names are the standard library's, not torch's


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def defined_names(sources: list[str]) -> set[str]:
    """Every name our own code defines: functions, classes, attributes it assigns, variables,
    parameters and keywords. A ``_name`` outside this set is someone else's private name."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def private_torch_uses(source: str, ours: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            names = [a.name for a in node.names]
            if any(_private(part) for part in node.module.split(".")) or any(map(_private, names)):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
            if _root(node) not in STDLIB_ROOTS:
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def _fsdp_internal(use: str) -> bool:
    """FSDP2's private modules (torch.distributed.fsdp._fully_shard...) or its units' private state."""
    return "fsdp._" in use or "_fsdp" in use


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_private_torch_only_in_the_listed_files():
    sources = _sources()
    ours = defined_names(list(sources.values()))
    uses = {path: private_torch_uses(source, ours) for path, source in sources.items()}
    outside = [f"{path}:{use}" for path, found in uses.items() if path not in ALLOWED for use in found]
    assert not outside, (
        "torch's private names outside the allowed files (use a public API, or move "
        "the code into a listed file, or list the file with its reason):\n" + "\n".join(outside)
    )
    fsdp = [
        f"{path}:{use}" for path, found in uses.items() if path != FSDP_HOME for use in found if _fsdp_internal(use)
    ]
    assert not fsdp, f"FSDP internals belong in {FSDP_HOME}:\n" + "\n".join(fsdp)
    unused = [path for path in ALLOWED if not uses.get(path)]
    assert not unused, f"listed but no longer touching torch's private names (drop them from ALLOWED): {unused}"


@pytest.mark.parametrize(
    "source, bad",
    [
        ("import torch\ntorch._grouped_mm(a, b)\n", True),
        ("from torch.utils._python_dispatch import TorchDispatchMode\n", True),
        ("from torch.distributed.pipelining.schedules import _Action\n", True),
        ("import torch.distributed._functional_collectives\n", True),
        ("m._get_fsdp_state()._lazy_init()\n", True),
        ("from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState\n", True),
        ("class A:\n    def _mine(self):\n        self._x = 1\n        return self._mine()\n", False),
        ("import os\nos._exit(0)\n", False),
        ("from torch.distributed.fsdp import FSDPModule\nx.__class__\n", False),
    ],
)
def test_the_check_sees_each_spelling(source, bad):
    assert bool(private_torch_uses(source, defined_names([source]))) is bad
