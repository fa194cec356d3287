"""Settings of the models a worker keeps built (``residency:`` in configs/default.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.settings.durations import Seconds

TIB = 1 << 40
"""A tebibyte, in bytes."""


class ResidencySettings(BaseModel):
    """How many built models a worker process holds, by their measured tensor bytes."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    memory_budget_bytes: int | None = Field(default=None, ge=1, le=TIB)
    """Device memory the built models of one worker may hold (their parameters, buffers and MoE
    expert caches, measured); past it the policy evicts one not in use. null: unlimited, every
    model ever used stays built. Bytes, in [1, 2**40] (1 TiB, past any one device)."""
    host_memory_budget_bytes: int | None = Field(default=0, ge=0, le=16 * TIB)
    """Models evicted from the device kept in host memory up to this many bytes, so their next
    load is a copy, not a build (0: none; null: unlimited). On a CPU worker the device and the
    host are one memory: this is a second budget of models kept as they are. Bytes, in
    [0, 2**44] (16 TiB, past any one host)."""
    policy: Literal["cost", "lru"] = "cost"
    """Which model to evict: ``cost``, the one with the lowest expected reuse × measured
    reload seconds; ``lru``, the least recently used."""
    reuse_half_life: Seconds = Field(default=300.0, gt=0, le=86400)
    """Half-life of the decayed use count behind the ``cost`` policy's expected reuse.
    Seconds, in (0, 86400]."""
    stage_min_queued: int = Field(default=2, ge=0, le=100_000)
    """Under the Stepline placement, a model with at least this many jobs waiting that no worker
    holds (device or host) is read into the host memory of a worker with host room ahead of its
    jobs (``scheduler.placement.stage``; 0: never). Needs a host tier
    (``host_memory_budget_bytes`` not 0). Jobs, in [0, 100000]."""
