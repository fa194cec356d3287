"""Applying a TickPlan: the one loop the live tick and the simulator share.

The order of the actions and what each one means live here; how an action touches the world is
the target's: Redis and Celery for the live tick (``tasks.adapter.LiveTarget``), an in-memory
cluster on a virtual clock for the simulator (``app.bench.simulate``). Every job action is
conditioned on what the plan's snapshot saw: a target refuses it (returns False) when the job
has moved since.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from scheduler import LevelMark, TickPlan
from scheduler.plan import Release
from scheduler.recovery import Failure, Recovery


class TickTarget(Protocol):
    """Where a plan takes effect. Each job method returns whether the job moved."""

    def fail(self, failure: Failure) -> bool:
        """→ FAILED with the reason (a job that can never run, or an unreadable record)."""
        ...

    def recover(self, recovery: Recovery) -> bool:
        """Requeue the job's next chunk on its class queue under a new epoch."""
        ...

    def mark_level(self, job_id: str, mark: LevelMark) -> None:
        """Record the job's MLFQ level and the service it had when it entered it."""
        ...

    def expire(self, job_id: str, reason: str) -> bool:
        ...

    def suspend(self, job_id: str, reason: str) -> bool:
        """→ SUSPENDED (overload convergence) with ``reason`` on its event stream."""
        ...

    def flag_preempt(self, job_id: str) -> bool:
        """The running attempt stops at its next block-group boundary."""
        ...

    def requeue(self, job_id: str, to_queue: str, reason: str) -> bool:
        """A QUEUED job's chunk moves to ``to_queue`` under a new epoch."""
        ...

    def retarget(self, job_id: str, to_queue: str) -> bool:
        """A RUNNING job's next chunk goes to ``to_queue``."""
        ...

    def standby(self, job_id: str) -> bool:
        """QUEUED: requeued to standby; RUNNING: its next chunk goes there."""
        ...

    def release(self, job_id: str, queue: str, atomic: bool,
                estimate_s: float | None = None) -> bool:
        """A waiting job → QUEUED on ``queue`` with its next chunk published; ``estimate_s``
        (the policy's estimate of its whole service time) is kept from its first release."""
        ...

    def release_batch(self, batch_id: str, releases: Sequence[Release], join: bool) -> None:
        """Waiting jobs → QUEUED together in batch ``batch_id`` (all on one queue): a new batch
        is published as one message; a batch in flight (``join``) takes them at its next step
        boundary."""
        ...

    def record_estimate(self, job_id: str, estimate_s: float) -> None:
        """Keep the job's first whole-service-time estimate (a later one never replaces it)."""
        ...

    def set_worker_queues(self, wanted: Mapping[str, tuple[str, ...]]) -> None:
        ...

    def publish_decisions(self, plan: TickPlan) -> None:
        """The origin, the admission status and the policy's memory, for the next tick and
        the submit path."""
        ...


def apply_plan(plan: TickPlan, target: TickTarget) -> list[str]:
    """Carry out ``plan`` on ``target``; returns the ids of the jobs recovered."""
    for failure in plan.failures:
        target.fail(failure)
    recovered = [r.job_id for r in plan.recoveries if target.recover(r)]
    for job_id, mark in plan.levels.items():
        target.mark_level(job_id, mark)
    for expiry in plan.expire:
        target.expire(expiry.job_id, expiry.reason)
    for job_id in plan.suspend:
        target.suspend(job_id, plan.suspend_reason)
    for job_id in plan.preempt:
        target.flag_preempt(job_id)
    for req in plan.requeues:
        target.requeue(req.job_id, req.to_queue, f"requeued {req.from_queue} -> {req.to_queue}")
    for ret in plan.retargets:
        target.retarget(ret.job_id, ret.to_queue)
    for job_id in plan.standby:
        target.standby(job_id)
    for batch in _release_order(plan.releases):
        if isinstance(batch, Release):
            target.release(batch.job_id, batch.queue, plan.atomic_release, batch.estimate_s)
        else:
            target.release_batch(batch[0].batch or "", batch, batch[0].join)
    for job_id, estimate_s in (plan.estimates or {}).items():
        target.record_estimate(job_id, estimate_s)
    target.set_worker_queues(plan.worker_queues)
    target.publish_decisions(plan)
    return recovered


def _release_order(releases: Sequence[Release]) -> list[Release | list[Release]]:
    """The plan's releases in its order, those of one batch gathered at its first member."""
    out: list[Release | list[Release]] = []
    batches: dict[str, list[Release]] = {}
    for rel in releases:
        if rel.batch is None:
            out.append(rel)
        elif rel.batch in batches:
            batches[rel.batch].append(rel)
        else:
            batches[rel.batch] = [rel]
            out.append(batches[rel.batch])
    return out
