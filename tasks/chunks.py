"""The chunk task: fence the message, run one chunk of a job, commit, then hop or stop.

A chunk message is ``(job_id, chunk, epoch)``. It runs only if the job's epoch and cursor match
(a stale or duplicated message does nothing), and its result lands only through a compare-and-set
on the job's sequence number, so at-least-once delivery never applies a chunk twice.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from pydantic import BaseModel, Field, ValidationError

from app.celery import CHUNK_TASK, app
from app.store import Claim, JobStore
from scheduler.lifecycle import JobState
from tasks.affinity import hop_queue
from tasks.context import WorkerContext, worker_context
from tasks.dispatch import publish_chunk
from workers.checkpoint import Checkpoint
from workers.errors import CheckpointError
from workers.runner import ChunkResult, JobRunner

log = logging.getLogger(__name__)


class ChunkMessage(BaseModel):
    """The arguments of a chunk task; anything else on a queue is rejected and logged."""

    job_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    chunk: int = Field(ge=0)
    epoch: int = Field(ge=0)


@app.task(name=CHUNK_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
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
    claim = store.claim_chunk(job_id, chunk, epoch, ctx.name, ctx.settings.broker.chunk_lease)
    if isinstance(claim, str):
        log.info("job %s chunk %d epoch %d: stale (%s)", job_id, chunk, epoch, claim)
        _republish_if_lost(store, job_id, chunk, epoch)
        return "stale"
    ctx.busy_job = job_id
    try:
        return _run_claimed(ctx, job_id, chunk, epoch, claim, task_id)
    finally:
        ctx.busy_job = None
        if ctx.runner_loaded("text"):
            ctx.refresh_residency()


def _run_claimed(
    ctx: WorkerContext, job_id: str, chunk: int, epoch: int, claim: Claim, task_id: str
) -> str:
    store = ctx.store
    fields = store.fields(job_id)
    if fields.get("cancel") == "1":
        return _stop(store, job_id, JobState.CANCELLED, ctx.name, "cancelled by client")
    if fields.get("preempt") == "1":
        return _yield(store, job_id, ctx.name)
    runner = ctx.runner(fields["kind"])
    params = json.loads(fields["params"])
    state = _load_state(ctx, job_id, claim, chunk, runner, params)
    seq, num_chunks = claim.seq, int(fields["num_chunks"])
    cost_units = json.loads(fields["cost_units"])
    version = None
    while True:
        started = time.monotonic()
        try:
            if fields["kind"] == "text" and version is None:
                from tasks.experts import choose_version  # loads transformers: text jobs only

                version = choose_version(store, ctx.settings, ctx.text_runner(), job_id, fields,
                                         params, state)
                params = {**params, "expert_version": version}
            result = runner.run_chunk(params, chunk, state, lambda: store.preempt_requested(job_id))
        except redis.RedisError:
            raise  # the store went away, not the job: leave it RUNNING for the lease watchdog
        except Exception as exc:
            log.exception("job %s chunk %d failed", job_id, chunk)
            if fields["kind"] == "text":
                from tasks.experts import record_outcome

                record_outcome(store, ctx.settings, params["model"],
                               version or fields.get("expert_version") or "base", 0.0, ok=False)
            return _stop(store, job_id, JobState.FAILED, ctx.name, f"chunk {chunk}: {exc}"[:500])
        elapsed_s = time.monotonic() - started
        if version is not None and chunk > 0 and result.metrics.get("tokens"):
            from tasks.experts import record_outcome

            record_outcome(store, ctx.settings, params["model"], version,
                           result.metrics["latency_ms"] / result.metrics["tokens"], ok=True)
        stopping = not result.complete or store.preempt_requested(job_id)
        last = result.complete and chunk + 1 == num_chunks
        durable = stopping or last or (chunk + 1) % ctx.settings.diffusion.checkpoint_every == 0
        commit = store.commit_chunk(
            job_id, chunk=chunk, epoch=epoch, seq=seq, complete=result.complete,
            checkpoint=result.state.encode() if durable else None,
            service_s=elapsed_s, worker=ctx.name, task_id=task_id,
        )
        if commit is None:
            log.warning("job %s chunk %d: another delivery committed it first", job_id, chunk)
            return "duplicate"
        ctx.chunks_run += 1
        ctx.cache.put(job_id, commit.seq, result.state)
        if result.complete:
            store.record_timing(fields["cost_key"], ctx.settings.device,
                                elapsed_s / max(cost_units[chunk], 1e-9))
        if last:
            return _finish(ctx, job_id, result)
        if stopping:
            flags = store.fields(job_id)
            if flags.get("cancel") == "1":
                return _stop(store, job_id, JobState.CANCELLED, ctx.name, "cancelled by client")
            return _yield(store, job_id, ctx.name)
        chunk, seq, state = commit.next_chunk, commit.seq, result.state
        if fields.get("atomic") != "1":
            return _hop(ctx, job_id, chunk, epoch)


def _load_state(
    ctx: WorkerContext, job_id: str, claim: Claim, chunk: int, runner: JobRunner,
    params: dict[str, Any],
) -> Checkpoint | None:
    """The job's state at ``claim.seq``: from this worker's memory, else Redis (+ replay)."""
    if claim.seq == 0:
        return None
    cached = ctx.cache.get(job_id, claim.seq)
    if cached is not None:
        return cached
    blob = ctx.store.load_checkpoint(job_id)
    if blob is None or claim.ckpt_seq < 0:
        raise CheckpointError(f"job {job_id}: no durable checkpoint at seq {claim.seq}")
    state = Checkpoint.decode(blob)
    # The durable copy may be a few steps behind (checkpoint_every > 1): replay them here.
    for index in range(claim.ckpt_chunk, chunk):
        log.info("job %s: replaying chunk %d from the durable checkpoint", job_id, index)
        state = runner.run_chunk(params, index, state, lambda: False).state
    return state


def _hop(ctx: WorkerContext, job_id: str, chunk: int, epoch: int) -> str:
    """Queue the next chunk on the job's current class (the scheduler may have changed it):
    on this worker's own queue for that class when affinity applies, else the class queue."""
    store = ctx.store
    for _ in range(3):  # a retarget between read and move changes "queue": read it again
        fields = store.fields(job_id)
        queue = hop_queue(ctx.settings, ctx.name, ctx.consuming(), fields["kind"],
                          fields["queue"])
        moved = store.try_transition(
            job_id, JobState.QUEUED, by=ctx.name, reason=f"next chunk {chunk} on {queue}",
            expect={"state": JobState.RUNNING.value, "epoch": str(epoch),
                    "queue": fields["queue"]},
            updates={"queued_at": repr(time.time()), "queue": queue},
        )
        if moved:
            publish_chunk(store, job_id, chunk=chunk, epoch=epoch, queue=queue, fields=fields)
            return "hop"
        now = store.fields(job_id)
        if now["state"] != JobState.RUNNING.value or now["epoch"] != str(epoch):
            break
    log.info("job %s: not hopping to chunk %d; the scheduler moved it", job_id, chunk)
    return "moved"


