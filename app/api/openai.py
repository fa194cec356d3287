"""OpenAI-compatible routes, on the same API keys and tenants as the rest of /v1:
chat and legacy completions on the MoE text recipes (streamed as each decode chunk commits),
image generations on the diffusion image recipes, and the model list.

Stepline's own knobs ride in the body's ``stepline`` field (the OpenAI SDK's ``extra_body``) or
the ``X-Stepline-SLO-Class`` / ``X-Stepline-Deadline-S`` headers; Stepline's account of the job
comes back under ``stepline``. A request lives as long as its job: a client that disconnects
before the answer (streaming or not) cancels the job, which stops at its next chunk.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from app.api.context import ApiContext, api_context, current_tenant
from app.api.follow import Progress, await_end, cancel_unfinished, follow
from app.api.inputs import form_cap
from app.api.jobs import submit_for
from app.api.multipart import FormField, read_form
from app.api.openai_errors import OpenAIError, OpenAIRoute, as_openai_error, job_ended_error
from app.api.openai_text import ChatTemplate, TextDeltas, render_chat
from app.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ImageData,
    ImageRequest,
    ImagesResponse,
    JobSpec,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
    SteplineOptions,
    SteplineReport,
    StreamOptions,
    Usage,
)
from app.tenants import Tenant
from scheduler.lifecycle import JobState, SloClass
from tasks.record import JobRecord
from workers.diffusion.adapters import adapter_registry
from workers.diffusion.inputs import accepted_inputs, required_inputs
from workers.errors import ModelConfigError
from workers.limits import MAX_NEW_TOKENS
from workers.registry import RecipeFile, default_registry

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
Ctx = Annotated[ApiContext, Depends(api_context)]
Caller = Annotated[Tenant, Depends(current_tenant)]
SloHeader = Annotated[SloClass | None, Header(
    alias="X-Stepline-SLO-Class", description="SLO class, unless the body's stepline says.")]
DeadlineHeader = Annotated[float | None, Header(
    alias="X-Stepline-Deadline-S", gt=0, le=7 * 86400,
    description="Seconds from submit to the deadline, unless the body's stepline says.")]

DEFAULT_CHAT_MAX_TOKENS = 256
"""max_tokens of a chat request that sets none (OpenAI's "up to the context" is not offered)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""max_tokens of a legacy completion request that sets none (OpenAI's default)."""
MAX_STOP_SEQUENCES = 4
KEEPALIVE_S = 15.0
"""A stream with nothing new for this long sends an SSE comment, so proxies keep it open."""

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIErrorBody, "description": what} for status, what in (
        (400, "Invalid or unsupported parameters; error.param names the field."),
        (401, "Missing or unknown API key."),
        (404, "Unknown model."),
        (429, "Rate limit, queue quota, or shed under overload; see Retry-After."),
        (500, "The job failed on its worker (x-should-retry: false)."),
        (503, "The job store (Redis) is unavailable; see Retry-After."),
    )
}
_USE_INSTEAD = {"text": "POST /v1/chat/completions or /v1/completions",
                "image": "POST /v1/images/generations",
                "video": "POST /v1/jobs with kind video"}
# OpenAI fields Stepline does not serve: refused unless set to a value that changes nothing.
_NO_OP: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: not v, "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
    "logprobs": lambda v: not v, "top_logprobs": lambda v: not v,
    "logit_bias": lambda v: not v, "presence_penalty": lambda v: not v,
    "frequency_penalty": lambda v: not v, "echo": lambda v: not v, "suffix": lambda v: not v,
    "best_of": lambda v: v in (None, 1), "audio": lambda v: not v, "prediction": lambda v: not v,
    "modalities": lambda v: v in (None, ["text"]),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "parallel_tool_calls": lambda v: v in (None, True, False),
    "background": lambda v: v in (None, "auto"), "output_compression": lambda v: v in (None, 100),
}
# vLLM's sampling extensions Stepline does not serve (ignore_eos and min_tokens it does): refused
# unless set to vLLM's default, which changes nothing. Listed in the README.
_VLLM_NO_OP: dict[str, Callable[[Any], bool]] = {
    "top_k": lambda v: v in (None, -1, 0), "min_p": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1), "length_penalty": lambda v: v in (None, 1),
    "use_beam_search": lambda v: not v, "early_stopping": lambda v: not v,
    "stop_token_ids": lambda v: not v, "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: not v, "logits_processors": lambda v: not v,
    "include_stop_str_in_output": lambda v: not v,
    "skip_special_tokens": lambda v: v in (None, True),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "prompt_logprobs": lambda v: v is None, "truncate_prompt_tokens": lambda v: v is None,
    "return_tokens_as_token_ids": lambda v: not v, "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None, "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None, "guided_decoding_backend": lambda v: v is None,
    "guided_whitespace_pattern": lambda v: v is None, "structured_outputs": lambda v: v is None,
    "add_generation_prompt": lambda v: v in (None, True),
    "continue_final_message": lambda v: not v, "documents": lambda v: not v,
    "chat_template": lambda v: v is None, "chat_template_kwargs": lambda v: not v,
    "mm_processor_kwargs": lambda v: not v, "priority": lambda v: v in (None, 0),
    "request_id": lambda v: v is None, "vllm_xargs": lambda v: not v,
}
# Fields OpenAI defines that change nothing about the answer: accepted and unused.
_ACCEPTED_UNUSED = frozenset({"metadata", "store", "service_tier", "moderation"})
_TEXT_FIELDS = {"prompt": "messages or prompt", "inputs": "messages or prompt",
                "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                "seed": "seed", "model": "model", "ignore_eos": "ignore_eos",
                "min_new_tokens": "min_tokens"}
_IMAGE_FIELDS = {"prompt": "prompt", "model": "model", "height": "size", "width": "size",
                 "output_format": "output_format", "adapters": "stepline.adapters"}


# models ---------------------------------------------------------------------------------------
def _card(ctx: ApiContext, recipe: RecipeFile) -> ModelCard:
    """The recipe's card: what it takes (``inputs``) and what every job of it must carry
    (``requires``: its condition, and an edit or image-to-video model's input image); a
    diffusion recipe's lists the adapters that fit it, and its ControlNets."""
    description = recipe.spec.get("description")
    extra: dict[str, Any] = {"description": description} if description else {}
    extra["inputs"] = extra["requires"] = ["text"]
    if recipe.kind in ("image", "video"):
        extra["adapters"] = adapter_registry(ctx.settings.diffusion.adapters_dir).for_base(
            recipe.name)
        family = str(recipe.spec.get("family"))
        conditioning = "class" if family == "dit" else "text"
        controlnets = _controlnets(recipe)
        extra["inputs"] = accepted_inputs(family, conditioning, bool(controlnets))
        extra["requires"] = required_inputs(family, conditioning)
        if controlnets:
            extra["controlnets"] = controlnets
    return ModelCard(id=recipe.name, created=int(recipe.path.stat().st_mtime),
                     stepline={"kind": recipe.kind, **extra})


def _controlnets(recipe: RecipeFile) -> list[dict[str, Any]]:
    """The ControlNets a diffusion recipe declares: each one's name, description and what a
    job naming it (``params.controlnet``) must carry."""
    declared = recipe.spec.get("controlnets") or {}
    return [{"name": name, "description": str((spec or {}).get("description", "")),
             "requires": ["control_image"]} for name, spec in sorted(declared.items())]


@router.get("/models", response_model=ModelList, responses=ERRORS,
            summary="The configured recipes (text and diffusion), OpenAI's list shape")
def list_models(ctx: Ctx, tenant: Caller) -> ModelList:
    registry = default_registry()
    return ModelList(data=[_card(ctx, registry.get(name)) for name in registry.names()])


@router.get("/models/{model}", response_model=ModelCard, responses=ERRORS, summary="One recipe")
def get_model(model: Annotated[str, Path(max_length=200)], ctx: Ctx,
              tenant: Caller) -> ModelCard:
    return _card(ctx, _recipe(model))


def _recipe(name: str) -> RecipeFile:
    registry = default_registry()
    try:
        return registry.get(name)
    except ModelConfigError as exc:
        raise OpenAIError(404, f"the model {name!r} does not exist; served models: "
                          f"{', '.join(registry.names())} (GET /v1/models)",
                          param="model", code="model_not_found") from exc


def _require_kind(name: str, kind: str) -> None:
    recipe = _recipe(name)
    if recipe.kind != kind:
        raise OpenAIError(400, f"{name!r} is a {recipe.kind} model; use it at "
                          f"{_USE_INSTEAD.get(recipe.kind, 'POST /v1/jobs')}",
                          param="model", code="model_not_supported")


@lru_cache(maxsize=16)
def chat_tokenizer(model: str) -> ChatTemplate | None:
    """The tokenizer whose chat template renders ``model``'s conversations: a recipe with a
    weights directory brings its own tokenizer; the built-in one has no template."""
    if not default_registry().get(model).spec.get("weights"):
        return None
    from transformers import PreTrainedTokenizerFast  # deferred: loads transformers

    from workers.moe.recipes import load_recipe  # deferred: loads torch

    weights = load_recipe(model).weights
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(weights))
    return tokenizer if tokenizer.chat_template else None


