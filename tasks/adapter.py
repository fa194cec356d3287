"""Applies the scheduler's decisions to Redis and Celery, and heals jobs whose worker died."""

from __future__ import annotations

import logging
import time

from app.store import JobStore
from scheduler.lifecycle import JobState
from tasks.context import WorkerContext
from tasks.dispatch import publish_chunk, release

log = logging.getLogger(__name__)

_WAITING = {JobState.PENDING.value, JobState.PREEMPTED.value}


def run_tick(ctx: WorkerContext, now_s: float) -> None:
    store = ctx.store
    jobs = store.many_fields(store.active_ids())
    requeue_lost_chunks(store, jobs, now_s)
    for fields in jobs:
        if fields["state"] in _WAITING and dependencies_done(store, fields):
            release(store, fields["id"], queue=fields["queue"], by="scheduler", reason="release")


def dependencies_done(store: JobStore, fields: dict[str, str]) -> bool:
    import json

    deps = json.loads(fields.get("depends_on", "[]"))
    return all(store.state(dep) is JobState.DONE for dep in deps)


def requeue_lost_chunks(store: JobStore, jobs: list[dict[str, str]], now_s: float) -> list[str]:
    """A RUNNING job whose chunk lease lapsed lost its worker: requeue it from its checkpoint
    under a new epoch (the dead worker's message, if redelivered, is then stale)."""
    healed = []
    for fields in jobs:
        lease_until = float(fields.get("lease_until") or "inf")
        if fields["state"] != JobState.RUNNING.value or lease_until >= now_s:
            continue
        epoch = int(fields["epoch"]) + 1
        moved = store.try_transition(
            fields["id"], JobState.QUEUED, by="watchdog",
            reason=f"lease of {fields.get('running_on')} lapsed; requeued from checkpoint",
            expect={"state": JobState.RUNNING.value, "epoch": fields["epoch"],
                    "seq": fields["seq"]},
            updates={"epoch": str(epoch), "queued_at": repr(time.time()), "running_on": ""},
        )
        if moved:
            log.warning("job %s: worker %s lost; requeued chunk %s", fields["id"],
                        fields.get("running_on"), fields["next_chunk"])
            publish_chunk(store, fields["id"], chunk=int(fields["next_chunk"]), epoch=epoch,
                          queue=fields["queue"])
            healed.append(fields["id"])
    return healed