def _yield(store: JobStore, job_id: str, worker: str) -> str:
    fields = store.fields(job_id)
    store.try_transition(
        job_id, JobState.PREEMPTED, by=worker, reason="preempt flag",
        updates={"preempt": "0", "preemptions": str(int(fields["preemptions"]) + 1),
                 "preempted_at": repr(time.time())},
    )
    return "preempted"


def _stop(store: JobStore, job_id: str, target: JobState, worker: str, reason: str) -> str:
    updates = {"error": reason} if target is JobState.FAILED else {}
    store.try_transition(job_id, target, by=worker, reason=reason, updates=updates)
    return target.value.lower()


def _finish(ctx: WorkerContext, job_id: str, result: ChunkResult) -> str:
    updates: dict[str, str] = {}
    if result.artifact is not None:
        updates["artifact"] = ctx.artifacts.put(job_id, result.artifact)
        updates["media_type"] = result.artifact.media_type
    ctx.cache.drop(job_id)
    ctx.store.try_transition(job_id, JobState.DONE, by=ctx.name, reason="all chunks ran",
                             updates=updates)
    return "done"


def _republish_if_lost(store: JobStore, job_id: str, chunk: int, epoch: int) -> None:
    """A redelivered chunk that already committed: make sure its successor was published
    (the worker may have died between commit and publish)."""
    try:
        fields = store.fields(job_id)
    except Exception:
        return
    nxt = int(fields["next_chunk"])
    if (fields["state"] == JobState.QUEUED.value and fields["epoch"] == str(epoch)
            and nxt == chunk + 1 and int(fields.get("published", "-1")) < nxt):
        log.warning("job %s: chunk %d was never published; publishing it now", job_id, nxt)
        publish_chunk(store, job_id, chunk=nxt, epoch=epoch, queue=fields["queue"],
                      fields=fields)
