"""/v1/jobs and /v1/inference: submit, read, list, cancel, fetch results, infer and wait."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from app.api.context import ApiContext, api_context, current_tenant
from app.api.errors import JobUnfinished, ResultNotReady, TooManyRequests
from app.api.stats import readable_records
from app.schemas import (
    BatchEntry,
    BatchSubmit,
    BatchSubmitted,
    ErrorBody,
    InferenceMetrics,
    InferenceRequest,
    InferenceResponse,
    JobDetail,
    JobPage,
    JobSpec,
)
from app.tenants import Tenant
from scheduler.lifecycle import JobState, SloClass
from tasks.errors import InvalidJob, JobNotFound
from tasks.inputs import InputStore, store_inputs
from tasks.record import JobRecord, UnreadableRecord
from tasks.submit import Submitted

log = logging.getLogger(__name__)
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
MAX_PAGE = 500
"""Most jobs one GET /v1/jobs returns."""
_FILTER_FIELDS = ("tenant", "state", "slo")
SCAN_FIRST, SCAN_MAX = 128, 2048
"""A listing reads the index (and three fields of each job) 128 jobs first, then twice as many
each time, up to 2048 (round trips, not rows, are what a filter that matches little pays)."""
_CURSOR = re.compile(r"^(\d+(?:\.\d+)?(?:e[+-]?\d+)?),([0-9A-Za-z]{1,64})$")


def job_detail(record: JobRecord, origin_id: str | None) -> JobDetail:
    """A job as the REST API returns it, from its stored record."""
    r = record
    done = r.state is JobState.DONE
    return JobDetail(
        id=r.job_id, kind=r.kind.value, state=r.state, slo=r.slo, tenant=r.tenant,
        tier=r.tier.value, progress=r.next_chunk, total=r.num_chunks,
        submitted_at=r.submitted_at_s, deadline_at=r.deadline_at_s, started_at=r.started_at_s,
        finished_at=r.finished_at_s, queue=r.queue or None, epoch=r.epoch,
        preemptions=r.preemptions, origin=r.job_id == origin_id, error=r.error,
        artifact=r.artifact, media_type=r.media_type, params=dict(r.params),
        turnaround_s=r.latency_s,
        deadline_met=None if r.finished_at_s is None else (
            done and r.finished_at_s <= r.deadline_at_s),
        result_url=f"/v1/jobs/{r.job_id}/result" if done and r.artifact else None,
        degraded=None if r.degraded is None else json.loads(r.degraded),
    )


# submit ---------------------------------------------------------------------------------------
def submit_for(ctx: ApiContext, tenant: Tenant, spec: JobSpec) -> tuple[str, bool]:
    """The one submit path of the API: replay, rate limit, quota, dependencies, submit."""
    (outcome,) = submit_many_for(ctx, tenant, [spec])
    if outcome.shed is not None:
        raise outcome.shed
    assert outcome.job_id is not None
    return outcome.job_id, outcome.created


def submit_many_for(ctx: ApiContext, tenant: Tenant, specs: list[JobSpec]) -> list[Submitted]:
    """:func:`submit_for` of several jobs as one decision: replays answered first, then one
    take of the rate limit's tokens and one quota check for the rest (all pass, or none is
    stored), their dependencies, and one :meth:`JobService.submit_many`."""
    inputs = InputStore(ctx.artifacts)
    specs = [store_inputs(spec, inputs, ctx.settings.artifacts) for spec in specs]
    replays: dict[int, str] = {}
    for index, spec in enumerate(specs):
        if spec.idempotency_key and (
                existing := ctx.reads.replayed_job(tenant.name, spec.idempotency_key)):
            replays[index] = existing
    fresh = [spec for index, spec in enumerate(specs) if index not in replays]
    if fresh:
        _admit(ctx, tenant, len(fresh))
    for spec in fresh:
        for dep in spec.depends_on:
            _check_dependency(ctx, tenant, dep)
    stored = iter(ctx.service.submit_many(fresh, tenant=tenant.name, tier=tenant.tier)
                  if fresh else [])
    return [Submitted(replays[index]) if index in replays else next(stored)
            for index in range(len(specs))]


def _admit(ctx: ApiContext, tenant: Tenant, count: int) -> None:
    """Take ``count`` rate-limit tokens and check the queue quota, in one round trip; raises
    :class:`TooManyRequests` (or :class:`InvalidJob` for a batch no wait would let in)."""
    if count > tenant.burst:
        raise InvalidJob(f"a batch of {count} jobs is more than tenant {tenant.name!r}'s burst "
                         f"of {tenant.burst} submissions; send at most {tenant.burst} at once")
    wait_s, unfinished = ctx.limits.take_token_and_count(tenant, count)  # O(1)
    if wait_s > 0:
        raise TooManyRequests(
            f"tenant {tenant.name!r} is over its rate limit of {tenant.rate_limit_per_s:g} "
            f"submissions/s (burst {tenant.burst}); retry after {wait_s:.2f}s", wait_s)
    if unfinished + count > tenant.max_queued:
        what = "" if count == 1 else f" and this batch has {count}"
        raise TooManyRequests(
            f"tenant {tenant.name!r} has {unfinished} unfinished jobs{what}, its quota is "
            f"{tenant.max_queued}; wait for some to finish or cancel them", 1.0)


def _check_dependency(ctx: ApiContext, tenant: Tenant, dep: str) -> None:
    """A dependency must be one of the caller's jobs. An unreadable one still counts: the tick
    fails it, and the dependent job with it, which tells the caller more than a 500 here."""
    try:
        ctx.owned_record(tenant, dep)
    except JobNotFound as exc:
        raise InvalidJob(f"depends_on: no job {dep}") from exc
    except UnreadableRecord as exc:
        log.warning("dependency %s of a new job: %s", dep, exc)


@router.post(
    "/jobs", status_code=201, response_model=JobDetail,
    responses={200: {"model": JobDetail, "description": "Idempotency-key replay: the first job."},
               **COMMON_RESPONSES, **LIMITED_RESPONSES},
    summary="Submit a job of any kind",
)
def create_job(spec: JobSpec, ctx: Ctx, tenant: Caller, response: Response) -> JobDetail:
    job_id, created = submit_for(ctx, tenant, spec)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return job_detail(*ctx.reads.record_and_origin(job_id))


@router.post(
    "/jobs/batch", status_code=201, response_model=BatchSubmitted,
    responses={**COMMON_RESPONSES, **LIMITED_RESPONSES},
    summary="Submit many jobs in one request",
)
def create_jobs(body: BatchSubmit, ctx: Ctx, tenant: Caller) -> BatchSubmitted:
    """Every job is checked first: one bad job rejects the batch (422 naming ``jobs[i]``) and
    stores nothing; the rate limit takes one token per job and the quota counts them all, at
    once. Each entry of the answer is a stored job (``created`` false: an idempotency-key
    replay) or one admission shed under overload (``error``, ``retry_after_s``)."""
    outcomes = submit_many_for(ctx, tenant, body.jobs)
    return BatchSubmitted(jobs=[
        BatchEntry(id=o.job_id, created=o.created) if o.shed is None
        else BatchEntry(error=str(o.shed), retry_after_s=o.shed.retry_after_s)
        for o in outcomes])


# read -----------------------------------------------------------------------------------------
@router.get("/jobs/{job_id}", response_model=JobDetail, responses=COMMON_RESPONSES, summary="A job")
def get_job(job_id: JobId, ctx: Ctx, tenant: Caller) -> JobDetail:
    return job_detail(ctx.owned_record(tenant, job_id), ctx.reads.origin_id())


@router.delete("/jobs/{job_id}", response_model=JobDetail, responses=COMMON_RESPONSES,
               summary="Cancel a job (a running one stops at its next chunk boundary)")
def cancel_job(job_id: JobId, ctx: Ctx, tenant: Caller) -> JobDetail:
    ctx.owned_record(tenant, job_id)
    ctx.store.request_cancel(job_id)
    return job_detail(ctx.reads.record(job_id), ctx.reads.origin_id())


@router.get(
    "/jobs/{job_id}/result",
    responses={200: {"description": "The artifact (PNG, MP4, GIF, WebP or JSON).",
                     "content": {"image/png": {}, "video/mp4": {}, "image/gif": {},
                                 "image/webp": {}, "application/json": {}}},
               409: {"model": ErrorBody, "description": "The job is not DONE."},
               **COMMON_RESPONSES},
    response_class=FileResponse, summary="The job's artifact",
)
def get_result(job_id: JobId, ctx: Ctx, tenant: Caller) -> Response:
    record = ctx.owned_record(tenant, job_id)
    if record.state is not JobState.DONE:
        raise ResultNotReady(_not_ready_detail(record))
    if not record.artifact:
        raise JobNotFound(f"job {job_id} finished without an artifact")
    name, media_type = record.artifact, record.media_type or None
    try:
        if ctx.artifacts.local:  # a local file is sent as one (ranges, sendfile)
            path = ctx.artifacts.path(name)
            if not path.is_file():
                raise FileNotFoundError(name)
            return FileResponse(path, media_type=media_type, filename=name)
        body = ctx.artifacts.read(name)  # any API process serves any artifact of a shared store
    except FileNotFoundError:
        raise JobNotFound(f"the artifact of job {job_id} is missing from the artifact store "
                          f"{ctx.artifacts!r}") from None
    return Response(body, media_type=media_type,
                    headers={"content-disposition": f'attachment; filename="{name}"'})


def _not_ready_detail(r: JobRecord) -> str:
    """Why a job has no result yet, and whether waiting will help."""
    why = f": {r.error}" if r.error else ""
    hint = "it never will" if r.state.is_terminal else "retry once it is DONE"
    return (f"job {r.job_id} is {r.state.value} ({r.next_chunk}/{r.num_chunks} chunks)"
            f"{why}; the result exists only for DONE jobs, {hint}")


# list -----------------------------------------------------------------------------------------
class IndexScan:
    """(score, id) newest first from the index, strictly after a cursor, at most
    ``api.list_scan_limit`` of them, read in batches that double (a first page reads one, a
    filter that matches little reads the budget in a few round trips). :attr:`last` is the
    last entry handed out and :attr:`out_of_budget` whether the scan stopped at its budget with
    entries left: a listing then answers with a cursor there, and its next page goes on."""

    def __init__(self, ctx: ApiContext, cursor: tuple[float, str] | None) -> None:
        self.ctx, self.cursor = ctx, cursor
        self.last: tuple[float, str] | None = None
        self.out_of_budget = False

    def __iter__(self) -> Iterator[tuple[float, str]]:
        budget, batch = self.ctx.settings.api.list_scan_limit, SCAN_FIRST // 2
        after = self.cursor
        high = "+inf" if after is None else repr(after[0])
        while True:
            if budget <= 0:
                self.out_of_budget = True
                return
            batch = min(batch * 2, SCAN_MAX)
            rows = self.ctx.reads.index_before(high, min(batch, budget))
            fresh = list(rows)
            if after is not None:  # equal scores come in reverse member order
                fresh = [(s, m) for s, m in fresh if s < after[0] or m < after[1]]
            if not fresh:
                return
            for row in fresh:
                self.last = row
                yield row
            budget -= len(rows)
            after = fresh[-1]
            high = repr(after[0])
            if len(rows) < min(batch, budget + len(rows)):
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
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page size.")] = 50,
    offset: Annotated[int, Query(ge=0, le=100_000, description="Matching jobs to skip (a cursor "
                                 "is cheaper: it starts where the last page ended).")] = 0,
    cursor: Annotated[str | None, Query(max_length=100, description="next_cursor of the "
                                        "previous page (replaces offset).")] = None,
) -> JobPage:
    """One page costs O(limit) whole records plus, while filtering, three fields of each job of
    the index it passes over: at most ``api.list_scan_limit`` of them, whatever the backlog.
    A filter that matches little may answer a short page (even an empty one) with a
    ``next_cursor``: the scan's budget ran out there, and the next page goes on from it."""
    page: list[tuple[float, str]] = []
    scan = IndexScan(ctx, _parse_cursor(cursor))
    for skipped, row in enumerate(_matching(ctx, scan, tenant, state, slo)):
        if skipped >= offset:
            page.append(row)
            if len(page) == limit:
                break
    origin_id = ctx.reads.origin_id()
    by_id = {r.job_id: r for r in readable_records(ctx.reads, [i for _, i in page],
                                                   "GET /v1/jobs")}
    picked = [job_detail(r, origin_id) for _, job_id in page
              if (r := by_id.get(job_id)) is not None and _passes(r, state, slo)]
    resume = page[-1] if len(page) == limit else scan.last if scan.out_of_budget else None
    return JobPage(jobs=picked, limit=limit, offset=offset,
                   next_cursor=None if resume is None else f"{resume[0]!r},{resume[1]}")


