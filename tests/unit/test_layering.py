"""The dependency rule: app -> tasks -> {scheduler, workers}, and nothing points back up.

Every import counts: module-level, function-local and ``TYPE_CHECKING`` ones. A function-local
import of project code is allowed only to defer torch or transformers, and must say so — and, in
the command line, to defer what only one command needs (``deferred:``), so each starts fast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
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
COMMAND_LINE = ("app/cli.py", "app/client.py")
"""Each command imports what only it needs (the API, the bench, the stack) in its body; the
client it drives imports the settings tree only when the address must come from it."""


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
            targets = [node.module]
        else:
            continue
        comment = " ".join(lines[node.lineno - 1 : (node.end_lineno or node.lineno)])
        for target in targets:
            if target.split(".")[0] in ALLOWED:
                yield ProjectImport(path.relative_to(root).as_posix(), node.lineno, target,
                                    id(node) in local_nodes, comment)


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
    return imp.path in COMMAND_LINE and "deferred:" in imp.comment


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
