"""Putting chunks on queues: release a job, hop to its next chunk, requeue with a new epoch.

Every publish uses a fresh task id (a revoked id would be silently dropped if reused) and carries
only references — job id, chunk index, epoch — never tensors.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping

from kombu import Exchange, Queue

from app.celery import CHUNK_TASK, app
from app.store import JobStore
from scheduler.lifecycle import JobState
from tasks.routing import affinity_worker, class_queue_of

log = logging.getLogger(__name__)


def publish_chunk(
    store: JobStore, job_id: str, *, chunk: int, epoch: int, queue: str,
    fields: Mapping[str, str] | None = None,
) -> str:
    """Send one chunk message; the task id names the job and chunk so Flower shows them.
    ``fields`` is the job's record when the caller already read it (one Redis read less)."""
    fields = store.fields(job_id) if fields is None else fields
    names = fields.get("chunk_names", "")
    chunk_names = names.split(",") if names else []
    chunk_name = chunk_names[chunk] if chunk < len(chunk_names) else f"chunk[{chunk}]"
    task_id = f"{job_id}.{chunk}.{epoch}.{uuid.uuid4().hex[:6]}"
    app.send_task(
        CHUNK_TASK,
        args=[job_id, chunk, epoch],
        kwargs={"chunk_name": chunk_name, "slo": fields["slo"], "kind": fields["kind"]},
        queue=declared_queue(queue),
        task_id=task_id,
    )
    store.set_fields(job_id, published=str(chunk), last_task_id=task_id)
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
    store: JobStore, job_id: str, *, queue: str, by: str, reason: str, bump_epoch: bool = False
) -> bool:
    """Move a waiting job to QUEUED on ``queue`` and publish its next chunk.

    ``bump_epoch`` fences any message of the job already on a queue (a requeue); returns False
    if the job moved meanwhile.
    """
    fields = store.fields(job_id)
    epoch = int(fields["epoch"]) + (1 if bump_epoch else 0)
    moved = store.try_transition(
        job_id, JobState.QUEUED, by=by, reason=reason,
        expect={"state": fields["state"], "epoch": fields["epoch"]},
        updates={"queue": queue, "epoch": str(epoch), "preempt": "0",
                 "queued_at": repr(time.time())},
    )
    if moved:
        publish_chunk(store, job_id, chunk=int(fields["next_chunk"]), epoch=epoch, queue=queue,
                      fields=fields)
        if bump_epoch and fields.get("last_task_id"):
            app.control.revoke(fields["last_task_id"])  # hygiene only: the epoch already fences
    return moved



def requeue_from_checkpoint(
    store: JobStore, fields: Mapping[str, str], *, by: str, reason: str,
    expect: Mapping[str, str] | None = None, updates: Mapping[str, str] | None = None,
) -> str | None:
    """Requeue a job's next chunk from its checkpoint under a new epoch, on its class queue (never
    a lost worker's own queue), only if nothing moved since ``fields`` was read: its state,
    epoch and sequence number, plus ``expect``. Returns the queue, or None if the job moved."""
    job_id, epoch = fields["id"], int(fields["epoch"]) + 1
    queue = class_queue_of(fields["queue"])
    moved = store.try_transition(
        job_id, JobState.QUEUED, by=by, reason=reason,
        expect={"state": fields["state"], "epoch": fields["epoch"], "seq": fields["seq"],
                **(expect or {})},
        updates={"epoch": str(epoch), "queued_at": repr(time.time()), "running_on": "",
                 "queue": queue, **(updates or {})},
    )
    if not moved:
        return None
    publish_chunk(store, job_id, chunk=int(fields["next_chunk"]), epoch=epoch, queue=queue,
                  fields=fields)
    return queue
