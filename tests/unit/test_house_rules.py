"""House rules about imports that a review would otherwise have to catch (docs/architecture.md):
the one file that names torch's private strided-shard placement, and no test module importing
another (shared helpers live in tests/helpers.py and tests/e2e/in_process.py). Checked on the
source with `ast`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            found.append((node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_only_the_ground_floor_imports_the_strided_shard():
    importers = {
        str(path.relative_to(ROOT))
        for path in _sources("trainer", "models", "benchmarks", "scripts")
        for module, names in _imports(path)
        if "_StridedShard" in names or module.endswith("_StridedShard")
    }
    assert importers == {"trainer/distributed.py"}


def test_no_test_module_imports_another():
    def is_test_module(module: str) -> bool:
        return module.split(".")[-1].startswith("test_")

    offenders = [
        f"{path.relative_to(ROOT)} imports {module or ', '.join(names)}"
        for path in _sources("tests")
        for module, names in _imports(path)
        if is_test_module(module) or (not module and any(n.startswith("test_") for n in names))
    ]
    assert offenders == []
