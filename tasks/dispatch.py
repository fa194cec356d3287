"""Putting chunks on queues: release a job, publish its next chunk, requeue with a new epoch.

Every publish uses a fresh task id (a revoked id would be silently dropped if reused) and carries
only references — job id, chunk index, epoch — never tensors. Every move is conditioned on the
record the caller read (state, epoch, sequence number): a job that moved since is left alone.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from kombu import Exchange, Queue

from scheduler.lifecycle import JobState
from tasks import keys
from tasks.record import JobRecord, encode
from tasks.routing import BATCH_TASK, CHUNK_TASK, affinity_worker, class_queue_of
from tasks.runtime import celery, current_settings, separate_broker
from tasks.script_batch import ScriptBatch
from tasks.store import JobStore, mark_changed
from tasks.store_calls import NextMessage

if TYPE_CHECKING:
    from tasks.context import HopProfile
    from tasks.settings import Settings

log = logging.getLogger(__name__)


def publish_chunk(store: JobStore, job: JobRecord, *, chunk: int, epoch: int, queue: str,
                  profile: HopProfile | None = None) -> str:
    """Send one chunk message of ``job``; the task id names the job and chunk so Flower shows
    them, and the record remembers what was published last (the healer compares it). A
    batchable job goes out as a batch of one, which compatible jobs may join later."""
    if job.batch_group is not None and not job.atomic:
        return publish_batch(store, new_batch_id(job.job_id), job, [(job.job_id, chunk, epoch)],
                             queue=queue, profile=profile)
    task_id, args, kwargs = chunk_task(job, chunk, epoch)
    _send(store, CHUNK_TASK, task_id, args, kwargs, queue,
          [(job.job_id, encode(published=chunk, last_task_id=task_id))], profile=profile)
    return task_id


def direct_publish(settings: Settings | None = None) -> bool:
    """Whether Stepline writes its task messages onto the queues itself
    (``broker.direct_publish``; Celery's publish when ``task_sent_events`` wants its event, or
    when the queues live on another Redis than the store, ``broker.url``)."""
    settings = settings or current_settings()
    broker = settings.broker
    return broker.direct_publish and not broker.task_sent_events \
        and not separate_broker(settings)


def _send(store: JobStore, task_name: str, task_id: str, args: list[Any],
          kwargs: dict[str, Any], queue: str, records: list[tuple[str, dict[str, str]]], *,
          profile: HopProfile | None = None, open_batch: tuple[str, float] | None = None) -> None:
    """Put one task message on ``queue`` and write ``records`` (job id, fields: what each
    record remembers of the publish); ``open_batch`` (batch id, lease) marks a batch open for
    joiners first. Directly (:func:`direct_publish`): all of it in one MULTI, one round trip.
    Else Celery's ``send_task``, then the writes."""
    started = time.perf_counter()
    direct = direct_publish()
    pipe = store.redis.pipeline(transaction=direct)
    if open_batch is not None:
        batch_id, lease_s = open_batch
        pipe.set(keys.batch_open(batch_id), "1", px=max(int(lease_s * 1000), 1))
    if direct:
        message = wire_message(task_name, task_id, args, kwargs)
        pipe.lpush(queue, message.for_queue(queue))  # priority 0: the queue's own list
    else:
        pipe.execute()  # the batch is open before its message can be taken
        # argsrepr / kwargsrepr: what Flower shows as the task's arguments, as Celery would
        # write them; plain repr of strings and ints, instead of Celery's recursive saferepr.
        celery().send_task(task_name, args=args, kwargs=kwargs, queue=declared_queue(queue),
                           task_id=task_id, argsrepr=repr(args), kwargsrepr=repr(kwargs))
        if profile is not None:
            started = profile.add("publish", started)
    for job_id, fields in records:
        pipe.hset(keys.job(job_id), mapping=fields)  # type: ignore[arg-type]
        mark_changed(pipe, job_id)
    pipe.execute()
    if profile is not None:
        profile.add("publish" if direct else "bookkeeping", started)


def chunk_task(job: JobRecord, chunk: int, epoch: int) -> tuple[str, list[Any], dict[str, Any]]:
    """The task id, arguments and keyword arguments of ``job``'s chunk message."""
    names = job.chunk_names
    chunk_name = names[chunk] if chunk < len(names) else f"chunk[{chunk}]"
    task_id = f"{job.job_id}.{chunk}.{epoch}.{uuid.uuid4().hex[:6]}"
    kwargs = {"chunk_name": chunk_name, "slo": job.slo.value, "kind": job.kind.value}
    return task_id, [job.job_id, chunk, epoch], kwargs


