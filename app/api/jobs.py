"""/v1/jobs and /v1/inference: submit, read, list, cancel, fetch results, infer and wait."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from app.api.context import ApiContext, api_context, current_tenant
from app.api.errors import JobUnfinished, ResultNotReady, TooManyRequests
from app.errors import InvalidJob, JobNotFound
from app.schemas import (
    ErrorBody,
    InferenceMetrics,
    InferenceRequest,
    InferenceResponse,
    JobPage,
    JobSpec,
    JobView,
)
from app.store import INDEX_KEY, PREFIX, record_from_fields
from app.tenants import Tenant
from scheduler.lifecycle import JobState, SloClass
from workers.errors import WorkerError

router = APIRouter(prefix="/v1", tags=["jobs"])
Ctx = Annotated[ApiContext, Depends(api_context)]
Caller = Annotated[Tenant, Depends(current_tenant)]
JobId = Annotated[str, Path(min_length=1, max_length=64, description="The job id.")]

COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or unknown API key."},
    404: {"model": ErrorBody, "description": "No such job (for this tenant)."},
    422: {"model": ErrorBody, "description": "The request is invalid; detail says why."},
    503: {"model": ErrorBody,
          "description": "Redis is unavailable, or the job was shed under overload; see "
                         "Retry-After."},
}
LIMITED_RESPONSES: dict[int | str, dict[str, Any]] = {
    429: {"model": ErrorBody, "description": "Rate limit or queue quota; see Retry-After."},
}
_CURSOR = re.compile(r"^(\d+(?:\.\d+)?(?:e[+-]?\d+)?),([0-9A-Za-z]{1,64})$")


def job_view(fields: dict[str, str], origin_id: str | None) -> JobView:
    record = record_from_fields(fields, origin_id)
    done = record.state is JobState.DONE
    return JobView(
        **record.model_dump(),
        turnaround_s=record.latency_s,
        deadline_met=None if record.finished_at is None else (
            done and record.finished_at <= record.deadline_at),
        result_url=f"/v1/jobs/{record.id}/result" if done and record.artifact else None,
    )


# submit ---------------------------------------------------------------------------------------
def submit_for(ctx: ApiContext, tenant: Tenant, spec: JobSpec) -> tuple[str, bool]:
    """The one submit path of the API: replay, rate limit, quota, dependencies, submit."""
    if spec.idempotency_key:
        raw = ctx.store.redis.get(f"{PREFIX}idem:{tenant.name}:{spec.idempotency_key}")
        existing = cast(bytes, raw).decode() if raw is not None else None
        if existing is not None and ctx.store.redis.exists(ctx.store.job_key(existing)):
            return existing, False
    wait_s = ctx.limits.take_token(tenant)
    if wait_s > 0:
        raise TooManyRequests(
            f"tenant {tenant.name!r} is over its rate limit of {tenant.rate_limit_per_s:g} "
            f"submissions/s (burst {tenant.burst}); retry after {wait_s:.2f}s", wait_s)
    unfinished = ctx.limits.unfinished(tenant)
    if unfinished >= tenant.max_queued:
        raise TooManyRequests(
            f"tenant {tenant.name!r} has {unfinished} unfinished jobs, its quota is "
            f"{tenant.max_queued}; wait for some to finish or cancel them", 1.0)
    for dep in spec.depends_on:
        try:
            ctx.owned_fields(tenant, dep)
        except JobNotFound as exc:
            raise InvalidJob(f"depends_on: no job {dep}") from exc
    try:
        job_id, created = ctx.service.submit(spec, tenant=tenant.name, tier=tenant.tier)
    except WorkerError as exc:
        raise InvalidJob(f"invalid {spec.kind} job: {exc}") from exc
    if created:
        ctx.limits.track(tenant, job_id)
    return job_id, created


@router.post(
    "/jobs", status_code=201, response_model=JobView,
    responses={200: {"model": JobView, "description": "Idempotency-key replay: the first job."},
               **COMMON_RESPONSES, **LIMITED_RESPONSES},
    summary="Submit a job of any kind",
)
def create_job(spec: JobSpec, ctx: Ctx, tenant: Caller, response: Response) -> JobView:
    job_id, created = submit_for(ctx, tenant, spec)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return job_view(ctx.store.fields(job_id), ctx.store.origin_id())


# read -----------------------------------------------------------------------------------------
@router.get("/jobs/{job_id}", response_model=JobView, responses=COMMON_RESPONSES, summary="A job")
def get_job(job_id: JobId, ctx: Ctx, tenant: Caller) -> JobView:
    return job_view(ctx.owned_fields(tenant, job_id), ctx.store.origin_id())


@router.delete("/jobs/{job_id}", response_model=JobView, responses=COMMON_RESPONSES,
               summary="Cancel a job (a running one stops at its next chunk boundary)")
def cancel_job(job_id: JobId, ctx: Ctx, tenant: Caller) -> JobView:
    ctx.owned_fields(tenant, job_id)
    ctx.store.request_cancel(job_id)
    return job_view(ctx.store.fields(job_id), ctx.store.origin_id())


@router.get(
    "/jobs/{job_id}/result",
    responses={200: {"description": "The artifact (PNG, MP4, GIF, WebP or JSON).",
                     "content": {"image/png": {}, "video/mp4": {}, "image/gif": {},
                                 "image/webp": {}, "application/json": {}}},
               409: {"model": ErrorBody, "description": "The job is not DONE."},
               **COMMON_RESPONSES},
    response_class=FileResponse, summary="The job's artifact",
)
def get_result(job_id: JobId, ctx: Ctx, tenant: Caller) -> FileResponse:
    fields = ctx.owned_fields(tenant, job_id)
    state = fields["state"]
    if state != JobState.DONE.value:
        why = f": {fields['error']}" if fields.get("error") else ""
        hint = "it never will" if JobState(state).is_terminal else "retry once it is DONE"
        raise ResultNotReady(
            f"job {job_id} is {state} ({fields['next_chunk']}/{fields['num_chunks']} chunks)"
            f"{why}; the result exists only for DONE jobs, {hint}")
    if not fields.get("artifact"):
        raise JobNotFound(f"job {job_id} finished without an artifact")
    path = ctx.artifacts.path(fields["artifact"])
    if not path.is_file():
        raise JobNotFound(f"the artifact of job {job_id} is missing from the artifact store")
    return FileResponse(path, media_type=fields.get("media_type") or None, filename=path.name)


# list -----------------------------------------------------------------------------------------
def _scan(ctx: ApiContext, cursor: tuple[float, str] | None) -> Iterator[tuple[float, str]]:
    """(score, id) newest first from the index, strictly after ``cursor``, at most
    ``api.list_scan_limit`` of them."""
    budget, batch = ctx.settings.api.list_scan_limit, 256
    high = "+inf" if cursor is None else repr(cursor[0])
    after = cursor
    while budget > 0:
        rows = cast(list[tuple[bytes, float]], ctx.store.redis.zrevrangebyscore(
            INDEX_KEY, high, "-inf", start=0, num=min(batch, budget), withscores=True))
        fresh = [(score, member.decode()) for member, score in rows]
        if after is not None:  # equal scores come in reverse member order
            fresh = [(s, m) for s, m in fresh if s < after[0] or m < after[1]]
        if not fresh:
            return
        yield from fresh
        budget -= len(rows)
        after = fresh[-1]
        high = repr(after[0])
        if len(rows) < batch:
            return


def _parse_cursor(cursor: str | None) -> tuple[float, str] | None:
    if cursor is None:
        return None
    match = _CURSOR.match(cursor)
    if match is None:
        raise InvalidJob(f"cursor {cursor!r} is not one this API returned (next_cursor)")
    return float(match.group(1)), match.group(2)


@router.get("/jobs", response_model=JobPage, responses=COMMON_RESPONSES,
            summary="The caller's jobs, newest first, filtered and paginated")
def list_jobs(
    ctx: Ctx, tenant: Caller,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    slo: Annotated[SloClass | None, Query(alias="class", description="Only this class.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=100_000)] = 0,
    cursor: Annotated[str | None, Query(max_length=100, description="next_cursor of the "
                                        "previous page (replaces offset).")] = None,
) -> JobPage:
    start = _parse_cursor(cursor)
    origin_id = ctx.store.origin_id()
    picked: list[JobView] = []
    skipped, last = 0, None
    batch: list[tuple[float, str]] = []
    rows = _scan(ctx, start)
    while len(picked) < limit:
        batch = [row for _, row in zip(range(128), rows, strict=False)]
        if not batch:
            break
        by_id = {f["id"]: f for f in ctx.store.many_fields([i for _, i in batch])}
        for score, job_id in batch:
            f = by_id.get(job_id)
            if f is None or f.get("tenant") != tenant.name:
                continue
            if (state and f["state"] != state.value) or (slo and f["slo"] != slo.value):
                continue
            if skipped < offset:
                skipped += 1
                continue
            picked.append(job_view(f, origin_id))
            last = (score, job_id)
            if len(picked) == limit:
                break
    more = len(picked) == limit and last is not None
    return JobPage(jobs=picked, limit=limit, offset=offset,
                   next_cursor=f"{last[0]!r},{last[1]}" if more and last else None)


# inference ------------------------------------------------------------------------------------
@router.post(
    "/inference", response_model=InferenceResponse,
    responses={**COMMON_RESPONSES, **LIMITED_RESPONSES,
               409: {"model": ErrorBody, "description": "The job was cancelled."},
               502: {"model": ErrorBody, "description": "The job failed on its worker."},
               504: {"model": ErrorBody,
                     "description": "Not finished by its deadline; detail has the job id."}},
    summary="Text in, text out: a text job in the realtime or interactive class, awaited",
)
async def infer(body: InferenceRequest, ctx: Ctx, tenant: Caller) -> InferenceResponse:
    slo = body.slo or ctx.settings.api.inference_slo
    try:
        spec = JobSpec(kind="text", slo=SloClass(slo), params={**body.params,
                                                               "inputs": body.inputs})
    except ValueError as exc:
        raise InvalidJob(str(exc)) from exc
    job_id, _ = await run_in_threadpool(submit_for, ctx, tenant, spec)
    fields = await _await_end(ctx, job_id)
    return await run_in_threadpool(_inference_answer, ctx, fields)


async def _await_end(ctx: ApiContext, job_id: str) -> dict[str, str]:
    """Poll the job until it ends or its deadline (plus grace) passes."""
    fields = await run_in_threadpool(ctx.store.fields, job_id)
    give_up_at = float(fields["deadline_at"]) + ctx.settings.api.inference_grace
    while not JobState(fields["state"]).is_terminal:
        if time.time() >= give_up_at:
            raise JobUnfinished(
                f"job {job_id} did not finish by its deadline ({fields['state']}, "
                f"{fields['next_chunk']}/{fields['num_chunks']} chunks); it keeps running: "
                f"poll /v1/jobs/{job_id}", job_id, 504)
        await asyncio.sleep(ctx.settings.api.poll_interval)
        fields = await run_in_threadpool(ctx.store.fields, job_id)
    return fields


def _inference_answer(ctx: ApiContext, fields: dict[str, str]) -> InferenceResponse:
    job_id, state = fields["id"], fields["state"]
    if state == JobState.FAILED.value:
        raise JobUnfinished(f"job {job_id} failed: {fields.get('error', '')}", job_id, 502)
    if state == JobState.CANCELLED.value:
        raise JobUnfinished(f"job {job_id} was cancelled", job_id, 409)
    if state == JobState.EXPIRED.value:
        raise JobUnfinished(f"job {job_id} was shed: it could not meet its deadline", job_id, 504)
    body = json.loads(ctx.artifacts.read(fields["artifact"]))
    return InferenceResponse(output=str(body.get("output", "")),
                             metrics=InferenceMetrics.model_validate(body.get("metrics") or {}),
                             job_id=job_id)
