"""roll's packages form layers; a module imports only from its own layer or those below it.

The order (lowest first) is the one docs/architecture.md explains. Every import counts: top-level,
inside a function, and under ``if TYPE_CHECKING``, since each is a dependency a reader must follow.
``roll/distributed`` is layered the same way inside (``DISTRIBUTED_LAYERS``), and no file of roll
imports itself back around a loop of other files (within a layer too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROLL = Path(__file__).resolve().parent.parent / "roll"
LAYERS = ["core", "configs", "utils", "models", "distributed", "planner", "pipeline", "launch"]
# Inside roll/distributed, lowest first: the model update's wire, the strategies (whose engine
# processes receive from that wire), the worker host, clusters and placement, and the groups that
# drive a model update through the clusters.
DISTRIBUTED_LAYERS = ["transport", "strategy", "executor", "scheduler", "model_update"]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``path``; ``from a import b`` gives ``a`` and
    then ``a.b`` (which may name a module or just a symbol of ``a``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def upward_imports(package: str, parent: str = "roll", layers: list[str] = LAYERS) -> list[str]:
    """``file:line -> module`` for every import in ``<parent>/<package>`` of a layer above
    ``package`` among ``layers`` (one per import statement)."""
    allowed = set(layers[: layers.index(package) + 1])
    depth = parent.count(".") + 1
    found = []
    for path in sorted(ROLL.parent.joinpath(*parent.split("."), package).rglob("*.py")):
        lines = set()
        for line, module in imported_modules(path):
            parts = module.split(".")
            if module.startswith(parent + ".") and parts[depth] in layers and parts[depth] not in allowed:
                if line not in lines:
                    lines.add(line)
                    found.append(f"{path.relative_to(ROLL.parent)}:{line} -> {module}")
    return found


def import_cycles(package: Path) -> list[list[str]]:
    """Loops of imports between the files of ``package`` (each loop's modules, sorted)."""
    files = {_module_name(p): p for p in package.rglob("*.py")}
    edges = {name: set() for name in files}
    for name, path in files.items():
        for _, module in imported_modules(path):
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module and module != name:
                edges[name].add(module)
    return [sorted(c) for c in _strongly_connected(edges) if len(c) > 1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROLL.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iteration order of ``edges``)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            components.append(component)

    for node in edges:
        if node not in index:
            visit(node)
    return components


def test_every_package_has_a_layer():
    packages = {p.name for p in ROLL.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_no_upward_imports(package):
    assert upward_imports(package) == []


def test_every_distributed_package_has_a_layer():
    packages = {p.name for p in (ROLL / "distributed").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert packages == set(DISTRIBUTED_LAYERS)


@pytest.mark.parametrize("package", DISTRIBUTED_LAYERS)
def test_no_upward_imports_inside_distributed(package):
    assert upward_imports(package, "roll.distributed", DISTRIBUTED_LAYERS) == []


def test_no_import_cycles_in_roll():
    assert import_cycles(ROLL) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "roll"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "bad.py").write_text("def f():\n    from roll.distributed.x import y\n")
    monkeypatch.setattr(__import__(__name__), "ROLL", fake)
    assert upward_imports("models") == ["roll/models/bad.py:2 -> roll.distributed.x"]


def test_the_check_sees_an_upward_import_inside_distributed(tmp_path, monkeypatch):
    fake = tmp_path / "roll" / "distributed"
    (fake / "transport").mkdir(parents=True)
    (fake / "transport" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from roll.distributed.strategy.base import X\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROLL", fake.parent)
    assert upward_imports("transport", "roll.distributed", DISTRIBUTED_LAYERS) == [
        "roll/distributed/transport/bad.py:3 -> roll.distributed.strategy.base"
    ]


def test_the_check_sees_an_import_cycle(tmp_path, monkeypatch):
    fake = tmp_path / "roll" / "distributed"
    (fake / "strategy").mkdir(parents=True)
    (fake / "strategy" / "a.py").write_text("def f():\n    from roll.distributed.strategy.b import g\n")
    (fake / "strategy" / "b.py").write_text("from roll.distributed.strategy import a\n")
    (fake / "strategy" / "c.py").write_text("from roll.distributed.strategy.a import f\n")
    monkeypatch.setattr(__import__(__name__), "ROLL", fake.parent)
    assert import_cycles(fake) == [["roll.distributed.strategy.a", "roll.distributed.strategy.b"]]
