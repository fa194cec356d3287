"""The batch task: several jobs' next chunks as one batched forward, each job fenced on its own.

A batch message is ``(batch_id, [[job_id, chunk, epoch], ...])``. The worker takes the jobs the
tick released into the batch since its last step (so they run in this very step), claims every
job separately — a job whose claim fails (stale epoch, moved, ended) simply drops out — runs the
claimed chunks through the runner's ``run_batch``, commits each job separately, and publishes
the next step of the jobs that hop, one message per queue. A job flagged for preemption,
finished, cancelled or moved to another queue leaves at that step boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis
from celery import shared_task
from pydantic import BaseModel, Field, ValidationError, field_validator

from scheduler.batching import batch_cost_key
from scheduler.cost import chunk_cost_key
from scheduler.lifecycle import JobState
from scheduler.model import JobKind
from tasks.chunks import (
    Cursor,
    JobId,
    commit_request,
    commit_result,
    load_state,
    lost_successor,
    record_text_outcome,
    stop_attempt,
)
from tasks.context import WorkerContext, worker_context
from tasks.dispatch import BatchMember, new_batch_id, publish_batch
from tasks.record import JobRecord
from tasks.routing import BATCH_TASK
from tasks.store import CommitStatus
from workers.checkpoint import Checkpoint
from workers.runner import BatchItem, ChunkResult, JobRunner

log = logging.getLogger(__name__)

class BatchMessage(BaseModel):
    """The arguments of a batch task; anything else on a queue is rejected and logged."""

    batch_id: str = Field(pattern=r"^[0-9a-f]{16}\.[0-9a-f]{1,16}$")
    members: list[tuple[JobId, Cursor, Cursor]] = Field(min_length=1, max_length=256)

    @field_validator("members")
    @classmethod
    def _each_job_once(cls, members: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        if len({job_id for job_id, _, _ in members}) != len(members):
            raise ValueError("a job appears twice in one batch")
        return members


@shared_task(name=BATCH_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_batch(self: Any, batch_id: Any, members: Any, **info: Any) -> str:
    """Celery entry point (``info`` carries the lead's chunk name, class, kind and the size)."""
    try:
        message = BatchMessage(batch_id=batch_id, members=members)
    except ValidationError as exc:
        log.error("rejected malformed batch message %r: %s", (batch_id, members), exc)
        return "rejected"
    ctx = worker_context()
    ctx.name = self.request.hostname or ctx.name
    return execute_batch(ctx, message.batch_id, message.members, self.request.id or "")


def execute_batch(ctx: WorkerContext, batch_id: str, members: Sequence[BatchMember],
                  task_id: str = "") -> str:
    """Run one step of the batch; returns what happened, for logs and tests."""
    store, lease_s = ctx.store, ctx.settings.broker.chunk_lease
    started = time.perf_counter()
    claimed, joiners, blobs = store.claim_chunks(members, ctx.name, lease_s,
                                                 take_joiners_of=batch_id,
                                                 cached_seqs=_held(ctx, members))
    named = {job_id for job_id, _, _ in members}
    joiners = [m for m in joiners if m[0] not in named]
    if joiners:  # released into the batch since its last step: they run in this one
        more, _, more_blobs = store.claim_chunks(joiners, ctx.name, lease_s,
                                                 cached_seqs=_held(ctx, joiners))
        claimed += more
        blobs.update(more_blobs)
    wanted = [*members, *joiners]
    ctx.profile.add("claim", started)
    jobs: list[JobRecord] = []
    lost: dict[str, list[BatchMember]] = {}
    for (job_id, chunk, epoch), got in zip(wanted, claimed, strict=True):
        if isinstance(got, str):
            log.info("job %s chunk %d epoch %d (batch %s): stale (%s)", job_id, chunk, epoch,
                     batch_id, got)
            if (job := lost_successor(store, job_id, chunk, epoch)) is not None:
                lost.setdefault(job.queue, []).append((job_id, job.next_chunk, epoch))
        elif _runnable(ctx, got):
            jobs.append(got)
    for queue, members_lost in lost.items():  # a worker died between commit and publish:
        lead = store.record(members_lost[0][0])  # the batch goes on together
        publish_batch(store, new_batch_id(lead.job_id), lead, members_lost, queue=queue,
                      lease_s=lease_s)
    if not jobs:  # nothing left: close it (joiners that came meanwhile go on by themselves)
        _publish_hops(ctx, batch_id, None, {}, [])
        return "stale"
    # One canonical order: a batched step's numbers depend only on which jobs ran in it, so a
    # batch schedule (who ran with whom, step by step) replays to the same outputs anywhere.
    jobs.sort(key=lambda job: job.job_id)
    ctx.busy_job, ctx.batch_jobs = jobs[0].job_id, tuple(j.job_id for j in jobs[1:])
    try:
        return _run_claimed(ctx, batch_id, jobs, task_id, blobs)
    finally:
        ctx.busy_job, ctx.batch_jobs = None, ()
        if ctx.runner_loaded("text"):
            ctx.refresh_residency()


def _held(ctx: WorkerContext, members: Sequence[BatchMember]) -> dict[str, int]:
    """The sequence number of each member's state this worker holds in memory (the claim
    brings the durable checkpoint of the others)."""
    return {job_id: seq for job_id, _, _ in members
            if (seq := ctx.cache.seq_of(job_id)) is not None}


def _runnable(ctx: WorkerContext, job: JobRecord) -> bool:
    """A claimed job with a flag raised stops here, having run nothing."""
    if job.cancel:
        stop_attempt(ctx.store, job, JobState.CANCELLED, ctx.name, "cancelled by client")
        return False
    if job.preempt:
        stop_attempt(ctx.store, job, JobState.PREEMPTED, ctx.name, "preempt flag")
        return False
    return True


class _Member:
    """One claimed job inside the step: its record, parameters and state."""

    def __init__(self, job: JobRecord, params: dict[str, Any], state: Checkpoint | None,
                 version: str | None) -> None:
        self.job, self.params, self.state, self.version = job, params, state, version
        self.result: ChunkResult | None = None
        self.error: str | None = None


def _run_claimed(ctx: WorkerContext, batch_id: str, jobs: list[JobRecord], task_id: str,
                 blobs: dict[str, bytes]) -> str:
    kind = jobs[0].kind
    runner = ctx.runner(kind.value)
    loading = time.perf_counter()
    members = [m for job in jobs
               if (m := _prepare(ctx, runner, job, blobs.get(job.job_id))) is not None]
    ctx.profile.add("load_state", loading)
    started = time.monotonic()
    _run_step(runner, members)
    elapsed_s = time.monotonic() - started
    return _commit_and_hop(ctx, batch_id, members, elapsed_s, task_id)


def _prepare(ctx: WorkerContext, runner: JobRunner, job: JobRecord,
             blob: bytes | None) -> _Member | None:
    """The job's state (``blob``: its durable checkpoint, when the claim brought it) and
    parameters (a text job's expert version chosen); a job whose state cannot be loaded fails
    alone."""
    params = dict(job.params)
    try:
        state = load_state(ctx, job, runner, params, blob)
        version = None
        if job.kind is JobKind.TEXT:
            from tasks.experts import choose_version  # loads transformers: text jobs only

            version = choose_version(ctx.store, ctx.settings, ctx.text_runner(), job, params,
                                     state)
            params["expert_version"] = version
    except redis.RedisError:
        raise
    except Exception as exc:
        log.exception("job %s: could not load its state for chunk %d", job.job_id,
                      job.next_chunk)
        stop_attempt(ctx.store, job, JobState.FAILED, ctx.name,
                     f"chunk {job.next_chunk}: {exc}"[:500])
        return None
    return _Member(job, params, state, version)


def _run_step(runner: JobRunner, members: list[_Member]) -> None:
    """Every member's chunk, batched where the runner can; if the batched run fails, each
    member runs alone, so one bad job fails alone."""
    run_batch = getattr(runner, "run_batch", None)
    if run_batch is not None and len(members) > 1:
        items = [BatchItem(m.params, m.job.next_chunk, m.state) for m in members]
        try:
            for member, result in zip(members, run_batch(items), strict=True):
                member.result = result
            return
        except redis.RedisError:
            raise
        except Exception:
            log.warning("batched step of %s failed; running each job alone",
                        ",".join(m.job.job_id for m in members), exc_info=True)
    for m in members:
        try:
            m.result = runner.run_chunk(m.params, m.job.next_chunk, m.state, lambda: False)
            m.result.metrics.setdefault("batch_size", 1)
        except redis.RedisError:
            raise
        except Exception as exc:
            log.exception("job %s chunk %d failed", m.job.job_id, m.job.next_chunk)
            m.error = f"chunk {m.job.next_chunk}: {exc}"[:500]


def _commit_and_hop(ctx: WorkerContext, batch_id: str, members: list[_Member],
                    elapsed_s: float, task_id: str) -> str:
    """Commit each job on its own (all in one round trip), then publish the next step of those
    that hop."""
    store = ctx.store
    outcomes: list[str] = []
    ran: list[_Member] = []
    for m in members:
        if m.result is None:
            record_text_outcome(ctx, m.job, m.version, None)
            outcomes.append(stop_attempt(store, m.job, JobState.FAILED, ctx.name,
                                         m.error or f"chunk {m.job.next_chunk}: no result"))
        else:
            ran.append(m)
    total_units = sum(m.job.cost_units[m.job.next_chunk] for m in ran) or 1.0
    requests = []
    for m in ran:
        assert m.result is not None
        # a batched chunk teaches the batched key below, never the lone step's
        requests.append(commit_request(
            ctx, m.job, m.job.next_chunk, m.job.seq, m.result,
            elapsed_s * m.job.cost_units[m.job.next_chunk] / total_units,  # its share
            task_id, learn=_size(m) == 1, push_next=False))
    committing = time.perf_counter()
    commits, joiners = store.commit_chunks(requests, take_joiners_of=batch_id,
                                           lease_s=ctx.settings.broker.chunk_lease,
                                           timing=_batch_timing(ctx, ran, elapsed_s))
    ctx.profile.add("commit", committing)
    hops: dict[str, list[BatchMember]] = {}
    for m, request, commit in zip(ran, requests, commits, strict=True):
        job = m.job
        assert m.result is not None
        if job.next_chunk > 0:
            record_text_outcome(ctx, job, m.version, m.result)
        if commit.status is CommitStatus.NEEDS_CHECKPOINT:  # stopped here: write one
            commit = commit_result(ctx, job, job.next_chunk, job.seq, m.result,
                                   request.service_s, task_id, learn=_size(m) == 1,
                                   push_next=False)
        ctx.chunks_run += 1
        outcomes.append(commit.status.value)
        if commit.status is CommitStatus.HOP:
            ctx.cache.put(job.job_id, commit.seq, m.result.state)
            hops.setdefault(commit.queue, []).append((job.job_id, commit.next_chunk, job.epoch))
        elif commit.status is not CommitStatus.STALE:
            ctx.cache.drop(job.job_id)  # done, or stopped: another worker may resume it
    _publish_hops(ctx, batch_id, members[0].job, hops, joiners)
    return ",".join(outcomes)


def _size(m: _Member) -> int:
    return int(m.result.metrics.get("batch_size", 1)) if m.result is not None else 1


def _batch_timing(ctx: WorkerContext, ran: list[_Member],
                  elapsed_s: float) -> tuple[str, str, float] | None:
    """The cost model's sample of a batched step — (its key, the device, seconds per cost
    unit of one member) — when the whole task was one forward of every member of one chunk
    kind (the steady state of a batch); the lone chunk kind's key is measured by lone steps
    only, so the two give the growth (``scheduler.batching.learned_growth``)."""
    if len(ran) < 2 or any(_size(m) != len(ran) or not m.result or not m.result.complete
                           for m in ran):
        return None
    kinds = {chunk_cost_key(m.job.cost_key, m.job.chunk_name) for m in ran}
    units = {m.job.cost_units[m.job.next_chunk] for m in ran}
    if len(kinds) != 1 or len(units) != 1 or min(units) <= 0:
        return None
    return (batch_cost_key(kinds.pop(), len(ran)), ctx.settings.device,
            elapsed_s / units.pop())


def _publish_hops(ctx: WorkerContext, batch_id: str, lead: JobRecord | None,
                  hops: dict[str, list[BatchMember]], joiners: list[BatchMember]) -> None:
    """The batch goes on as one message per queue (the largest keeps its id), with the jobs
    the tick released into it meanwhile (``joiners``, taken with the commits); with no job
    left it closes, and its joiners go out as a batch of their own."""
    store, lease_s = ctx.store, ctx.settings.broker.chunk_lease
    if not hops:
        joiners = [*joiners, *store.take_joiners(batch_id, keep=False, lease_s=lease_s)]
        if joiners:  # the batch ended as they joined: they go on together, on their queue
            first = store.record(joiners[0][0])
            publish_batch(store, new_batch_id(first.job_id), first, joiners, queue=first.queue,
                          lease_s=lease_s)
        return
    assert lead is not None
    ordered = sorted(hops.items(), key=lambda item: -len(item[1]))
    for n, (queue, group) in enumerate(ordered):
        if n == 0:
            hopping = {job_id for job_id, _, _ in group}
            group = [*group, *(j for j in joiners if j[0] not in hopping)]
            publish_batch(store, batch_id, lead, group, queue=queue, profile=ctx.profile,
                          lease_s=lease_s, mark_open=False)
        else:
            publish_batch(store, new_batch_id(group[0][0]), lead, group, queue=queue,
                          lease_s=lease_s)