def _matching(
    ctx: ApiContext, scan: IndexScan, tenant: Tenant,
    state: JobState | None, slo: SloClass | None,
) -> Iterator[tuple[float, str]]:
    """(score, id) of the caller's jobs that pass the filters, newest first, judged by three
    fields read in batches that double, as the index is (a page stops reading once it is
    full)."""
    rows = iter(scan)
    want = (tenant.name.encode(), state.value.encode() if state else None,
            slo.value.encode() if slo else None)
    size = SCAN_FIRST
    while batch := list(itertools.islice(rows, size)):
        size = min(size * 2, SCAN_MAX)
        for (score, job_id), (owner, at, of) in zip(
                batch, ctx.reads.fields([i for _, i in batch], _FILTER_FIELDS), strict=True):
            if owner == want[0] and want[1] in (None, at) and want[2] in (None, of):
                yield score, job_id


def _passes(r: JobRecord, state: JobState | None, slo: SloClass | None) -> bool:
    return (state is None or r.state is state) and (slo is None or r.slo is slo)


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
    record = await _await_end(ctx, job_id)
    return await run_in_threadpool(_inference_answer, ctx, record)


async def _await_end(ctx: ApiContext, job_id: str) -> JobRecord:
    """Poll the job until it ends or its deadline (plus grace) passes."""
    record = await run_in_threadpool(ctx.reads.record, job_id)
    give_up_at = record.deadline_at_s + ctx.settings.api.inference_grace
    while not record.state.is_terminal:
        if time.time() >= give_up_at:
            raise JobUnfinished(
                f"job {job_id} did not finish by its deadline ({record.state.value}, "
                f"{record.next_chunk}/{record.num_chunks} chunks); it keeps running: "
                f"poll /v1/jobs/{job_id}", job_id, 504)
        await asyncio.sleep(ctx.settings.api.poll_interval)
        record = await run_in_threadpool(ctx.reads.record, job_id)
    return record


def _inference_answer(ctx: ApiContext, record: JobRecord) -> InferenceResponse:
    job_id, state = record.job_id, record.state
    if state is JobState.FAILED:
        raise JobUnfinished(f"job {job_id} failed: {record.error or ''}", job_id, 502)
    if state is JobState.CANCELLED:
        raise JobUnfinished(f"job {job_id} was cancelled", job_id, 409)
    if state is JobState.EXPIRED:
        raise JobUnfinished(f"job {job_id} was shed: it could not meet its deadline", job_id, 504)
    if not record.artifact:
        raise JobNotFound(f"job {job_id} finished without an artifact")
    body = json.loads(ctx.artifacts.read(record.artifact))
    return InferenceResponse(output=str(body.get("output", "")),
                             metrics=InferenceMetrics.model_validate(body.get("metrics") or {}),
                             job_id=job_id)
