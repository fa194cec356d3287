"""Settings of expert/checkpoint affinity routing (``affinity:`` in configs/default.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.settings.durations import Seconds

AffinityKind = Literal["text", "image", "video", "simulated"]
PlacementName = Literal["oblivious", "warm", "stepline"]


class AffinitySettings(BaseModel):
    """A job's next chunk prefers the worker that ran its last one (per-worker queues placed
    right before each class queue), falling back to the class queue after ``max_wait``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Workers consume their own affinity queues and hops of the kinds below go there."""
    kinds: list[AffinityKind] = Field(default_factory=lambda: list[AffinityKind](["text"]))
    """Job kinds whose chunks continue on the same worker (text: its experts are resident;
    diffusion: its checkpoint stays in the worker's memory)."""
    max_wait: Seconds = Field(default=0.3, gt=0, le=60)
    """A chunk parked this long in a busy worker's affinity queue moves to its class queue.
    Seconds, in (0, 60]."""
    prefill_min_fit: float = Field(default=0.5, ge=0, le=1)
    """A new text job goes to an idle worker whose resident experts cover at least this share
    of the model's most frequent experts; otherwise to its class queue. A fraction, in
    [0, 1]."""
    placement: PlacementName = "stepline"
    """Where a released chunk of a job that runs on a model (image, video, a simulated job
    naming a ``model``) goes (``scheduler.placement``); the default is the value above.

    - ``oblivious``: its class queue; any worker takes it and loads the model if it must.
    - ``warm``: an idle worker holding its model in device memory, else its class queue.
    - ``stepline``: the worker where it starts soonest, counting the model's load there, and
      charging a load that evicts a model queued jobs need with their reload; the tick
      counts each waiting job's expected load into its deadline.

    Unless ``oblivious``, such a job's next chunk stays on the worker that ran its last (no
    model switch mid-job)."""
