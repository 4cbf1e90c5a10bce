"""House rule: no module of trainer/ or models/ uses a `_private` name of another of their modules
(a helper that others need gets a public name). Checked on the source with `ast`."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "models")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(source: str, where: str) -> list[str]:
    """`from ours import _x`, `from . import _x`, and `mod._x` where `mod` names a module of ours."""
    tree = ast.parse(source, where)
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            ours = node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
            for alias in node.names if ours else ():
                if alias.name.startswith("_"):
                    found.append(f"{where}:{node.lineno}: imports {alias.name} from {node.module or '.'}")
                elif node.level == 0 and _is_module(f"{node.module}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if _dotted(node.value) in modules:
                found.append(f"{where}:{node.lineno}: uses {_dotted(node.value)}.{node.attr}")
    return found


def test_no_private_names_cross_modules():
    found = [
        use
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for use in private_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not found, "give these helpers public names:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from trainer.config.fields import _x, y\n", True),
        ("from trainer.config.fields import (\n    y,\n    _x as x,\n)\n", True),
        ("from . import _x\n", True),
        ("import trainer.config.fields as f\nf._x()\n", True),
        ("from trainer.config import fields\nfields._x\n", True),
        ("from trainer.config.fields import option\nfrom torch.utils._pytree import tree_map\n", False),
        ("from trainer.config import fields\nfields.__name__\n", False),
    ],
)
def test_the_check_sees_each_spelling(source, bad):
    assert bool(private_uses(source, "trainer/m.py")) is bad