# the request → the job ------------------------------------------------------------------------
def _refuse_unsupported(body: BaseModel) -> None:
    """Every field the request's model does not declare is honoured elsewhere, accepted as
    unused, or refused here with a 400 naming it: none is silently ignored."""
    for name, value in (body.model_extra or {}).items():
        if name in _ACCEPTED_UNUSED:
            continue
        no_op = _NO_OP.get(name) or _VLLM_NO_OP.get(name)
        if no_op is None:
            raise OpenAIError(400, f"unknown parameter {name!r}; Stepline takes Stepline's own "
                              "knobs in the 'stepline' field", param=name,
                              code="unknown_parameter")
        if not no_op(value):
            raise OpenAIError(400, f"{name} is not supported by Stepline; leave it unset",
                              param=name, code="unsupported_parameter")


def _only_one(n: int | None, what: str) -> None:
    if n not in (None, 1):
        raise OpenAIError(400, f"n={n}: Stepline makes one {what} per request; send {n} "
                          "requests instead (with different seeds)", param="n",
                          code="unsupported_value")


def _options(body: SteplineOptions | None, slo: SloClass | None,
             deadline_s: float | None) -> SteplineOptions:
    """The body's stepline field, its gaps filled from the X-Stepline-* headers."""
    options = body or SteplineOptions()
    updates: dict[str, Any] = {}
    if options.slo_class is None and slo is not None:
        updates["slo_class"] = slo
    if options.deadline_s is None and deadline_s is not None:
        updates["deadline_s"] = deadline_s
    return options.model_copy(update=updates)