QUEUE_MARK = "@@stepline-queue@@"
"""Stands in for the queue's name while a message's queue is still open."""


def wire_message(task_name: str, task_id: str, args: list[Any], kwargs: dict[str, Any]
                 ) -> NextMessage:
    """The message ``celery().send_task(task_name, args, kwargs, queue=Q, task_id=task_id)``
    puts on queue Q's Redis list, built without a connection: Celery's own protocol-2 task
    message (``as_task_v2``: headers, properties, body) in kombu's virtual-transport envelope,
    as ``Producer.publish`` and ``Channel.basic_publish`` write it (JSON body, base64 body
    encoding, persistent delivery, priority 0 — the queue's own list —, a fresh delivery tag,
    the anonymous exchange with the queue as routing key), its queue left open for the commit
    script to fill in once it has chosen where the job hops. ``tests/integration/test_transport.py``
    holds it equal to what kombu writes, field by field."""
    app = celery()
    argsrepr, kwargsrepr = repr(args), repr(kwargs)
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, task_name, args=args, kwargs=kwargs, reply_to=app.thread_oid,
        argsrepr=argsrepr, kwargsrepr=kwargsrepr, ignore_result=None)
    properties.update(
        argsrepr=argsrepr, kwargsrepr=kwargsrepr, delivery_mode=2,
        delivery_info={"exchange": "", "routing_key": QUEUE_MARK}, priority=0,
        body_encoding="base64", delivery_tag=str(uuid.uuid4()))
    envelope = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": headers, "properties": properties,
    }
    before, after = json.dumps(envelope).split(json.dumps(QUEUE_MARK))
    return NextMessage(task_id, before, after)


def next_chunk_message(job: JobRecord, chunk: int, epoch: int) -> NextMessage:
    """The message of ``job``'s chunk ``chunk``, for the commit that hops the job to push onto
    the queue it chooses (``CommitRequest.next_message``)."""
    return wire_message(CHUNK_TASK, *chunk_task(job, chunk, epoch))


BatchMember = tuple[str, int, int]
"""A job in a batch message: its id, and the chunk and epoch the message runs."""


def new_batch_id(lead_job_id: str) -> str:
    return f"{lead_job_id}.{uuid.uuid4().hex[:6]}"


def publish_batch(store: JobStore, batch_id: str, lead: JobRecord, members: list[BatchMember],
                  *, queue: str, profile: HopProfile | None = None, lease_s: float = 10.0,
                  mark_open: bool = True) -> str:
    """Send one batch message carrying every member's next chunk, each fenced by its own epoch
    at claim; each record remembers the publish as :func:`publish_chunk` does (its own
    ``job.chunk.epoch.x`` id, x shared with the batch task, so the healer reads it alike) and
    the batch it is in. ``lead`` (a member's record) names the task for Flower. The batch is
    marked open (for ``lease_s``) so the tick may add joiners; a worker's hop has renewed the
    mark already (``mark_open=False``)."""
    suffix = uuid.uuid4().hex[:6]
    task_id = f"batch.{batch_id}.{suffix}"
    args = [batch_id, [list(member) for member in members]]
    names, lead_chunk = lead.chunk_names, members[0][1]
    kwargs = {"chunk_name": names[lead_chunk] if lead_chunk < len(names) else "",
              "slo": lead.slo.value, "kind": lead.kind.value, "size": len(members)}
    records = [(job_id, encode(published=chunk, last_task_id=f"{job_id}.{chunk}.{epoch}.{suffix}",
                               batch=batch_id))
               for job_id, chunk, epoch in members]
    _send(store, BATCH_TASK, task_id, args, kwargs, queue, records, profile=profile,
          open_batch=(batch_id, lease_s) if mark_open else None)
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
    epoch, updates = release_updates(seen, queue=queue, bump_epoch=bump_epoch, atomic=atomic,
                                     estimate_s=estimate_s)
    moved = store.transition_as_seen(seen, JobState.QUEUED, by=by, reason=reason,
                                     updates=updates)
    if moved:
        # No revoke of the message a bumped epoch leaves behind: its claim refuses it in one
        # round trip, while a revoke is a broadcast every worker handles before its next task
        # (a tick moving thousands of jobs held each worker's next chunk for seconds).
        publish_chunk(store, seen, chunk=seen.next_chunk, epoch=epoch, queue=queue)
    return moved


