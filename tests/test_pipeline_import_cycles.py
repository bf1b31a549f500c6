"""No file of roll/pipeline imports, directly or through others, a file that imports it back.

Every import counts (top-level, inside a function, under ``if TYPE_CHECKING``): each is an edge a
reader follows, and a cycle is a pair of files that can only be read together. The RLVR start-up
reads one way: pipeline -> start -> prestart -> workers.classes, with run.py (the run's state)
below them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, for every file under ``root/package``."""
    files = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        files[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
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
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_pipeline():
    assert cycles(import_graph(REPO, "roll.pipeline")) == []


def test_the_check_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "roll" / "pipeline"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from roll.pipeline.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from roll.pipeline import a\n")
    assert cycles(import_graph(tmp_path, "roll.pipeline")) == [["roll.pipeline.a", "roll.pipeline.b"]]