def _job_spec(ctx: ApiContext, kind: Literal["text", "image"], options: SteplineOptions,
              params: dict[str, Any], openai_fields: dict[str, str]) -> JobSpec:
    """The job of a request: its OpenAI fields, plus ``stepline.params`` for the rest."""
    for key in options.params:
        if key in openai_fields:
            raise OpenAIError(400, f"stepline.params.{key}: set it with the OpenAI field "
                              f"{openai_fields[key]}", param=f"stepline.params.{key}")
    return JobSpec(
        kind=kind, slo=options.slo_class or SloClass(ctx.settings.api.inference_slo),
        deadline_s=options.deadline_s, params={**options.params, **params},
        idempotency_key=options.idempotency_key, shed_if_late=options.shed_if_late,
        exact=options.exact)


SEED_LIMIT = 2**32
"""Seeds drawn for requests that set none stay below this: the text runner's router derives
per-step torch seeds as ``seed * 1_000_003 * 1009``, which overflows int64 past ~9.1e9."""


def _seed(seed: int | None) -> int:
    """The request's seed, else a fresh one (as OpenAI samples differently per request)."""
    return secrets.randbelow(SEED_LIMIT) if seed is None else seed


def _report(record: JobRecord, metrics: dict[str, Any] | None = None) -> SteplineReport:
    r = record
    seed, model = r.params.get("seed"), r.params.get("model")
    return SteplineReport(
        job_id=r.job_id, state=r.state, slo_class=r.slo, tier=r.tier.value,
        model=model if isinstance(model, str) else None,
        seed=seed if isinstance(seed, int) else None,
        submitted_at=r.submitted_at_s, deadline_at=r.deadline_at_s, started_at=r.started_at_s,
        finished_at=r.finished_at_s, service_s=r.service_s, preemptions=r.preemptions,
        queue_s=None if r.started_at_s is None else r.started_at_s - r.submitted_at_s,
        turnaround_s=r.latency_s, chunks=r.num_chunks, chunks_done=r.next_chunk,
        deadline_met=None if r.finished_at_s is None else (
            r.state is JobState.DONE and r.finished_at_s <= r.deadline_at_s),
        metrics={k: v for k, v in (metrics or {}).items() if k != "activated_experts_by_layer"},
    )


