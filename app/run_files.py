"""The files a running stack leaves in its run directory for clients on the same machine: the
development API key and the API's address. Read without the settings tree, so a command that
only talks to the API (``stepline jobs``) starts in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

API_KEY_FILE = "api-key"
API_URL_FILE = "api-url"


def read_run_file(run_dir: Path, name: str) -> str | None:
    """The stripped contents of ``run_dir/name``; None when absent, unreadable or empty."""
    try:
        return (run_dir / name).read_text().strip() or None
    except OSError:
        return None


def write_run_file(run_dir: Path, name: str, value: str) -> None:
    """Replace ``run_dir/name`` whole (a reader never sees half of it)."""
    target = run_dir / name
    tmp = target.with_name(f".{name}.tmp")
    tmp.write_text(value + "\n")
    tmp.replace(target)
