"""The dependency rule: app -> tasks -> {scheduler, workers}, and nothing points back up; inside
``app``, no circle between its parts (each subpackage and each top-level module is one part).

Every import counts: module-level, function-local and ``TYPE_CHECKING`` ones. A function-local
import of project code is allowed only to defer torch or transformers, and must say so — and, in
the command line, to defer what only one command needs (``deferred:``), so each starts fast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "app": {"app", "tasks", "scheduler", "workers"},
    "tasks": {"tasks", "scheduler", "workers"},
    "scheduler": {"scheduler"},
    "workers": {"workers"},
}
DEFERRAL_WORDS = ("torch", "transformers")
COMMAND_LINE = ("app/cli/", "app/client.py")
"""The command line's package and its client. Each command imports what only it needs (the API,
the bench, the stack) in its body; the client it drives imports the settings tree only when the
address must come from it."""


@dataclass(frozen=True)
class ProjectImport:
    path: str
    """Relative to the checkout root; its first part is the layer."""
    line: int
    target: str
    local: bool
    comment: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def project_imports(path: Path, root: Path) -> Iterator[ProjectImport]:
    """Every import of a project package in ``path``, wherever it stands in the file."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    local_nodes = {
        id(node)
        for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = _from_targets(node, node.module, root)
        else:
            continue
        comment = " ".join(lines[node.lineno - 1 : (node.end_lineno or node.lineno)])
        for target in targets:
            if target.split(".")[0] in ALLOWED:
                yield ProjectImport(path.relative_to(root).as_posix(), node.lineno, target,
                                    id(node) in local_nodes, comment)


def _from_targets(node: ast.ImportFrom, module: str, root: Path) -> list[str]:
    """``from a.b import c`` imports ``a.b.c`` where that is a module, ``a.b`` otherwise."""
    base = root.joinpath(*module.split("."))
    submodules = [f"{module}.{alias.name}" for alias in node.names
                  if (base / alias.name).is_dir() or (base / f"{alias.name}.py").is_file()]
    return submodules if len(submodules) == len(node.names) else [module, *submodules]


def all_imports(root: Path = ROOT) -> list[ProjectImport]:
    return [imp for top in ALLOWED for path in sorted((root / top).rglob("*.py"))
            for imp in project_imports(path, root)]


def upward(imports: list[ProjectImport]) -> list[str]:
    return sorted(str(imp) for imp in imports
                  if imp.target.split(".")[0] not in ALLOWED[imp.path.split("/")[0]])


def undeclared_local(imports: list[ProjectImport]) -> list[str]:
    return [str(imp) for imp in imports if imp.local and not _declared(imp)]


def _declared(imp: ProjectImport) -> bool:
    if any(word in imp.comment for word in DEFERRAL_WORDS):
        return True
    return imp.path.startswith(COMMAND_LINE) and "deferred:" in imp.comment


def app_part(module: str, root: Path) -> str:
    """The part of ``app`` a dotted module name belongs to: ``app.<subpackage>`` or
    ``app.<module>``; ``app`` itself for the package's ``__init__`` and unknown names."""
    parts = module.split(".")
    if len(parts) > 1 and ((root / "app" / parts[1]).is_dir()
                           or (root / "app" / f"{parts[1]}.py").is_file()):
        return f"app.{parts[1]}"
    return "app"


def app_graph(root: Path = ROOT) -> dict[str, dict[str, ProjectImport]]:
    """``{part: {part it imports: the first such import}}`` over every ``app`` module."""
    graph: dict[str, dict[str, ProjectImport]] = {}
    for imp in all_imports(root):
        if imp.path.split("/")[0] != "app" or imp.target.split(".")[0] != "app":
            continue
        source = app_part(imp.path.removesuffix(".py").replace("/", "."), root)
        target = app_part(imp.target, root)
        if target != source:
            graph.setdefault(source, {}).setdefault(target, imp)
    return graph


