"""The command line starts light: a command imports the API, the dashboard, the bench, the stack
or torch only when it runs them (checked by what a fresh interpreter imported, not by time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.run_files import API_KEY_FILE, API_URL_FILE

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "diffusers", "fastapi", "starlette", "uvicorn", "celery",
         "app.api", "app.bench", "app.stack", "app.demo", "app.drills", "workers")

pytestmark = pytest.mark.timeout(120)


def _imported_by(*args: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules ``python -X importtime -m app.cli ARGS`` imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "app.cli", *args], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True, text=True, timeout=100, check=False)
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_submit_help_imports_no_api_bench_stack_or_torch() -> None:
    modules = _imported_by("submit", "--help")
    assert "typer" in modules  # the walk saw the imports
    assert _heavy(modules) == []
    assert "tasks.settings" not in modules and "httpx" not in modules


def test_listing_jobs_imports_the_client_but_no_settings_api_bench_stack_or_torch(
    tmp_path: Path,
) -> None:
    # given a run directory whose stack left its address and key (nothing answers there)
    (tmp_path / API_URL_FILE).write_text("http://127.0.0.1:9\n")
    (tmp_path / API_KEY_FILE).write_text("k\n")
    # when `stepline jobs` runs (and fails to reach it)
    modules = _imported_by("jobs", env={"STEPLINE_RUN_DIR": str(tmp_path)})
    # then it went as far as the client, and no further than it needs: not the settings tree
    # (the address came from the run directory), not trio (httpcore's optional backend)
    assert "app.client" in modules and "httpx" in modules
    assert "tasks.settings" not in modules and "redis" not in modules
    assert "trio._core" not in modules
    assert _heavy(modules) == []


def test_without_the_stacks_address_the_client_falls_back_to_the_settings(
    tmp_path: Path,
) -> None:
    # given a run directory with no address in it (no stack started there)
    env = {"STEPLINE_RUN_DIR": str(tmp_path), "STEPLINE_API_KEY": "k"}
    # when `stepline jobs` runs, then the address comes from the configured service settings
    modules = _imported_by("jobs", env=env)
    assert "app.client" in modules and "tasks.settings" in modules
    assert _heavy(modules) == []
