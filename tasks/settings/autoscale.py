"""Settings of the worker autoscaler of ``stepline up --workers MIN:MAX`` (``service.autoscale:``
in configs/default.yaml); the bounds themselves come from the command line."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.settings.durations import Seconds


class AutoscaleSettings(BaseModel):
    """When the stack adds or drains local worker processes (see ``app.autoscale``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    interval: Seconds = Field(default=1.0, ge=0.05, le=60)
    """How often the signals are read and a decision taken. Seconds, in [0.05, 60]."""
    backlog_per_worker: float = Field(default=1.0, gt=0, le=10000)
    """Backlog: at least this many jobs waiting for a worker per active worker. Jobs per
    worker, in (0, 10000]."""
    max_wait: Seconds = Field(default=2.0, gt=0, le=86400)
    """Old wait: a job has waited this long for a worker (a chunk hop waits milliseconds).
    Seconds, in (0, 86400]."""
    load_high: float = Field(default=0.7, gt=0, le=1e6)
    """High load: the scheduler's load estimate at or above this while jobs wait (best below
    ``scheduler.convergence_threshold``, so workers are added before work is held back). A
    load, in (0, 1e6]."""
    up_after: Seconds = Field(default=2.0, ge=0, le=3600)
    """Backlog, old wait or high load must hold this long, unbroken, before workers are added.
    Seconds, in [0, 3600]."""
    down_after: Seconds = Field(default=30.0, ge=0, le=86400)
    """Idleness (a worker with no job to run) must hold this long before one is drained.
    Seconds, in [0, 86400]."""
    up_cooldown: Seconds = Field(default=5.0, ge=0, le=3600)
    """No workers are added within this long of the last change (new ones need to start).
    Seconds, in [0, 3600]."""
    down_cooldown: Seconds = Field(default=30.0, ge=0, le=86400)
    """No worker is drained within this long of the last change. Seconds, in [0, 86400]."""
    up_step: int = Field(default=2, ge=1, le=64)
    """Most workers added by one decision. Workers, in [1, 64]."""
    down_step: int = Field(default=1, ge=1, le=64)
    """Most workers drained by one decision. Workers, in [1, 64]."""
    drain_preempt_after: Seconds = Field(default=10.0, ge=0, le=86400)
    """A draining worker still running a chunk this long after it was told to stop has its job
    flagged to yield at the next block-group boundary (a durable checkpoint; the job continues
    on another worker). Seconds, in [0, 86400]."""
    drain_timeout: Seconds = Field(default=120.0, gt=0, le=86400)
    """A draining worker still alive this long is killed; the lease watchdog requeues its
    chunk from the last checkpoint under a new epoch. Seconds, in (0, 86400], and more than
    ``drain_preempt_after``."""

    @model_validator(mode="after")
    def _drain_order(self) -> AutoscaleSettings:
        if self.drain_timeout <= self.drain_preempt_after:
            raise ValueError(
                f"drain_timeout ({self.drain_timeout:g}s) must exceed drain_preempt_after "
                f"({self.drain_preempt_after:g}s): a draining worker is asked to yield first")
        return self
