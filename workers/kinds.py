"""Which runner serves which job kind; heavy model code is imported only when first needed."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from workers.errors import WorkerError
from workers.runner import JobRunner
from workers.simulated import SimulatedRunner

if TYPE_CHECKING:
    from workers.moe.expert_cache import CacheConfig  # types only: workers.moe loads torch
    from workers.moe.router import RouterConfig


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Device-side knobs a runner is built with (the app fills them from its settings)."""

    device: str = "cpu"
    block_groups: int = 2
    video_fps: int = 8
    torch_threads: int = 1
    router: RouterConfig | None = None
    """How text jobs route tokens to experts (None: the reference router)."""
    cache: CacheConfig | None = None
    """The expert cache of text jobs (None: the reference cache, every expert resident)."""
    adapters_dir: str | None = None
    """Folder of the LoRA adapters of diffusion jobs (None: the project's configs/adapters)."""


@cache
def get_runner(kind: str, options: RunnerOptions = RunnerOptions()) -> JobRunner:
    """The process-wide runner for a job kind and options (models inside are built once per
    process): the one factory of the API's plans and the workers' chunks."""
    if kind == "simulated":
        return SimulatedRunner()
    if kind in ("image", "video", "text"):
        limit_threads(options.torch_threads)
    if kind in ("image", "video"):
        from workers import diffusion  # deferred: loads torch

        return diffusion.get_runner(kind, block_groups=options.block_groups,
                                    device=options.device, video_fps=options.video_fps,
                                    adapters_dir=options.adapters_dir)
    if kind == "text":
        from workers import moe  # deferred: loads torch

        return moe.get_runner(options.router, options.cache, options.device)
    raise WorkerError(f"unknown job kind {kind!r}; use simulated, image, video or text")


def limit_threads(threads: int) -> None:
    """Cap torch's intra-op threads of this process (0 keeps torch's default)."""
    # One worker process per device: on a shared CPU, torch's default thread pool oversubscribes
    # the cores (measured: a tiny DiT step went from ~4 ms to ~120 ms with 2 threads on 2 cores).
    import torch

    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