# text -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TextAsk:
    """One OpenAI text request as Stepline runs it."""

    flavor: Literal["chat", "completion"]
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    min_tokens: int = 0
    continuous_usage: bool = False
    """Usage counts on every chunk of the stream (``stream_options.continuous_usage_stats``)."""

    @property
    def response_id_prefix(self) -> str:
        return "chatcmpl-" if self.flavor == "chat" else "cmpl-"

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "prompt": self.prompt, "max_new_tokens": self.max_tokens, "model": self.model,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.min_tokens:
            params["min_new_tokens"] = self.min_tokens
        return params


@dataclass(frozen=True, slots=True)
class TextOutcome:
    """What a text job answered: the text (cut at a stop sequence), why it ended, the counts."""

    record: JobRecord
    text: str
    finish_reason: Literal["stop", "length"]
    usage: Usage
    metrics: dict[str, Any]


def _stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    if len(sequences) > MAX_STOP_SEQUENCES or not all(sequences):
        raise OpenAIError(400, f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings",
                          param="stop")
    return tuple(sequences)


def _text_ask(flavor: Literal["chat", "completion"], body: ChatCompletionRequest |
              CompletionRequest, prompt: str, max_tokens: int) -> TextAsk:
    _refuse_unsupported(body)
    _only_one(body.n, "choice")
    if max_tokens > MAX_NEW_TOKENS:
        raise OpenAIError(400, f"max_tokens={max_tokens}: a Stepline text job generates at "
                          f"most {MAX_NEW_TOKENS} tokens", param="max_tokens")
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}",
                          param="min_tokens")
    stream_options = body.stream_options or StreamOptions()
    _refuse_unknown_stream_options(stream_options)
    return TextAsk(
        flavor=flavor, model=body.model, prompt=prompt, max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=_seed(body.seed),
        stop=_stop_sequences(body.stop), stream=bool(body.stream),
        include_usage=stream_options.include_usage, ignore_eos=bool(body.ignore_eos),
        min_tokens=min_tokens, continuous_usage=stream_options.continuous_usage_stats)


def _refuse_unknown_stream_options(options: StreamOptions) -> None:
    for name in options.model_extra or {}:
        raise OpenAIError(400, f"unknown stream_options field {name!r}; Stepline takes "
                          "include_usage and continuous_usage_stats",
                          param=f"stream_options.{name}", code="unknown_parameter")


