"""roll's packages form layers; a module imports only from its own layer or those below it.

The order (lowest first) is the one docs/architecture.md explains. Every import counts: top-level,
inside a function, and under ``if TYPE_CHECKING``, since each is a dependency a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROLL = Path(__file__).resolve().parent.parent / "roll"
LAYERS = ["core", "configs", "utils", "models", "distributed", "planner", "pipeline", "launch"]


def upward_imports(package: str) -> list[str]:
    """``file:line -> roll.<pkg>`` for every import in ``roll/<package>`` of a higher layer."""
    allowed = set(LAYERS[: LAYERS.index(package) + 1])
    found = []
    for path in sorted((ROLL / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "roll" and len(parts) > 1 and parts[1] in LAYERS and parts[1] not in allowed:
                    found.append(f"{path.relative_to(ROLL.parent)}:{node.lineno} -> {module}")
    return found


def test_every_package_has_a_layer():
    packages = {p.name for p in ROLL.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_no_upward_imports(package):
    assert upward_imports(package) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "roll"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "bad.py").write_text("def f():\n    from roll.distributed.x import y\n")
    monkeypatch.setattr(__import__(__name__), "ROLL", fake)
    assert upward_imports("models") == ["roll/models/bad.py:2 -> roll.distributed.x"]
