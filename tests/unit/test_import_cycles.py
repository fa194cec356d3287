"""No two modules of the project import each other, directly or round a longer circle, when they
load: a module's top-level imports (outside ``if TYPE_CHECKING:``) form no cycle. An import
deferred into a function is not counted: it runs after both modules loaded.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "workers", "tasks", "app")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def loaded_imports(tree: ast.Module) -> set[str]:
    """The modules (and ``module.name`` of each name) that ``tree`` imports as it loads."""
    names: set[str] = set()
    for node in _run_on_load(tree.body):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def _run_on_load(statements: list[Any]) -> Iterator[ast.AST]:
    """The statements that run as the module loads: not function bodies, not the
    ``if TYPE_CHECKING:`` branch."""
    for statement in statements:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            yield from _run_on_load(statement.orelse)
            continue
        yield statement
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _run_on_load(getattr(statement, field, []))


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    return {name: {other for other in loaded_imports(ast.parse(path.read_text()))
                   if other in paths and other != name}
            for name, path in paths.items()}


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for other in sorted(graph[name]):
            if other == start:
                return [*path, start]
            if other not in seen:
                seen.add(other)
                stack.append((other, [*path, other]))
    return None


def test_the_import_walk_sees_the_drills_imports() -> None:
    graph = import_graph()
    assert "app.drills.host_setup" in graph["app.drills.hosts"]
    assert "app.drills.harness" in graph["app.drills.host_setup"]


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = import_graph()
    cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, graph))]
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)