def import_cycles(graph: Mapping[str, Mapping[str, ProjectImport]]) -> list[str]:
    """One circle per strongly connected set of parts, each arrow named by its import, e.g.
    ``app.api -> app.bench (app/api/timeline.py:14 imports app.bench.occupancy) -> …``."""
    cycles = []
    for component in _strongly_connected(graph):
        start = min(component)
        path = _path_back(graph, component, start)
        arrows = [f"{a} -> {b} ({graph[a][b]})" for a, b in pairwise(path)]
        cycles.append("; ".join(arrows))
    return sorted(cycles)


def _strongly_connected(graph: Mapping[str, Mapping[str, object]]) -> list[set[str]]:
    """Tarjan's components of more than one part (an import of itself is not an arrow here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while (member := stack.pop()) != node:
                component.add(member)
            component.add(node)
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_back(graph: Mapping[str, Mapping[str, object]], component: set[str],
               start: str) -> list[str]:
    """A shortest circle from ``start`` back to itself inside ``component`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        reached = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in component and nxt not in came_from:
                    came_from[nxt] = node
                    reached.append(nxt)
        frontier = reached
    raise AssertionError(f"{start} is in a component without a circle")


@pytest.mark.timeout(60)
def test_no_import_points_up() -> None:
    assert upward(all_imports()) == []


@pytest.mark.timeout(60)
def test_function_local_project_imports_only_defer_torch_and_say_so() -> None:
    assert undeclared_local(all_imports()) == []


@pytest.mark.timeout(60)
def test_the_walk_catches_an_upward_import_hidden_in_a_function(tmp_path: Path) -> None:
    # given a copy of the layout where a worker module reaches up into tasks inside a function
    for top in ALLOWED:
        (tmp_path / top).mkdir()
    (tmp_path / "workers" / "sneaky.py").write_text(
        "def run() -> None:\n    from tasks.store import JobStore  # loads torch\n"
    )
    (tmp_path / "scheduler" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.cli import main\n"
    )
    (tmp_path / "tasks" / "lazy.py").write_text(
        "def f() -> None:\n    from scheduler import plan_tick\n"
    )
    # when the walk runs over it
    imports = all_imports(tmp_path)
    # then both upward arrows and the undeclared function-local import are reported
    assert upward(imports) == [
        "scheduler/typed.py:3 imports app.cli", "workers/sneaky.py:2 imports tasks.store",
    ]
    assert undeclared_local(imports) == ["tasks/lazy.py:2 imports scheduler"]


@pytest.mark.timeout(60)
def test_no_two_parts_of_app_import_each_other_even_through_others() -> None:
    assert import_cycles(app_graph()) == []


@pytest.mark.timeout(60)
def test_the_circle_check_names_a_ring_through_three_parts(tmp_path: Path) -> None:
    # given a copy of the layout where api -> bench -> stack -> api, and the cli imports all
    for top in ALLOWED:
        (tmp_path / top).mkdir()
    for package in ("api", "bench"):
        (tmp_path / "app" / package).mkdir()
        (tmp_path / "app" / package / "__init__.py").write_text("")
    (tmp_path / "app" / "api" / "timeline.py").write_text("from app.bench.occupancy import merge\n")
    (tmp_path / "app" / "bench" / "occupancy.py").write_text("")
    (tmp_path / "app" / "bench" / "run.py").write_text("import app.stack\n")
    (tmp_path / "app" / "stack.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.api import timeline\n"
    )
    (tmp_path / "app" / "cli.py").write_text("from app import stack\nimport app.api.timeline\n")
    # when the circle check runs over it
    cycles = import_cycles(app_graph(tmp_path))
    # then the one ring is reported, every arrow named by the import that draws it
    assert cycles == [
        "app.api -> app.bench (app/api/timeline.py:1 imports app.bench.occupancy); "
        "app.bench -> app.stack (app/bench/run.py:1 imports app.stack); "
        "app.stack -> app.api (app/stack.py:3 imports app.api.timeline)"
    ]
