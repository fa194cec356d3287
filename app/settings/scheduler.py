"""Settings of the SLO scheduler (``scheduler:`` in configs/default.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.settings.durations import Seconds


class SloClassSettings(BaseModel):
    """Latency target of one SLO class."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    target_s: float = Field(gt=0)
    """End-to-end latency target of a job of this class, in seconds."""


def _default_classes() -> dict[str, SloClassSettings]:
    return {
        "realtime": SloClassSettings(target_s=1.0),
        "interactive": SloClassSettings(target_s=5.0),
        "batch": SloClassSettings(target_s=60.0),
    }


class SchedulerSettings(BaseModel):
    """The scheduling policy's knobs; the reference design's values are the defaults."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: Literal["fifo", "priority", "stepline"] = "stepline"
    """Which policy plans the ticks: plain FIFO, static class priority, or Stepline's."""
    origin_detection_interval: Seconds = Field(default=0.1, gt=0, le=10)
    """How often beat sends the scheduler tick (the origin is re-scored every tick)."""
    resource_reserve_ratio: float = Field(default=0.2, ge=0, le=0.9)
    """Share of workers kept for origin and realtime work."""
    preemption_timeout: Seconds = Field(default=0.05, gt=0, le=60)
    """How long a preempted job may take to stop (one block group should fit inside)."""
    convergence_threshold: float = Field(default=0.8, gt=0, le=1)
    """Load above which overload convergence pauses batch work."""
    slo_classes: dict[str, SloClassSettings] = Field(default_factory=_default_classes)
    """Latency target per class; batch's target is a floor ("> 10 s"), the default deadline."""
