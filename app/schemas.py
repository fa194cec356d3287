"""The REST API's typed messages, shared by the API, the client and the CLI.

Names differ from the runtime's on purpose (``JobSummary``/``JobDetail`` here, ``JobRecord`` in
``tasks.record``, ``JobView``/``WorkerView`` in the scheduler), so an import says which it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.lifecycle import JobState, SloClass
from tasks.spec import JobKindName, JobSpec, SimulatedParams

__all__ = ["JobSpec", "SimulatedParams"]


class JobSummary(BaseModel):
    """A job as the API and CLI show it (not the runtime's ``tasks.record.JobRecord``)."""

    id: str
    kind: JobKindName
    state: JobState
    slo: SloClass
    tenant: str
    tier: str
    progress: int = Field(description="Chunks completed.")
    total: int = Field(description="Chunks in the job.")
    submitted_at: float
    deadline_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue: str | None = None
    epoch: int = 0
    preemptions: int = 0
    origin: bool = False
    error: str | None = None
    artifact: str | None = Field(default=None, description="Artifact name in the store.")
    media_type: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


class JobDetail(JobSummary):
    """A job as the REST API returns it: the summary plus links and derived timings."""

    turnaround_s: float | None = Field(
        default=None, description="Submit to finish, in seconds (once finished)."
    )
    deadline_met: bool | None = Field(default=None, description="Finished by its deadline.")
    result_url: str | None = Field(default=None, description="Where the artifact is served.")


class JobPage(BaseModel):
    """One page of GET /v1/jobs, newest first."""

    jobs: list[JobDetail]
    limit: int
    offset: int
    next_cursor: str | None = Field(
        default=None, description="Pass as ?cursor= for the next page; null on the last page."
    )


class InferenceRequest(BaseModel):
    """POST /v1/inference: text in, text out, within an interactive (or realtime) deadline."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    inputs: str = Field(min_length=1, max_length=16_384, description="The prompt.")
    params: dict[str, Any] = Field(
        default_factory=dict, alias="parameters",
        description="Text-job parameters (max_new_tokens, temperature, top_p, seed, model ...).",
    )
    slo: Literal["realtime", "interactive"] | None = Field(
        default=None, description="Class of the job; default: the server's api.inference_slo."
    )


class InferenceMetrics(BaseModel):
    """What the MoE run reports with its output."""

    model_config = ConfigDict(extra="allow")

    activated_experts: list[int] = Field(default_factory=list)
    routing_score: float | None = None
    latency_ms: float | None = None


class InferenceResponse(BaseModel):
    """The answer of POST /v1/inference."""

    output: str
    metrics: InferenceMetrics
    job_id: str


class ClassStats(BaseModel):
    """SLO attainment of one class over the recent finished jobs."""

    finished: int = Field(description="Jobs that ended (DONE, FAILED, EXPIRED) in the window.")
    met: int = Field(description="Of those, DONE by their deadline.")
    attainment: float | None = Field(description="met / finished; null with none finished.")
    p50_latency_s: float | None = None
    p95_latency_s: float | None = None
    unfinished: int = Field(default=0, description="Jobs of the class not yet ended.")


class WorkerInfo(BaseModel):
    """A worker's last heartbeat (not the scheduler's ``WorkerView``)."""

    model_config = ConfigDict(extra="allow")

    name: str
    busy_job: str | None = None
    queues: list[str] = Field(default_factory=list)
    device: str | None = None
    age_s: float | None = Field(default=None, description="Seconds since the heartbeat.")
    chunks_run: int | None = None
    cache_hit_rates: dict[str, float | None] = Field(default_factory=dict)


class StatsView(BaseModel):
    """GET /v1/stats: what the scheduler is doing now."""

    classes: dict[str, ClassStats]
    queues: dict[str, int] = Field(description="Messages waiting per Celery queue.")
    origin: str | None = Field(description="The origin job id, if it is the caller's.")
    origin_active: bool = Field(description="Whether any job is the origin now.")
    load: dict[str, Any] | float | None = Field(description="The admission state, if published.")
    workers: list[WorkerInfo]
    cache_hit_rates: dict[str, float | None] = Field(
        description="Hit rate per cache, over every worker's counters."
    )
    window_jobs: int


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer."""

    detail: str = Field(description="What went wrong and what to do.")
    job_id: str | None = Field(default=None, description="The job concerned, where one is.")
