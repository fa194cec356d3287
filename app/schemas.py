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
    degraded: dict[str, Any] | None = Field(
        default=None, description="Set when admission ran the job at a lower level than asked "
                                  "(its quality_floor allowed it): steps, full_steps, reason, "
                                  "meets, and step_cache, height, width, work_share when "
                                  "they changed.")
    result_url: str | None = Field(default=None, description="Where the artifact is served.")


class JobPage(BaseModel):
    """One page of GET /v1/jobs, newest first."""

    jobs: list[JobDetail]
    limit: int
    offset: int
    next_cursor: str | None = Field(
        default=None, description="Pass as ?cursor= for the next page; null on the last page."
    )


MAX_BATCH = 500
"""Most jobs one POST /v1/jobs/batch carries."""


class BatchSubmit(BaseModel):
    """POST /v1/jobs/batch: many jobs in one request (a backlog submitted in a few round trips
    instead of one request per job)."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec] = Field(min_length=1, max_length=MAX_BATCH,
                                description=f"1 to {MAX_BATCH} jobs, each as POST /v1/jobs takes.")


class BatchEntry(BaseModel):
    """What became of one job of a batch, in the batch's order."""

    id: str | None = Field(default=None, description="The job's id; null when it was shed.")
    created: bool = Field(default=False, description="False for an idempotency-key replay (the "
                                                     "first job's id) or a shed job.")
    error: str | None = Field(default=None, description="Why admission shed it (overload).")
    retry_after_s: float | None = Field(default=None, description="When to submit it again.")


class BatchSubmitted(BaseModel):
    """The answer to POST /v1/jobs/batch."""

    jobs: list[BatchEntry]


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


class WorkerWarmth(BaseModel):
    """Whether one chunk worker has run its warm-up (from its heartbeat)."""

    warm: bool = Field(description="No warm-up pending (done, or warm_start is off).")
    warmed: list[str] = Field(default_factory=list, description="Recipes warmed up.")


class Readiness(BaseModel):
    """GET /readyz: ready once every alive chunk worker is warm."""

    status: Literal["ready", "warming", "no_workers"]
    api_warm: bool = Field(description="This API process has validated and planned a job of "
                                       "every recipe (torch and the recipes loaded).")
    workers: dict[str, WorkerWarmth] = Field(default_factory=dict)


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


# OpenAI-compatible routes (app/api/openai.py) -------------------------------------------------
_IDEMPOTENCY = r"^[A-Za-z0-9._:\-]+$"


class AdapterRef(BaseModel):
    """A LoRA adapter a job applies (``GET /v1/adapters`` lists them), and how strongly."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    scale: float = Field(default=1.0, ge=-8, le=8,
                         description="1: the adapter as trained; 0: the base model's output.")


class SteplineOptions(BaseModel):
    """The ``stepline`` field of an OpenAI-compatible request (the OpenAI SDK sends it with
    ``extra_body={"stepline": {...}}``); the ``X-Stepline-SLO-Class`` and
    ``X-Stepline-Deadline-S`` headers fill what it leaves out."""

    model_config = ConfigDict(extra="forbid")

    slo_class: SloClass | None = Field(
        default=None, description="realtime, interactive or batch; default: api.inference_slo.")
    deadline_s: float | None = Field(
        default=None, gt=0, le=7 * 86400,
        description="Seconds from submit to the deadline; default: the class target.")
    shed_if_late: bool = Field(
        default=False, description="Under overload, end the job (an error answer) once it can "
                                   "no longer meet its deadline, instead of finishing late.")
    idempotency_key: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=_IDEMPOTENCY,
        description="Same key, same tenant → the same job (safe retries).")
    exact: bool | None = Field(
        default=None, description="Never batch the job with others (bit-identical to a lone "
                                  "run); default: true for realtime, false otherwise.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="More parameters of the job's kind, e.g. chunk_tokens or routing (text), "
                    "num_inference_steps, guidance_scale, scheduler or negative_prompt (image).")
    adapters: list[AdapterRef] = Field(
        default_factory=list, max_length=4,
        description="Image requests: LoRA adapters of the model (GET /v1/adapters), applied "
                    "in order, each at its scale.")


class OpenAIErrorDetail(BaseModel):
    """What went wrong, as OpenAI spells it."""

    message: str = Field(description="What was wrong and what to do.")
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error ...")
    param: str | None = Field(default=None, description="The request field at fault.")
    code: str | None = Field(default=None, description="A stable machine-readable reason.")


class OpenAIErrorBody(BaseModel):
    """Every 4xx/5xx answer of the OpenAI-compatible routes."""

    error: OpenAIErrorDetail


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)


class StreamOptions(BaseModel):
    """``stream_options`` of a streaming request."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = Field(
        default=False, description="End the stream with a chunk carrying the usage counts.")
    continuous_usage_stats: bool = Field(
        default=False, description="Usage counts so far on every chunk (vLLM's extension).")