def _message_text(index: int, message: ChatMessage) -> tuple[str, str]:
    """(role, text) of one message; tool turns and non-text content are refused."""
    if message.role in ("tool", "function") or (message.model_extra or {}).get("tool_calls"):
        raise OpenAIError(400, "tool calls are not supported by Stepline",
                          param=f"messages.{index}", code="unsupported_parameter")
    if message.content is None or isinstance(message.content, str):
        return message.role, message.content or ""
    texts = []
    for k, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"only text content is served, not {part.type!r}",
                              param=f"messages.{index}.content.{k}", code="unsupported_value")
        texts.append(part.text)
    return message.role, "\n".join(texts)


@router.post(
    "/chat/completions", response_model=ChatCompletion,
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "The completion; with stream: chat.completion.chunk "
                                    "events, then data: [DONE]."}, **ERRORS},
    summary="Chat completion on a MoE text recipe (OpenAI-compatible)",
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: Ctx, tenant: Caller,
    slo: SloHeader = None, deadline_s: DeadlineHeader = None,
) -> Response:
    ask = await run_in_threadpool(_chat_ask, body)
    return await _serve_text(ctx, tenant, request, ask, _options(body.stepline, slo, deadline_s))


def _chat_ask(body: ChatCompletionRequest) -> TextAsk:
    """The chat request as a text job (reads the recipes and maybe a tokenizer: off the loop)."""
    _require_kind(body.model, "text")
    if body.max_tokens and body.max_completion_tokens and \
            body.max_tokens != body.max_completion_tokens:
        raise OpenAIError(400, "max_tokens and max_completion_tokens differ; send one",
                          param="max_completion_tokens")
    messages = [_message_text(i, m) for i, m in enumerate(body.messages)]
    return _text_ask("chat", body, render_chat(messages, chat_tokenizer(body.model)),
                     body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS)


@router.post(
    "/completions", response_model=Completion,
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "The completion; with stream: text_completion events, "
                                    "then data: [DONE]."}, **ERRORS},
    summary="Legacy text completion on a MoE text recipe (OpenAI-compatible)",
)
async def create_completion(
    body: CompletionRequest, request: Request, ctx: Ctx, tenant: Caller,
    slo: SloHeader = None, deadline_s: DeadlineHeader = None,
) -> Response:
    ask = await run_in_threadpool(_completion_ask, body)
    return await _serve_text(ctx, tenant, request, ask, _options(body.stepline, slo, deadline_s))


def _completion_ask(body: CompletionRequest) -> TextAsk:
    """The completion request as a text job (reads the recipes: off the loop)."""
    _require_kind(body.model, "text")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise OpenAIError(400, "send one prompt per request", param="prompt",
                          code="unsupported_value")
    return _text_ask("completion", body, prompts[0],
                     body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)


async def _serve_text(ctx: ApiContext, tenant: Tenant, request: Request, ask: TextAsk,
                      options: SteplineOptions) -> Response:
    spec = _job_spec(ctx, "text", options, ask.params(), _TEXT_FIELDS)
    job_id, _ = await run_in_threadpool(submit_for, ctx, tenant, spec)
    headers = {"X-Stepline-Job-Id": job_id}
    if ask.stream:
        return JobEventStream(_text_events(ctx, job_id, ask),
                              on_abandon=partial(cancel_unfinished, ctx, job_id), headers=headers)
    deltas = TextDeltas(ask.stop)
    async for progress in follow(ctx, job_id, read_text=bool(ask.stop),
                                 disconnected=request.is_disconnected):
        _, outcome = await _advance(ctx, progress, deltas, ask)
        if outcome is not None:
            return JSONResponse(_answer(ask, outcome).model_dump(mode="json"), headers=headers)
    raise AssertionError("follow() ends only with an ended job")


