"""The chunk task: one job's chunk, fenced, run, committed, then a hop or a stop.

A chunk message is ``(job_id, chunk, epoch)``. It runs only if the job's epoch and cursor match
(a stale or duplicated message does nothing), and its result lands only through a compare-and-set
on the job's sequence number, so at-least-once delivery never applies a chunk twice. The work is
:mod:`tasks.protocol`'s, a chunk message being a batch of one.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from celery import shared_task
from pydantic import BaseModel, Field, ValidationError

from tasks.context import WorkerContext, worker_context
from tasks.protocol import Delivery, run_delivery
from tasks.routing import CHUNK_TASK

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
    """Run chunks of one job starting at ``chunk`` (all of them for an atomic job); returns
    what happened, for logs and tests."""
    return run_delivery(ctx, Delivery(((job_id, chunk, epoch),), task_id))
