"""The modules of roll/configs import each other without a cycle. Every import counts, as in
tests/test_import_layers.py: top-level, inside a function and under ``if TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "roll" / "configs"


def config_imports(folder: Path = CONFIGS) -> dict[str, set[str]]:
    """Module name -> the modules of the same folder it imports."""
    names = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[:2] == ["roll", "configs"] and len(parts) > 2 and parts[2] in names:
                    found.add(parts[2])
        graph[path.stem] = found - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when there is none."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str]:
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return [*trail[trail.index(child) :], child] if child in trail else [node, child]
            if child not in state:
                cycle = visit(child, [*trail, child])
                if cycle:
                    return cycle
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return []


def test_configs_modules_import_without_a_cycle():
    assert find_cycle(config_imports()) == []


def test_the_check_sees_a_function_level_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from roll.configs.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from roll.configs.a import y\n")
    assert find_cycle(config_imports(tmp_path)) == ["a", "b", "a"]
