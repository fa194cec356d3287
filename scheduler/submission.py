"""The submit decision: what becomes of a new job the moment it arrives. One pure function, so
the live submit path and the simulator cannot decide differently."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.admission import Admission, AdmissionDecision, admit
from scheduler.degradation import Degradation
from scheduler.model import JobView
from scheduler.plan import AdmissionStatus
from scheduler.policy import PolicyConfig, PolicyKind
from scheduler.queues import CLASS_QUEUE, FIFO_QUEUE


class SubmitAction(str, Enum):
    """What the submit path does with a new job."""

    RELEASE = "release"
    """Store it and publish its first chunk to its queue now; the tick re-plans from there."""
    WAIT = "wait"
    """Store it PENDING: the next tick releases it."""
    SUSPEND = "suspend"
    """Store it SUSPENDED (overload convergence holds batch work back)."""
    SHED = "shed"
    """Refuse it (HTTP 429 with Retry-After); nothing is stored."""


@dataclass(frozen=True, slots=True)
class SubmitDecision:
    """:func:`decide_submit`'s answer."""

    action: SubmitAction
    queue: str
    """The queue the job is stored on: its class queue, or the one FIFO queue."""
    atomic: bool
    """FIFO baseline: one task runs every chunk."""
    reason: str
    retry_after_s: float = 0.0
    """Set when shed: when the load should have fallen enough to try again."""


TICK_RELEASED = frozenset({PolicyKind.EDF, PolicyKind.SRPT, PolicyKind.LEAST_SLACK})
"""Baselines that keep exactly their top jobs in flight: the tick releases each job, the submit
path never does (it cannot tell which jobs are in the top without the whole snapshot)."""


def decide_submit(job: JobView, policy: PolicyConfig, status: AdmissionStatus | None,
                  now_s: float, degraded: Degradation | None = None) -> SubmitDecision:
    """The decision for ``job`` (PENDING, submitted at ``now_s``) given the last tick's
    admission ``status`` (None before the first tick: admitted). Refused only by admission,
    and not when admission ``degraded`` it to a level predicted to make its deadline (``job``
    is then its degraded view); otherwise released at once unless the tick must place it: it
    waits for dependencies, its policy releases only from the tick, or it may batch while a
    tick runs (the tick packs it with compatible jobs, at most one tick away)."""
    fifo = policy.policy is PolicyKind.FIFO
    queue = FIFO_QUEUE if fifo else CLASS_QUEUE[job.slo_class]
    admission = AdmissionDecision(Admission.ADMIT, 0.0, "no scheduler status yet") \
        if status is None else admit(job, status, policy, now_s)
    if admission.verdict is Admission.SHED_OVERLOAD and degraded is not None \
            and degraded.meets:
        admission = AdmissionDecision(Admission.ADMIT, 0.0,
                                      f"degraded instead of shed: {admission.reason}")
    if admission.verdict is Admission.SHED_OVERLOAD:
        return SubmitDecision(SubmitAction.SHED, queue, fifo, admission.reason,
                              admission.retry_after_s)
    ticking = status is not None and now_s - status.measured_at_s <= policy.admission_status_ttl_s
    wait = _waits_for_the_tick(job, policy, ticking)
    if wait is not None:
        return SubmitDecision(SubmitAction.WAIT, queue, fifo, wait)
    if admission.verdict is Admission.SUSPEND:
        return SubmitDecision(SubmitAction.SUSPEND, queue, fifo, admission.reason)
    return SubmitDecision(SubmitAction.RELEASE, queue, fifo, f"admitted to {queue}")


def _waits_for_the_tick(job: JobView, policy: PolicyConfig, ticking: bool) -> str | None:
    """Why the tick, not the submit path, releases the job (None: nothing holds it)."""
    if job.depends_on:
        return "waits for its dependencies"
    if policy.policy in TICK_RELEASED:
        return f"{policy.policy.value} releases only its top jobs, from the tick"
    if job.batch_group is not None and ticking:
        return "batchable: the next tick packs it with compatible jobs"
    return None
