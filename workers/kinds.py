"""Which runner serves which job kind; heavy model code is imported only when first needed."""

from __future__ import annotations

from functools import cache

from workers.errors import WorkerError
from workers.runner import JobRunner


@cache
def get_runner(kind: str) -> JobRunner:
    """The process-wide runner for a job kind (models inside are built once per process)."""
    if kind == "simulated":
        from workers.simulated import SimulatedRunner

        return SimulatedRunner()
    if kind in ("image", "video"):
        from workers import diffusion

        return diffusion.get_runner(kind)
    if kind == "text":
        from workers import moe

        return moe.get_runner()
    raise WorkerError(f"unknown job kind {kind!r}; use simulated, image, video or text")
