"""The batch task: several jobs' next chunks as one batched forward, each job fenced on its own.

A batch message is ``(batch_id, [[job_id, chunk, epoch], ...])``. The worker takes the jobs the
tick released into the batch since its last step (so they run in this very step), claims every
job separately — a job whose claim fails (stale epoch, moved, ended) simply drops out — runs the
claimed chunks through the runner's ``run_batch``, commits each job separately, and publishes
the next step of the jobs that hop, one message per queue. A job flagged for preemption,
finished, cancelled or moved to another queue leaves at that step boundary. The work is
:mod:`tasks.protocol`'s, as for a lone chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import shared_task
from pydantic import BaseModel, Field, ValidationError, field_validator

from tasks.chunks import Cursor, JobId
from tasks.context import WorkerContext, worker_context
from tasks.dispatch import BatchMember
from tasks.protocol import Delivery, run_delivery
from tasks.routing import BATCH_TASK

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
    """Run one step of the batch; returns what happened to each job, for logs and tests."""
    return run_delivery(ctx, Delivery(tuple(members), task_id, batch_id))