async def _advance(ctx: ApiContext, progress: Progress, deltas: TextDeltas,
                   ask: TextAsk) -> tuple[str, TextOutcome | None]:
    """The text one observation of the job adds, and the outcome once the answer is complete:
    at the job's end, or at a stop sequence (the job is then cancelled: the rest is unused)."""
    record, so_far = progress.record, progress.text
    if not progress.ended:
        piece = deltas.feed(so_far.text) if so_far is not None else ""
        if so_far is None or not deltas.stopped:
            return piece, None
        await cancel_unfinished(ctx, record.job_id)
        usage = Usage(prompt_tokens=so_far.prompt_tokens, completion_tokens=so_far.generated,
                      total_tokens=so_far.prompt_tokens + so_far.generated)
        return piece, TextOutcome(record, deltas.text, "stop", usage, {})
    if record.state is not JobState.DONE:
        raise job_ended_error(record)
    result = await run_in_threadpool(_text_result, ctx, record)
    piece = deltas.feed(str(result.get("output", "")), final=True)
    metrics = dict(result.get("metrics") or {})
    generated, prompt_tokens = int(metrics.get("tokens", 0)), int(metrics.get("prompt_tokens", 0))
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                  total_tokens=prompt_tokens + generated)
    reason = deltas.finish_reason(generated, ask.max_tokens)
    return piece, TextOutcome(record, deltas.text, reason, usage, metrics)


def _text_result(ctx: ApiContext, record: JobRecord) -> dict[str, Any]:
    if not record.artifact:
        raise OpenAIError(500, f"job {record.job_id} finished without a result",
                          kind="server_error", code="job_failed")
    body = json.loads(ctx.artifacts.read(record.artifact))
    return body if isinstance(body, dict) else {}


def _answer(ask: TextAsk, outcome: TextOutcome) -> ChatCompletion | Completion:
    record = outcome.record
    response_id, created = ask.response_id_prefix + record.job_id, int(record.submitted_at_s)
    report = _report(record, outcome.metrics)
    if ask.flavor == "chat":
        message = AssistantMessage(content=outcome.text)
        return ChatCompletion(
            id=response_id, created=created, model=ask.model, usage=outcome.usage,
            stepline=report,
            choices=[ChatChoice(message=message, finish_reason=outcome.finish_reason)])
    return Completion(
        id=response_id, created=created, model=ask.model, usage=outcome.usage, stepline=report,
        choices=[CompletionChoice(text=outcome.text, finish_reason=outcome.finish_reason)])


