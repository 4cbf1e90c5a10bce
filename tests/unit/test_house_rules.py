"""House rules about imports that a review would otherwise have to catch (docs/architecture.md):
the one file that names torch's private strided-shard placement, no test module importing
another (shared helpers live in tests/helpers.py and tests/e2e/in_process.py), and imports that
run down the floors only: no circle among the modules of trainer/ and models/, models/ never
importing trainer/, the entry (trainer/train.py) imported by none of them. Checked on the source
with `ast`."""

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


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules of trainer/ and models/ it imports (any import: at the top, in a
    function, for types only). ``from a import b`` names the module ``a.b`` when there is one."""
    modules = {}
    for path in _sources("trainer", "models"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        graph[name] = {
            f"{module}.{n}" if f"{module}.{n}" in modules else module
            for module, names in _imports(path)
            for n in names or [""]
            if module in modules or f"{module}.{n}" in modules
        } - {name}
    return graph


# Circles left to their owners' work, each with why it is still here. A new circle fails the test.


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_imports_run_down_the_floors():
    graph = _module_graph()
    assert _circles(graph) == [], _circles(graph)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]  # the check finds one
    upward = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if m.startswith("models") and d.startswith("trainer")
    ]
    assert upward == []
    # The entry sits above the Trainer and the dry run: nothing below imports it.
    assert [m for m, deps in graph.items() if "trainer.train" in deps] == []
    assert {"trainer.trainer", "trainer.dry_run", "trainer.outcome"} <= graph["trainer.train"]
    assert "trainer.dry_run" not in graph["trainer.trainer"]


def test_no_unittest_mock_in_production_code():
    users = [
        str(path.relative_to(ROOT))
        for path in _sources("trainer", "models")
        for module, names in _imports(path)
        if module.startswith("unittest") or (module == "" and any(n.startswith("unittest") for n in names))
    ]
    assert users == []