def release_updates(seen: JobRecord, *, queue: str, bump_epoch: bool = False,
                    atomic: bool | None = None, estimate_s: float | None = None
                    ) -> tuple[int, dict[str, str]]:
    """The epoch a release of ``seen`` publishes under and the fields its move to QUEUED
    writes (:func:`release`)."""
    epoch = seen.epoch + (1 if bump_epoch else 0)
    updates = encode(queue=queue, epoch=epoch, preempt=False, queued_at_s=time.time())
    if atomic is not None:
        updates.update(encode(atomic=atomic))
    if estimate_s is not None and seen.first_estimate_s is None:
        updates.update(encode(first_estimate_s=estimate_s))
    return epoch, updates


def queue_release(batch: ScriptBatch, job: JobRecord, queue: str, *, by: str, reason: str,
                  direct: bool, bump_epoch: bool = False, atomic: bool | None = None,
                  estimate_s: float | None = None) -> tuple[int, bool]:
    """Queue on ``batch`` ``job``'s move to QUEUED on ``queue`` (:func:`release`'s fields),
    with, when :func:`message_for_release` gives one, its chunk message and the record's note
    in the same script. Returns the epoch it publishes under and whether the message went with
    the move (else publish it once the move took effect)."""
    epoch, updates = release_updates(job, queue=queue, bump_epoch=bump_epoch, atomic=atomic,
                                     estimate_s=estimate_s)
    pushed = message_for_release(job, job.next_chunk, epoch, queue, direct=direct)
    if pushed is not None:
        updates.update(pushed[1])
    batch.transition_as_seen(job, JobState.QUEUED, by=by, reason=reason, updates=updates,
                             push=None if pushed is None else (queue, pushed[0]))
    return epoch, pushed is not None


def message_for_release(job: JobRecord, chunk: int, epoch: int, queue: str, *, direct: bool
                        ) -> tuple[str, dict[str, str]] | None:
    """The message of ``job``'s chunk that its release can push in the same script as its move
    to QUEUED, and the record's note of it (the fields :func:`publish_chunks` writes after):
    with ``direct`` publish (:func:`direct_publish`), for a plain chunk; None when the chunk
    goes out otherwise (Celery's publish, a batch of one): publish it once the job moved."""
    if not direct or (job.batch_group is not None and not job.atomic):
        return None
    task_id, args, kwargs = chunk_task(job, chunk, epoch)
    message = wire_message(CHUNK_TASK, task_id, args, kwargs)
    return message.for_queue(queue), encode(published=chunk, last_task_id=task_id)


def publish_chunks(store: JobStore, chunks: list[tuple[JobRecord, int, int, str]]) -> None:
    """:func:`publish_chunk` of each (job, chunk, epoch, queue): with direct publish, every
    plain chunk message and its record's note go out in one MULTI (one round trip); a batchable
    job (a batch of one) or Celery's publish, one at a time."""
    direct = direct_publish()
    pipe = store.redis.pipeline(transaction=True)
    for job, chunk, epoch, queue in chunks:
        if not direct or (job.batch_group is not None and not job.atomic):
            publish_chunk(store, job, chunk=chunk, epoch=epoch, queue=queue)
            continue
        task_id, args, kwargs = chunk_task(job, chunk, epoch)
        message = wire_message(CHUNK_TASK, task_id, args, kwargs)
        pipe.lpush(queue, message.for_queue(queue))
        note = encode(published=chunk, last_task_id=task_id)
        pipe.hset(keys.job(job.job_id), mapping=note)  # type: ignore[arg-type]
        mark_changed(pipe, job.job_id)
    if len(pipe):
        pipe.execute()


def release_batch(
    store: JobStore, batch_id: str, seen: list[JobRecord], *, queue: str, join: bool, by: str,
    estimates: dict[str, float], lease_s: float,
) -> list[str]:
    """Release waiting jobs (each as ``seen``) into one batch on ``queue``: a new batch goes
    out as one message; joiners of a batch in flight are taken by its worker at the batch's
    next step boundary, or published as a batch of their own if it has just ended. Returns
    the ids of the jobs that moved."""
    moved: list[JobRecord] = []
    for job in seen:
        updates = encode(queue=queue, preempt=False, queued_at_s=time.time(), batch=batch_id)
        if job.first_estimate_s is None and job.job_id in estimates:
            updates.update(encode(first_estimate_s=estimates[job.job_id]))
        if store.transition_as_seen(job, JobState.QUEUED, by=by, updates=updates,
                                    reason=f"released to {queue} in batch {batch_id}"):
            moved.append(job)
    alone = [j for j in moved
             if not (join and store.join_batch(batch_id, j.job_id, j.next_chunk, j.epoch))]
    if alone:
        members = [(j.job_id, j.next_chunk, j.epoch) for j in alone]
        publish_batch(store, batch_id if not join else new_batch_id(alone[0].job_id), alone[0],
                      members, queue=queue, lease_s=lease_s)
    return [j.job_id for j in moved]


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
