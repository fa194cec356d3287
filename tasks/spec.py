"""What a client submits: the job spec and the parameters of the simulated kind (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.lifecycle import SloClass

JobKindName = Literal["simulated", "image", "video", "text"]


class SimulatedParams(BaseModel):
    """A job whose chunks sleep their declared step time (for tests, demos and benchmarks)."""

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
    exact: bool | None = Field(
        default=None,
        description="Never batch this job with others: its output is bit-identical to a lone "
                    "run. Default: true for the realtime class, false otherwise (a batched "
                    "job's output is deterministic for its batch schedule, within float "
                    "rounding of the lone run).",
    )
