"""The API reads the store only through the read model, and never on its event loop: no module of
``app/api`` imports redis or touches a Redis client, and no ``async def`` there calls anything that
does Redis or file work (or imports a model package) except through the thread pool."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "app" / "api"
BLOCKING_ATTRIBUTES = {"reads", "store", "service", "artifacts", "limits"}
"""``ApiContext`` members whose methods do Redis or file work."""
BLOCKING_NAMES = {"default_registry", "open"}
"""Plain calls that read files."""
BLOCKING_METHODS = {"read_text", "read_bytes", "is_file", "stat"}
HEAVY_PACKAGES = ("torch", "transformers", "diffusers", "workers.moe", "workers.diffusion")
LIGHT_MODULES = ("workers.diffusion.adapters", "workers.diffusion.inputs")
"""Modules of those packages that load no model library (a test imports each in a fresh
interpreter and holds it): the API may import them with the app."""


@dataclass(frozen=True)
class Finding:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def modules(root: Path = API) -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text())
            for p in sorted(root.glob("*.py"))}


def _attribute_chain(node: ast.expr) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _direct_calls(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.Call]:
    """Calls made by ``fn`` itself (not by functions nested in it)."""
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _blocks_itself(call: ast.Call) -> str | None:
    chain = _attribute_chain(call.func)
    if BLOCKING_ATTRIBUTES.intersection(chain[:-1]):
        return ".".join(chain)
    if chain and ((chain == [chain[0]] and chain[0] in BLOCKING_NAMES)
                  or (len(chain) > 1 and chain[-1] in BLOCKING_METHODS)):
        return ".".join(chain)
    return None


def blocking_functions(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Sync functions of the API (by name) that do Redis or file work, directly or through
    another such function, with the first blocking call found."""
    sync = {fn.name: fn for tree in trees.values() for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)}
    blocking: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, fn in sync.items():
            if name in blocking:
                continue
            for call in _direct_calls(fn):
                chain = _attribute_chain(call.func)
                why = _blocks_itself(call) or (
                    f"{chain[-1]} -> {blocking[chain[-1]]}"
                    if chain and chain[-1] in blocking else None)
                if why:
                    blocking[name], changed = why, True
                    break
    return blocking


def loop_findings(trees: dict[str, ast.Module]) -> list[Finding]:
    """Calls in an ``async def`` that would block the event loop."""
    blocking = blocking_functions(trees)
    found = []
    for path, tree in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    found.append(Finding(f"{path}:{node.lineno}", f"import in {fn.name}"))
            for call in _direct_calls(fn):
                chain = _attribute_chain(call.func)
                why = _blocks_itself(call) or (
                    blocking.get(chain[-1]) if chain and len(chain) == 1 else None)
                if why:
                    found.append(Finding(f"{path}:{call.lineno}", f"{fn.name} calls {why}"))
    return sorted(found, key=lambda f: int(f.where.rsplit(":", 1)[1]))


def redis_findings(trees: dict[str, ast.Module]) -> list[Finding]:
    """Imports of redis, and any use of a ``.redis`` client or a pipeline."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [Finding(f"{path}:{node.lineno}", f"imports {n}")  # type: ignore[attr-defined]
                      for n in names if n.split(".")[0] == "redis"]
            if isinstance(node, ast.Attribute) and node.attr in ("redis", "pipeline"):
                found.append(Finding(f"{path}:{node.lineno}", f"uses .{node.attr}"))
    return found


def heavy_imports(trees: dict[str, ast.Module]) -> list[Finding]:
    """Imports of a model package anywhere but a thread-pool-only helper: at module level they
    would load torch with the app, inside a handler they would stall the loop."""
    blocking = blocking_functions(trees)
    found = []
    for path, tree in trees.items():
        owners = {id(node): fn.name for fn in ast.walk(tree)
                  if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                  for node in ast.walk(fn)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            owner = owners.get(id(node))
            for name in names:
                if name in LIGHT_MODULES:
                    continue
                if name.startswith(HEAVY_PACKAGES) and (owner is None or owner not in blocking):
                    found.append(Finding(f"{path}:{node.lineno}", f"imports {name}"))
    return found


def test_no_api_module_imports_redis_or_touches_a_redis_client() -> None:
    assert redis_findings(modules()) == []


def test_no_async_route_or_helper_does_redis_or_file_work_on_the_event_loop() -> None:
    assert [str(f) for f in loop_findings(modules())] == []


def test_no_api_module_imports_a_model_package_where_the_loop_would_wait_for_it() -> None:
    assert [str(f) for f in heavy_imports(modules())] == []


@pytest.mark.timeout(120)
def test_the_light_modules_the_api_may_import_load_no_model_library() -> None:
    probe = ("import sys, " + ", ".join(LIGHT_MODULES) + "; print(sorted(m for m in "
             "('torch', 'transformers', 'diffusers', 'peft') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


SAMPLE = '''
import redis
from workers.moe.params import MAX_NEW_TOKENS

def _recipe(name):
    return default_registry().get(name)

def _require(name):
    return _recipe(name)

async def route(ctx, body):
    from workers.moe import x
    _require(body.model)
    record = ctx.reads.record("j")
    ok = await run_in_threadpool(ctx.reads.record, "j")
    return ctx.store.redis.get("k")
'''


@pytest.fixture()
def sample() -> dict[str, ast.Module]:
    return {"app/api/sample.py": ast.parse(SAMPLE)}


def test_the_checks_find_each_kind_of_blocking_call_in_a_sample(
    sample: dict[str, ast.Module],
) -> None:
    # given a module with every mistake the checks look for; when checked; then each is found
    loop = [str(f) for f in loop_findings(sample)]
    assert loop == ["app/api/sample.py:12: import in route",
                    "app/api/sample.py:13: route calls _recipe -> default_registry",
                    "app/api/sample.py:14: route calls ctx.reads.record",
                    "app/api/sample.py:16: route calls ctx.store.redis.get"]
    assert [str(f) for f in redis_findings(sample)] == [
        "app/api/sample.py:2: imports redis", "app/api/sample.py:16: uses .redis"]
    assert [str(f) for f in heavy_imports(sample)] == [
        "app/api/sample.py:3: imports workers.moe.params",
        "app/api/sample.py:12: imports workers.moe"]
