"""No two files of ``roll/models`` import each other, directly or through others.

Every import counts, as in ``test_import_layers``: top-level, inside a function, and under
``if TYPE_CHECKING``. A cycle means neither file can be read, tested or moved without the other;
pieces both sides need go into a file of their own that both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROLL = Path(__file__).resolve().parent.parent / "roll"


def import_graph(package: Path) -> dict[str, set[str]]:
    """``module -> modules of the same package tree it imports`` (dotted names, packages included)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_roll_models_has_no_file_cycle():
    assert cycle(import_graph(ROLL / "models")) == []


def test_the_check_sees_a_function_level_cycle(tmp_path):
    fake = tmp_path / "roll" / "models"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("from roll.models.b import g\n")
    (fake / "b.py").write_text("def g():\n    from roll.models import a\n")
    assert cycle(import_graph(fake)) == ["roll.models.a", "roll.models.b", "roll.models.a"]