class _TextRequest(BaseModel):
    """Fields the chat and the legacy completions request share. Any other field is refused
    with a 400 naming it, unless set to a value that changes nothing (see app/api/openai.py)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=200, description="A text recipe (GET /v1/models).")
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2,
                                      description="0 is greedy decoding; default 1.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus; default 1.")
    seed: int | None = Field(default=None, ge=0, lt=2**32,
                             description="Sampling seed below 2**32 (the text runner's router "
                                         "derives per-step seeds from it); default: drawn per "
                                         "request, reported in stepline.seed.")
    stop: str | list[str] | None = Field(default=None,
                                         description="Up to 4 sequences that end the text.")
    n: int | None = Field(default=None, ge=1, description="Choices per request; must be 1.")
    stream: bool | None = Field(default=False, description="Server-sent events per chunk.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(
        default=False, description="Generate max_tokens tokens, past the end-of-sequence "
                                   "token (vLLM's extension, for fixed-length output).")
    min_tokens: int | None = Field(
        default=None, ge=0, description="No end-of-sequence token before this many tokens "
                                        "(vLLM's extension); at most max_tokens.")
    user: str | None = Field(default=None, max_length=512, description="Accepted, unused.")
    stepline: SteplineOptions | None = None


class ChatCompletionRequest(_TextRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1,
                                              description="Newer name of max_tokens.")


class CompletionRequest(_TextRequest):
    """POST /v1/completions (legacy): one prompt string."""

    prompt: str | list[str] = Field(description="The prompt (a list holding one is accepted).")


class Usage(BaseModel):
    """Token counts of one answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SteplineReport(BaseModel):
    """The job behind an OpenAI-compatible answer (its ``stepline`` field)."""

    model_config = ConfigDict(extra="allow")

    job_id: str
    state: JobState
    slo_class: SloClass
    tier: str
    model: str | None = None
    seed: int | None = Field(default=None, description="The seed the job ran with.")
    submitted_at: float
    deadline_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_s: float | None = Field(default=None, description="Submit to the first chunk.")
    turnaround_s: float | None = Field(default=None, description="Submit to the end.")
    service_s: float = Field(description="Seconds spent running chunks.")
    deadline_met: bool | None = None
    preemptions: int = 0
    chunks: int = Field(description="Chunks in the job.")
    chunks_done: int
    metrics: dict[str, Any] = Field(
        default_factory=dict,
        description="What the run reported (text: activated experts, routing score, latency, "
                    "expert version, cache counters).")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    """The answer of POST /v1/chat/completions."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    stepline: SteplineReport


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streaming chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    stepline: SteplineReport | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    """The answer of POST /v1/completions, and each event of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
    stepline: SteplineReport | None = None


class ModelCard(BaseModel):
    """One configured recipe."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stepline"
    stepline: dict[str, Any] = Field(default_factory=dict,
                                     description="kind (text, image, video), description.")


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ImageRequest(BaseModel):
    """POST /v1/images/generations."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1, max_length=2000)
    model: str | None = Field(default=None, max_length=200,
                              description="An image recipe; default: the default image model.")
    size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$",
                             description="WxH in pixels; default: the recipe's.")
    n: int | None = Field(default=None, ge=1, description="Images per request; must be 1.")
    response_format: Literal["url", "b64_json"] | None = Field(
        default=None, description="url (default): the job's result URL, which takes the same "
                                  "API key; b64_json: the image inline.")
    output_format: Literal["png", "webp"] | None = None
    quality: str | None = Field(default=None, max_length=32, description="Accepted, unused.")
    style: str | None = Field(default=None, max_length=32, description="Accepted, unused.")
    user: str | None = Field(default=None, max_length=512, description="Accepted, unused.")
    stepline: SteplineOptions | None = None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    """The answer of POST /v1/images/generations."""

    created: int
    data: list[ImageData]
    size: str | None = None
    output_format: str | None = None
    stepline: SteplineReport


class AdapterInfo(BaseModel):
    """One registered LoRA adapter (``GET /v1/adapters``)."""

    name: str
    base: str = Field(description="The model (recipe) the adapter fits; jobs name it as model.")
    rank: int
    alpha: float
    target_modules: list[str]
    description: str = ""


class AdapterList(BaseModel):
    """GET /v1/adapters: every adapter in the configured folder, by name."""

    object: Literal["list"] = "list"
    data: list[AdapterInfo]