# streaming ------------------------------------------------------------------------------------
class JobEventStream(StreamingResponse):
    """Server-sent events that follow one job; a client that leaves before the last event
    cancels the job (``on_abandon``), which stops at its next chunk."""

    def __init__(self, events: AsyncIterator[str], *,
                 on_abandon: Callable[[], Awaitable[None]], headers: dict[str, str]) -> None:
        self._complete = False
        self._on_abandon = on_abandon
        super().__init__(self._tracked(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **headers})

    async def _tracked(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for event in events:
            yield event
        self._complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._complete:
                await self._on_abandon()


def _sse(model: BaseModel) -> str:
    body = model.model_dump(mode="json")
    for key in ("usage", "stepline"):
        if body.get(key) is None:
            body.pop(key, None)
    for choice in body.get("choices", []):
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _chunk(ask: TextAsk, job_id: str, created: int, *, text: str | None = None,
           role: bool = False, finish: Literal["stop", "length"] | None = None,
           usage: Usage | None = None, report: SteplineReport | None = None) -> str:
    """One event of the stream: a piece of text, the opening role, the finish, or the usage
    (a last event with no choice, as OpenAI sends it)."""
    response_id = ask.response_id_prefix + job_id
    only_usage = usage is not None and finish is None and text is None
    if ask.flavor == "chat":
        delta = ChatDelta(role="assistant" if role else None, content=text)
        return _sse(ChatCompletionChunk(
            id=response_id, created=created, model=ask.model, usage=usage, stepline=report,
            choices=[] if only_usage else [ChatChunkChoice(delta=delta, finish_reason=finish)]))
    choice = CompletionChoice(text=text or "", finish_reason=finish)
    return _sse(Completion(id=response_id, created=created, model=ask.model, usage=usage,
                           stepline=report, choices=[] if only_usage else [choice]))


async def _text_events(ctx: ApiContext, job_id: str, ask: TextAsk) -> AsyncIterator[str]:
    """The stream of one text job: the text of each commit as it lands, the finish (with the
    stepline report), the usage when asked for, then ``[DONE]``; an error event if the job
    ends without its text. With ``continuous_usage`` every chunk carries the counts so far, so
    the opening chunk waits for the prefill's commit (the prompt's token count)."""
    created = int(time.time())
    opened = ask.flavor != "chat"
    if not opened and not ask.continuous_usage:
        yield _chunk(ask, job_id, created, text="", role=True)
        opened = True
    deltas, written_at, counts = TextDeltas(ask.stop), time.monotonic(), None
    try:
        async for progress in follow(ctx, job_id, read_text=True, heartbeat_s=KEEPALIVE_S):
            piece, outcome = await _advance(ctx, progress, deltas, ask)
            counts = _counts_so_far(progress, outcome, counts) if ask.continuous_usage else None
            if not opened and (counts is not None or outcome is not None):
                yield _chunk(ask, job_id, created, text="", role=True, usage=counts)
                opened = True
            if piece:
                yield _chunk(ask, job_id, created, text=piece, usage=counts)
            elif outcome is None and time.monotonic() - written_at >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
            written_at = time.monotonic() if piece else written_at
            if outcome is not None:
                yield _chunk(ask, job_id, created, finish=outcome.finish_reason, usage=counts,
                             report=_report(outcome.record, outcome.metrics))
                if ask.include_usage:
                    yield _chunk(ask, job_id, created, usage=outcome.usage)
                break
    except Exception as exc:
        error = as_openai_error(exc, ctx.settings.api.redis_retry_after)
        yield f"data: {json.dumps(error.body())}\n\n"
        return
    yield "data: [DONE]\n\n"


def _counts_so_far(progress: Progress, outcome: TextOutcome | None,
                   last: Usage | None) -> Usage | None:
    """The usage counts a stream's next chunk carries: the answer's once it is complete, else
    those of the latest committed checkpoint (None before the prefill commits)."""
    if outcome is not None:
        return outcome.usage
    so_far = progress.text
    if so_far is None:
        return last
    return Usage(prompt_tokens=so_far.prompt_tokens, completion_tokens=so_far.generated,
                 total_tokens=so_far.prompt_tokens + so_far.generated)


# images ---------------------------------------------------------------------------------------
def _size(size: str | None) -> dict[str, int]:
    if size is None:
        return {}
    width, height = (int(side) for side in size.split("x"))
    return {"width": width, "height": height}


@router.post("/images/generations", response_model=ImagesResponse, responses=ERRORS,
             summary="Image generation on a diffusion image recipe (OpenAI-compatible)")
async def create_image(
    body: ImageRequest, request: Request, ctx: Ctx, tenant: Caller,
    slo: SloHeader = None, deadline_s: DeadlineHeader = None,
) -> Response:
    spec = await run_in_threadpool(_image_spec, ctx, body, _options(body.stepline, slo, deadline_s))
    return await _serve_image(ctx, tenant, request, spec, body.response_format)


@router.post("/images/edits", response_model=ImagesResponse, responses=ERRORS,
             summary="Image edit (image-to-image) on a recipe that takes an input image "
                     "(OpenAI-compatible, multipart)")
async def edit_image(
    request: Request, ctx: Ctx, tenant: Caller,
    slo: SloHeader = None, deadline_s: DeadlineHeader = None,
) -> Response:
    form = await read_form(request, form_cap(ctx, 2))
    spec = await run_in_threadpool(_edit_spec, ctx, form, _options(None, slo, deadline_s))
    fmt = form["response_format"].text if "response_format" in form else None
    return await _serve_image(ctx, tenant, request, spec, fmt)


async def _serve_image(ctx: ApiContext, tenant: Tenant, request: Request, spec: JobSpec,
                       response_format: str | None) -> Response:
    """Submit an image job, wait for its end, answer with its image."""
    job_id, _ = await run_in_threadpool(submit_for, ctx, tenant, spec)
    record = await await_end(ctx, job_id, request.is_disconnected)
    if record.state is not JobState.DONE or not record.artifact:
        raise job_ended_error(record)
    item = await run_in_threadpool(_image_item, ctx, record, response_format, request)
    p = record.params
    answer = ImagesResponse(created=int(record.submitted_at_s), data=[item],
                            size=f"{p.get('width')}x{p.get('height')}",
                            output_format=p.get("output_format"), stepline=_report(record))
    return JSONResponse(answer.model_dump(mode="json"), headers={"X-Stepline-Job-Id": job_id})


def _image_spec(ctx: ApiContext, body: ImageRequest, options: SteplineOptions) -> JobSpec:
    """The image request as a job (reads the recipes: off the loop)."""
    _refuse_unsupported(body)
    _only_one(body.n, "image")
    if body.model is not None:
        _require_kind(body.model, "image")
    params: dict[str, Any] = {"prompt": body.prompt, **_size(body.size)}
    params.update({k: v for k, v in (("model", body.model),
                                     ("output_format", body.output_format)) if v is not None})
    if "seed" not in options.params:
        params["seed"] = _seed(None)
    if options.adapters:
        params["adapters"] = [adapter.model_dump() for adapter in options.adapters]
    return _job_spec(ctx, "image", options, params, _IMAGE_FIELDS)


_EDIT_FIELDS = frozenset({"image", "image[]", "mask", "prompt", "model", "n", "size",
                          "response_format", "output_format", "user"})


def _edit_spec(ctx: ApiContext, form: dict[str, FormField], options: SteplineOptions) -> JobSpec:
    """The edit form as an image job: its image (and mask) as base64, stored by digest at
    submit (reads the recipes: off the loop)."""
    unknown = sorted(set(form) - _EDIT_FIELDS)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}: Stepline does not serve this field of an image "
                          "edit", param=unknown[0], code="unsupported_parameter")
    image = form.get("image") or form.get("image[]")
    if image is None or "prompt" not in form:
        missing = "image" if image is None else "prompt"
        raise OpenAIError(400, f"{missing} is required", param=missing)
    _only_one(int(form["n"].text) if "n" in form else None, "image")
    text = {k: form[k].text for k in ("model", "size", "output_format") if k in form}
    try:
        body = ImageRequest.model_validate({"prompt": form["prompt"].text, **text})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise OpenAIError(400, f"{where}: {error['msg']}", param=where) from exc
    if body.model is not None:
        _require_kind(body.model, "image")
    params: dict[str, Any] = {"prompt": body.prompt, "seed": _seed(None), **_size(body.size),
                              "image": base64.b64encode(image.data).decode("ascii")}
    if "mask" in form:
        params["mask"] = base64.b64encode(form["mask"].data).decode("ascii")
    params.update({k: v for k, v in (("model", body.model),
                                     ("output_format", body.output_format)) if v is not None})
    return _job_spec(ctx, "image", options, params, _IMAGE_FIELDS)


def _image_item(ctx: ApiContext, record: JobRecord, response_format: str | None,
                request: Request) -> ImageData:
    assert record.artifact is not None
    if response_format == "b64_json":
        data = ctx.artifacts.read(record.artifact)
        return ImageData(b64_json=base64.b64encode(data).decode("ascii"))
    base = str(request.base_url).rstrip("/")
    return ImageData(url=f"{base}/v1/jobs/{record.job_id}/result")
