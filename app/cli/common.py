"""What every command shares: the output console, the run directory and settings options, and
the client of the running stack's API."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from rich.console import Console


@functools.cache
def console() -> Console:
    """The output console, made on first use (rich is imported by the commands that print)."""
    from rich.console import Console

    return Console()


RunDir = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory of the stack.")]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="YAML settings file.")]


def _setup(run_dir: Path | None, config: Path | None) -> None:
    """Export the choices so this process and every child agree on them."""
    from tasks.runtime import current_settings  # deferred: the settings tree, for commands only

    _use_run_dir(run_dir)
    if config is not None:
        os.environ["STEPLINE_CONFIG"] = str(config.resolve())

    current_settings.cache_clear()
    current_settings()  # fail early, with the key, value and bound


def _use_run_dir(run_dir: Path | None) -> None:
    """For commands that only talk to the API: the run directory chosen, nothing else read
    (the API's address and key are files the stack left there; no settings tree)."""
    if run_dir is not None:
        os.environ["STEPLINE_RUN_DIR"] = str(run_dir.resolve())
    elif "STEPLINE_RUN_DIR" not in os.environ:
        os.environ["STEPLINE_RUN_DIR"] = str(Path(".stepline").resolve())


def _client() -> Any:
    """A client of the running stack's API (errors say how to start it when it is not up)."""
    from app.client import Client  # deferred: httpx

    return Client(run_dir=Path(os.environ["STEPLINE_RUN_DIR"]))
