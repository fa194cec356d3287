"""Diffusion (DiT) image and video jobs: recipes, parameter checks and the chunk runner.

``validate_params`` is torch-free so the API can check jobs cheaply; ``get_runner`` imports
torch and diffusers only when a worker first asks for a runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.diffusion.adapters import adapter_registry
from workers.diffusion.params import DiffusionParams, validate_params
from workers.registry import ModelRegistry

if TYPE_CHECKING:
    from workers.diffusion.runner import DiffusionRunner

__all__ = ["DiffusionParams", "get_runner", "validate_params"]


def get_runner(kind: str, *, block_groups: int = 2, device: str = "cpu",
               registry: ModelRegistry | None = None, video_fps: int = 8,
               adapters_dir: str | None = None) -> DiffusionRunner:
    """The runner of ``kind`` (image or video); pass ``settings.diffusion.block_groups``,
    ``settings.diffusion.video_fps`` and ``settings.diffusion.adapters_dir``."""
    from workers.diffusion.runner import DiffusionRunner  # deferred: loads torch

    return DiffusionRunner(kind, block_groups=block_groups, device=device, registry=registry,
                           video_fps=video_fps, adapters=adapter_registry(adapters_dir))
