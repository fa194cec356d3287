"""Settings of diffusion jobs (``diffusion:`` in configs/default.yaml)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class DiffusionSettings(BaseModel):
    """Checkpointing and preemption granularity of diffusion jobs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    checkpoint_every: int = Field(default=1, ge=1, le=1000)
    """Write the durable checkpoint to Redis every this many steps (always on preemption).
    Steps, in [1, 1000]."""
    block_groups: int = Field(default=2, ge=1, le=64)
    """Split each denoising step into this many groups of transformer blocks (the points at
    which a job may be preempted). Groups, in [1, 64]."""
    video_fps: int = Field(default=8, ge=1, le=60)
    """Frame rate written into video artifacts (MP4, GIF, WebP). Frames per second, in
    [1, 60]."""
    adapters_dir: Path | None = None
    """Folder of the LoRA adapters jobs may name (``<name>.yaml`` next to its safetensors
    file); none: the project's ``configs/adapters``. API and workers must see the same one."""
