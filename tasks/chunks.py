"""The chunk task: fence the message, run one chunk of a job, commit, then hop or stop.

A chunk message is ``(job_id, chunk, epoch)``. It runs only if the job's epoch and cursor match
(a stale or duplicated message does nothing), and its result lands only through a compare-and-set
on the job's sequence number, so at-least-once delivery never applies a chunk twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

import redis
from celery import shared_task
from pydantic import BaseModel, Field, ValidationError

from scheduler.cost import chunk_cost_key
from scheduler.lifecycle import JobState
from scheduler.model import JobKind
from tasks.affinity import hop_queues
from tasks.context import WorkerContext, worker_context
from tasks.dispatch import direct_publish, next_chunk_message, publish_chunk
from tasks.record import JobRecord, encode
from tasks.routing import CHUNK_TASK
from tasks.store import (
    ClaimRequest,
    Commit,
    CommitRequest,
    CommitStatus,
    JobStore,
    NextMessage,
)
from workers.checkpoint import Checkpoint
from workers.errors import CheckpointError
from workers.runner import ChunkResult, JobRunner

log = logging.getLogger(__name__)


JobId = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
Cursor = Annotated[int, Field(ge=0)]
"""A chunk index or an epoch in a message."""


class ChunkMessage(BaseModel):
    """The arguments of a chunk task; anything else on a queue is rejected and logged."""

    job_id: JobId
    chunk: Cursor
    epoch: Cursor


@shared_task(name=CHUNK_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_chunk(self: Any, job_id: Any, chunk: Any, epoch: Any, **info: Any) -> str:
    """Celery entry point (``info`` carries chunk name, class and kind for Flower)."""
    try:
        message = ChunkMessage(job_id=job_id, chunk=chunk, epoch=epoch)
    except ValidationError as exc:
        log.error("rejected malformed chunk message %r: %s", (job_id, chunk, epoch), exc)
        return "rejected"
    ctx = worker_context()
    ctx.name = self.request.hostname or ctx.name
    return execute_chunk(ctx, message.job_id, message.chunk, message.epoch, self.request.id or "")


def execute_chunk(
    ctx: WorkerContext, job_id: str, chunk: int, epoch: int, task_id: str = ""
) -> str:
    """Run chunks of one job starting at ``chunk``; returns what happened, for logs and tests."""
    store = ctx.store
    started = time.perf_counter()
    held = ctx.cache.seq_of(job_id)
    claimed, blob = store.claim(ClaimRequest(job_id, chunk, epoch, ctx.name,
                                             ctx.settings.broker.chunk_lease,
                                             cached_seq=-1 if held is None else held))
    ctx.profile.add("claim", started)
    if isinstance(claimed, str):
        log.info("job %s chunk %d epoch %d: stale (%s)", job_id, chunk, epoch, claimed)
        republish_if_lost(store, job_id, chunk, epoch)
        return "stale"
    ctx.busy_job = job_id
    try:
        return _run_claimed(ctx, claimed, task_id, blob)
    finally:
        ctx.busy_job = None
        if ctx.runner_loaded("text"):
            ctx.refresh_residency()


def _run_claimed(ctx: WorkerContext, job: JobRecord, task_id: str,
                 blob: bytes | None = None) -> str:
    """Run the claimed job's chunks: one, then a hop, or all of them for an atomic job;
    ``blob`` is the durable checkpoint the claim brought, if the worker did not hold it."""
    store, job_id, chunk, seq = ctx.store, job.job_id, job.next_chunk, job.seq
    if job.cancel:
        return stop_attempt(store, job, JobState.CANCELLED, ctx.name, "cancelled by client")
    if job.preempt:
        return stop_attempt(store, job, JobState.PREEMPTED, ctx.name, "preempt flag")
    runner = ctx.runner(job.kind.value)
    params = dict(job.params)
    loading = time.perf_counter()
    state = load_state(ctx, job, runner, params, blob)
    ctx.profile.add("load_state", loading)
    version = None
    while True:
        started = time.monotonic()
        try:
            if job.kind is JobKind.TEXT and version is None:
                from tasks.experts import choose_version  # loads transformers: text jobs only

                version = choose_version(store, ctx.settings, ctx.text_runner(), job, params,
                                         state)
                params = {**params, "expert_version": version}
            result = runner.run_chunk(params, chunk, state, _flag_poll(ctx, job_id))
        except redis.RedisError:
            raise  # the store went away, not the job: leave it RUNNING for the lease watchdog
        except Exception as exc:
            log.exception("job %s chunk %d failed", job_id, chunk)
            record_text_outcome(ctx, job, version, None)
            return stop_attempt(store, job, JobState.FAILED, ctx.name,
                                f"chunk {chunk}: {exc}"[:500])
        elapsed_s = time.monotonic() - started
        if chunk > 0:
            record_text_outcome(ctx, job, version, result)
        commit = commit_result(ctx, job, chunk, seq, result, elapsed_s, task_id)
        if commit.status is CommitStatus.STALE:
            log.warning("job %s chunk %d: another delivery committed it first", job_id, chunk)
            return "duplicate"
        ctx.chunks_run += 1
        if commit.status is CommitStatus.HOP:
            ctx.cache.put(job_id, commit.seq, result.state)
            if commit.published is None:  # the commit did not push the message: send it
                publish_chunk(store, job, chunk=commit.next_chunk, epoch=job.epoch,
                              queue=commit.queue, profile=ctx.profile)
            return "hop"
        if commit.status is not CommitStatus.CONTINUE:
            ctx.cache.drop(job_id)  # done, or stopped: another worker may resume it
            return commit.status.value
        chunk, seq, state = commit.next_chunk, commit.seq, result.state


def commit_result(
    ctx: WorkerContext, job: JobRecord, chunk: int, seq: int, result: ChunkResult,
    elapsed_s: float, task_id: str, learn: bool = True, push_next: bool = True,
) -> Commit:
    """Commit one chunk and take the job's next step. The durable checkpoint is written every
    ``checkpoint_every`` chunks, and always when the job stops here (the store asks for it).
    ``elapsed_s`` is the worker time charged to the job, and what the cost model learns from
    unless ``learn`` is off (a batched chunk teaches the batched step's key instead)."""
    request = commit_request(ctx, job, chunk, seq, result, elapsed_s, task_id, learn, push_next)
    while True:
        committing = time.perf_counter()
        commit = ctx.store.commit(request)
        ctx.profile.add("commit", committing)
        if commit.status is not CommitStatus.NEEDS_CHECKPOINT:
            return commit
        if request.checkpoint is not None:
            raise AssertionError("a commit with a checkpoint never asks for one")
        request = request.with_checkpoint(_encode(ctx, result))


def commit_request(
    ctx: WorkerContext, job: JobRecord, chunk: int, seq: int, result: ChunkResult,
    elapsed_s: float, task_id: str, learn: bool = True, push_next: bool = True,
) -> CommitRequest:
    """The job's commit (:meth:`JobStore.commit`, see :func:`commit_result`):
    the artifact stored, the checkpoint encoded when this commit writes one; no timing for the
    cost model unless ``learn``; the next chunk's message when the commit may hop the job and
    push it (:func:`pushes_next_message`), unless ``push_next`` is off (the caller publishes:
    a batch's hops are batch messages)."""
    last = result.complete and chunk + 1 == job.num_chunks
    every = ctx.settings.diffusion.checkpoint_every
    durable = not result.complete or (not last and (chunk + 1) % every == 0)
    artifact = None
    if last and result.artifact is not None:  # stored first: the commit that ends the job names it
        artifact = (ctx.artifacts.put(job.job_id, result.artifact), result.artifact.media_type)
    units = job.cost_units[chunk]
    timing = (ctx.settings.device, elapsed_s / max(units, 1e-9)) \
        if result.complete and learn else None
    return CommitRequest(
        job.job_id, chunk=chunk, epoch=job.epoch, seq=seq, complete=result.complete,
        checkpoint=_encode(ctx, result) if durable else None,
        service_s=elapsed_s, worker=ctx.name, task_id=task_id,
        hop_queues=hop_queues(ctx.settings, ctx.name, ctx.consuming(), job.kind.value),
        then_continue=job.atomic, artifact=artifact, timing=timing,
        timing_key=chunk_cost_key(job.cost_key, job.chunk_name),
        next_message=_next_message(ctx, job, chunk + 1)
        if push_next and result.complete and not last and pushes_next_message(ctx, job)
        else None,
    )


def pushes_next_message(ctx: WorkerContext, job: JobRecord) -> bool:
    """Whether the commit of ``job``'s chunk pushes its next chunk's message itself
    (:func:`~tasks.dispatch.direct_publish`): a job on the chunk task that hops (not an atomic
    one, not a batchable one, whose hops are batch messages)."""
    return direct_publish(ctx.settings) and not job.atomic and job.batch_group is None


def _next_message(ctx: WorkerContext, job: JobRecord, chunk: int) -> NextMessage:
    building = time.perf_counter()
    message = next_chunk_message(job, chunk, job.epoch)
    ctx.profile.add("message", building)
    return message


def _encode(ctx: WorkerContext, result: ChunkResult) -> bytes:
    encoding = time.perf_counter()
    blob = result.state.encode()
    ctx.profile.add("encode", encoding)
    return blob


def _flag_poll(ctx: WorkerContext, job_id: str) -> Callable[[], bool]:
    """The runner's ``should_yield`` between block groups: asks Redis for a preempt or cancel
    flag, at most once per fifth of the preemption timeout. A flag raised while the chunk runs
    is then seen within that fifth (the commit sees it anyway), and short steps — most of a
    small job's hops — skip the round trip."""
    gap_s = ctx.settings.scheduler.preemption_timeout / 5
    last_s = time.monotonic()

    def should_yield() -> bool:
        nonlocal last_s
        now_s = time.monotonic()
        if now_s - last_s < gap_s:
            return False
        last_s = now_s
        return ctx.store.preempt_requested(job_id)

    return should_yield


def record_text_outcome(
    ctx: WorkerContext, job: JobRecord, version: str | None, result: ChunkResult | None
) -> None:
    """A text chunk's outcome on its expert version (a failure when ``result`` is None)."""
    if job.kind is not JobKind.TEXT:
        return
    from tasks.experts import record_outcome  # loads torch: text jobs only

    model = str(job.params["model"])
    if result is None:
        record_outcome(ctx.store, ctx.settings, model,
                       version or job.expert_version or "base", 0.0, ok=False)
    elif version is not None and result.metrics.get("tokens"):
        record_outcome(ctx.store, ctx.settings, model, version,
                       result.metrics["latency_ms"] / result.metrics["tokens"], ok=True)


def load_state(
    ctx: WorkerContext, job: JobRecord, runner: JobRunner, params: dict[str, Any],
    blob: bytes | None = None,
) -> Checkpoint | None:
    """The job's state at ``job.seq``: from this worker's memory, else the durable checkpoint
    (``blob`` when the claim brought it, else read from Redis), replayed up to ``job.seq``."""
    if job.seq == 0:
        return None
    cached = ctx.cache.get(job.job_id, job.seq)
    if cached is not None:
        return cached
    if blob is None:
        blob = ctx.store.load_checkpoint(job.job_id)
    if blob is None or job.ckpt_seq is None:
        raise CheckpointError(f"job {job.job_id}: no durable checkpoint at seq {job.seq}")
    state = Checkpoint.decode(blob)
    # The durable copy may be a few steps behind (checkpoint_every > 1): replay them here.
    for index in range(job.ckpt_chunk or 0, job.next_chunk):
        log.info("job %s: replaying chunk %d from the durable checkpoint", job.job_id, index)
        state = runner.run_chunk(params, index, state, lambda: False).state
    return state


def stop_attempt(store: JobStore, job: JobRecord, target: JobState, worker: str,
                 reason: str) -> str:
    """End or pause the claimed attempt without a commit (a flag seen at claim, or a failure),
    only if nothing moved since the claim."""
    updates = encode(error=reason) if target is JobState.FAILED else {}
    if target is JobState.PREEMPTED:
        updates = encode(preempt=False, preemptions=job.preemptions + 1,
                         preempted_at_s=time.time())
    store.try_transition(job.job_id, target, by=worker, reason=reason,
                         expect=encode(state=JobState.RUNNING, epoch=job.epoch, seq=job.seq),
                         updates=updates)
    return target.value.lower()


def republish_if_lost(store: JobStore, job_id: str, chunk: int, epoch: int) -> None:
    """A redelivered chunk that already committed: make sure its successor was published
    (the worker may have died between commit and publish)."""
    job = lost_successor(store, job_id, chunk, epoch)
    if job is not None:
        publish_chunk(store, job, chunk=job.next_chunk, epoch=epoch, queue=job.queue)


def lost_successor(store: JobStore, job_id: str, chunk: int, epoch: int) -> JobRecord | None:
    """The job, if ``chunk`` committed but the message of its next chunk was never published;
    None otherwise (or if the record cannot be read)."""
    try:
        job = store.record(job_id)
    except Exception:
        return None
    nxt = job.next_chunk
    if (job.state is JobState.QUEUED and job.epoch == epoch and nxt == chunk + 1
            and (job.published if job.published is not None else -1) < nxt):
        log.warning("job %s: chunk %d was never published; publishing it now", job_id, nxt)
        return job
    return None
