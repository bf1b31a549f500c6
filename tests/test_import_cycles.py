"""No two files of roll import each other, directly or around a loop.

Every import counts (top-level, inside a function, under ``if TYPE_CHECKING``): a reader who follows
one has to follow it either way. ``from roll.a import b`` counts as an import of ``roll/a/b.py`` when
that module exists, else of ``roll/a`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROLL = Path(__file__).resolve().parent.parent / "roll"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names one import statement may refer to, absolute."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" for alias in node.names] + [module]


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the roll modules it imports (the nearest existing module of each imported name)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for dotted in imported_names(node, package):
                while dotted and dotted not in paths:
                    dotted = dotted.rpartition(".")[0]
                if dotted and dotted != name and not name.startswith(f"{dotted}."):
                    targets.add(dotted)  # a package's __init__ run on the way down is not a loop
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_in_roll():
    assert cycles(import_graph(ROLL)) == []


def test_the_check_sees_a_function_level_cycle(tmp_path):
    fake = tmp_path / "roll"
    (fake / "models").mkdir(parents=True)
    for name in ("__init__", "models/__init__"):
        (fake / f"{name}.py").write_text("")
    (fake / "models" / "a.py").write_text("from roll.models.b import g\n")
    (fake / "models" / "b.py").write_text("def g():\n    from roll.models import a\n")
    (fake / "models" / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(fake)) == [["roll.models.a", "roll.models.b"]]
