"""What a client submits: the job spec and the parameters of the simulated kind (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.lifecycle import SloClass

JobKindName = Literal["simulated", "image", "video", "text"]


NAME_PATTERN = r"^[A-Za-z0-9._\-]+$"
MODEL_FIELDS = ("model", "model_bytes", "load_ms", "host_load_ms", "adapters")
"""The simulated params that declare a model; stored only for a job that names one."""


class SimulatedAdapter(BaseModel):
    """A LoRA adapter a simulated job applies on its model: loaded once per worker holding the
    model, in ``load_ms``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    load_ms: float = Field(default=0.0, ge=0, le=600_000, description="Load time, in ms.")


class SimulatedParams(BaseModel):
    """A job whose chunks sleep their declared step time (for tests, demos and benchmarks).
    A job that names a ``model`` runs on it: a worker holds the model in its model residency
    (``model_bytes`` of real tensor memory, counted against ``residency.memory_budget_bytes``),
    and one that does not hold it pays its load first: ``load_ms`` from disk, ``host_load_ms``
    from host memory; each adapter not yet loaded on it, the adapter's ``load_ms``."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=10, ge=1, le=100_000, description="Number of chunks.")
    step_ms: float = Field(default=50.0, ge=0, le=600_000, description="Sleep per chunk, in ms.")
    block_groups: int = Field(
        default=1, ge=1, le=64, description="Each step splits into this many preemptible slices."
    )
    fail_at: int | None = Field(
        default=None, ge=0, description="Chunk index that raises (to exercise failure handling)."
    )
    batch_growth: float | None = Field(
        default=None, ge=0, le=4,
        description="Makes the job batchable: a batched step of b such jobs sleeps step_ms x "
                    "(1 + batch_growth x (b-1)); jobs batch only with jobs of the same step_ms "
                    "and growth. Default: the job always runs alone.",
    )
    model: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=NAME_PATTERN,
        description="The simulated model the job runs on (held in a worker's model "
                    "residency). Default: none; no load, nothing held.",
    )
    model_bytes: int = Field(
        default=1 << 20, ge=1, le=1 << 32,
        description="Bytes the model holds on a worker (a real tensor of this size).",
    )
    load_ms: float = Field(
        default=0.0, ge=0, le=600_000, description="Loading the model from disk, in ms."
    )
    host_load_ms: float | None = Field(
        default=None, ge=0, le=600_000,
        description="Moving the model back from host memory, in ms. Default: a quarter of "
                    "load_ms.",
    )
    adapters: list[SimulatedAdapter] = Field(
        default_factory=list, max_length=6, description="LoRA adapters applied on the model."
    )

    @model_validator(mode="after")
    def _model_declared(self) -> SimulatedParams:
        declared = self.model_fields_set & set(MODEL_FIELDS[1:])
        if self.model is None and declared:
            raise ValueError(f"{', '.join(sorted(declared))} describe a model: name it "
                             "(model)")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: each adapter once, not {names}")
        return self

    def stored(self) -> dict[str, Any]:
        """The params as stored with the job: the model fields only when it names a model."""
        body = self.model_dump()
        if self.model is None:
            for key in MODEL_FIELDS:
                body.pop(key, None)
        elif self.host_load_ms is None:
            body["host_load_ms"] = self.load_ms / 4.0
        return body


class QualityFloor(BaseModel):
    """How far a job may be degraded under overload instead of missing its deadline
    (``scheduler.degradation``): an image or video job (``num_inference_steps``) or a
    simulated one (``steps``) may then run at as few as ``min_steps`` steps; an image or video
    job also with the ``step_cache`` it accepts, and at a size down to ``min_height`` x
    ``min_width`` (on the model's size grid)."""

    model_config = ConfigDict(extra="forbid")

    min_steps: int = Field(ge=1, le=100_000,
                           description="The fewest steps the job accepts (1 to its own steps).")
    step_cache: Any = Field(
        default=None,
        description="A step cache the job accepts (e.g. {\"kind\": \"first_block\", "
                    "\"threshold\": 0.1}); image and video jobs of a model that takes one, "
                    "asked without a cache. Default: always uncached.")
    """A ``workers.diffusion.cache_params.StepCacheParams`` or None, validated as one by
    :meth:`_step_cache`: imported there, not at load, so a client that only lists jobs loads
    no worker code (``tests/unit/test_cli_imports.py``)."""
    min_height: int | None = Field(
        default=None, ge=1, le=16_384,
        description="The smallest height the job accepts (a multiple of the model's size "
                    "step, at most its own height). Default: its own height.")
    min_width: int | None = Field(
        default=None, ge=1, le=16_384,
        description="The smallest width the job accepts (as min_height). Default: its own "
                    "width.")

    @field_validator("step_cache", mode="before")
    @classmethod
    def _step_cache(cls, value: Any) -> Any:
        if value is None:
            return None
        from workers.diffusion.cache_params import StepCacheParams  # the package loads torch
        return StepCacheParams.model_validate(value)

    def lowers_more_than_steps(self) -> bool:
        """Whether the floor allows a cache or a smaller size (image and video jobs only)."""
        return self.step_cache is not None or self.min_height is not None \
            or self.min_width is not None


class JobSpec(BaseModel):
    """What a client submits. ``params`` are checked against the kind's own schema at submit."""

    model_config = ConfigDict(extra="forbid")

    kind: JobKindName = Field(description="simulated, image, video or text.")
    slo: SloClass = Field(default=SloClass.INTERACTIVE, description="realtime, interactive, batch.")
    deadline_s: float | None = Field(
        default=None, gt=0, le=7 * 86400,
        description="Seconds from submit to the deadline; default: the class target.",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Kind-specific parameters.")
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$",
        description="Same key, same tenant → the same job (safe retries).",
    )
    shed_if_late: bool = Field(
        default=False,
        description="Under overload, end this job (EXPIRED, with the reason) once it can no "
                    "longer meet its deadline; by default it is demoted behind the work that "
                    "still can and finishes late.",
    )
    depends_on: list[str] = Field(
        default_factory=list, max_length=16, description="Job ids that must finish first."
    )
    quality_floor: QualityFloor | None = Field(
        default=None,
        description="Under overload, allow running at fewer steps (down to min_steps), with "
                    "an accepted step cache or at a smaller size, when the job would otherwise "
                    "miss its deadline; the level chosen is in its "
                    "events and its record. Default: never degraded.",
    )
    exact: bool | None = Field(
        default=None,
        description="Never batch this job with others: its output is bit-identical to a lone "
                    "run. Default: true for the realtime class, false otherwise (a batched "
                    "job's output is deterministic for its batch schedule, within float "
                    "rounding of the lone run).",
    )
