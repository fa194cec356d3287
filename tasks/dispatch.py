"""Putting chunks on queues: release a job, publish its next chunk, requeue with a new epoch.

Every publish uses a fresh task id (a revoked id would be silently dropped if reused) and carries
only references — job id, chunk index, epoch — never tensors. Every move is conditioned on the
record the caller read (state, epoch, sequence number): a job that moved since is left alone.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from kombu import Exchange, Queue

from scheduler.lifecycle import JobState
from tasks.record import JobRecord, encode
from tasks.routing import CHUNK_TASK, affinity_worker, class_queue_of
from tasks.runtime import celery
from tasks.store import JobStore

if TYPE_CHECKING:
    from tasks.context import HopProfile

log = logging.getLogger(__name__)


def publish_chunk(store: JobStore, job: JobRecord, *, chunk: int, epoch: int, queue: str,
                  profile: HopProfile | None = None) -> str:
    """Send one chunk message of ``job``; the task id names the job and chunk so Flower shows
    them, and the record remembers what was published last (the healer compares it)."""
    started = time.perf_counter()
    names = job.chunk_names
    chunk_name = names[chunk] if chunk < len(names) else f"chunk[{chunk}]"
    task_id = f"{job.job_id}.{chunk}.{epoch}.{uuid.uuid4().hex[:6]}"
    args = [job.job_id, chunk, epoch]
    kwargs = {"chunk_name": chunk_name, "slo": job.slo.value, "kind": job.kind.value}
    celery().send_task(
        CHUNK_TASK,
        args=args,
        kwargs=kwargs,
        queue=declared_queue(queue),
        task_id=task_id,
        # What Flower shows as the task's arguments, as Celery would write them; plain repr of
        # strings and ints, instead of Celery's recursive saferepr (~0.1 ms a publish).
        argsrepr=repr(args),
        kwargsrepr=repr(kwargs),
    )
    if profile is not None:
        started = profile.add("publish", started)
    store.set_fields(job.job_id, published=chunk, last_task_id=task_id)
    if profile is not None:
        profile.add("bookkeeping", started)
    return task_id


def declared_queue(name: str) -> str | Queue:
    """A class queue by name (it is in ``task_queues``); a per-worker affinity queue as a
    queue object on its own direct exchange, declared on publish, since Celery would refuse a
    name missing from ``task_queues`` (``task_create_missing_queues`` stays off: a typo in a
    class queue must fail, not silently create a queue nobody reads)."""
    if affinity_worker(name) is None:
        return name
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def release(
    store: JobStore, seen: JobRecord, *, queue: str, by: str, reason: str,
    bump_epoch: bool = False, atomic: bool | None = None, estimate_s: float | None = None,
) -> bool:
    """Move a waiting job (as ``seen``) to QUEUED on ``queue`` and publish its next chunk.

    ``bump_epoch`` fences any message of the job already on a queue (a requeue); ``atomic``
    marks a FIFO-baseline job that runs every chunk in one task; ``estimate_s`` is the policy's
    estimate of the job's whole service time, kept from its first release. Returns False if the
    job moved since ``seen`` was read.
    """
    epoch = seen.epoch + (1 if bump_epoch else 0)
    updates = encode(queue=queue, epoch=epoch, preempt=False, queued_at_s=time.time())
    if atomic is not None:
        updates.update(encode(atomic=atomic))
    if estimate_s is not None and seen.first_estimate_s is None:
        updates.update(encode(first_estimate_s=estimate_s))
    moved = store.transition_as_seen(seen, JobState.QUEUED, by=by, reason=reason,
                                     updates=updates)
    if moved:
        publish_chunk(store, seen, chunk=seen.next_chunk, epoch=epoch, queue=queue)
        if bump_epoch and seen.last_task_id:
            celery().control.revoke(seen.last_task_id)  # hygiene only: the epoch fences
    return moved


def requeue_from_checkpoint(
    store: JobStore, seen: JobRecord, *, by: str, reason: str, stuck: bool = False
) -> str | None:
    """Requeue a job's next chunk from its checkpoint under a new epoch, on its class queue (never
    a lost worker's own queue), only if nothing moved since ``seen`` — nor its running attempt:
    the same claim (``chunk_started_at``) and the same last publish. Returns the queue, or None
    if the job moved."""
    queue = class_queue_of(seen.queue)
    same_attempt = encode(chunk_started_at_s=seen.chunk_started_at_s,
                          last_task_id=seen.last_task_id)
    updates = encode(epoch=seen.epoch + 1, queued_at_s=time.time(), running_on=None,
                     queue=queue)
    if stuck:
        updates.update(encode(stuck=seen.stuck + 1))
    if not store.transition_as_seen(seen, JobState.QUEUED, by=by, reason=reason,
                                    expect=same_attempt, updates=updates):
        return None
    publish_chunk(store, seen, chunk=seen.next_chunk, epoch=seen.epoch + 1, queue=queue)
    return queue
