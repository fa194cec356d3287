"""The two baseline policies the benchmarks compare Stepline against."""

from __future__ import annotations

from operator import attrgetter

from scheduler.admission import admission_status
from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot, JobView
from scheduler.plan import LevelMark, Release, Requeue, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import BATCH_QUEUE, queue_for_level
from scheduler.reserve import worker_queues
from scheduler.state import AdmissionState, PolicyState

_RELEASABLE = frozenset({JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED})


def plan_fifo(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Every waiting job released now, in arrival order, to ``batch``, as one atomic task."""
    waiting = sorted((j for j in snapshot.jobs if j.state in _RELEASABLE),
                     key=attrgetter("submitted_at_s"))
    releases = tuple(Release(job.job_id, BATCH_QUEUE) for job in waiting)
    return _baseline_plan(snapshot, policy, now_s, releases, (), atomic=True, levels={})


def plan_priority(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Every waiting job released now to its class's queue; chunks hop at step boundaries,
    where the workers' strict queue order lets higher classes go first."""
    waiting = sorted((j for j in snapshot.jobs if j.state in _RELEASABLE),
                     key=lambda job: (_rank(job), job.submitted_at_s))
    releases = tuple(Release(job.job_id, queue_for_level(_rank(job))) for job in waiting)
    requeues = tuple(
        Requeue(job.job_id, job.queue, queue_for_level(_rank(job)))
        for job in snapshot.jobs
        if job.state is JobState.QUEUED and job.queue is not None
        and job.queue != queue_for_level(_rank(job))
    )
    levels = {job.job_id: LevelMark(_rank(job), job.service_s) for job in waiting
              if job.level != _rank(job)}
    return _baseline_plan(snapshot, policy, now_s, releases, requeues, atomic=False,
                          levels=levels)


def _rank(job: JobView) -> int:
    return job.slo_class.rank


def _baseline_plan(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float,
                   releases: tuple[Release, ...], requeues: tuple[Requeue, ...], atomic: bool,
                   levels: dict[str, LevelMark]) -> TickPlan:
    alive = [w for w in snapshot.workers if w.alive]
    return TickPlan(
        policy=policy.policy,
        now_s=now_s, origin_id=None, origin_score=None, top_scores=(), releases=releases,
        atomic_release=atomic, requeues=requeues, retargets=(), preempt=(), suspend=(),
        standby=(), expire=(), levels=levels, reserved_workers=frozenset(),
        worker_queues=worker_queues(alive, ()),
        admission=admission_status(AdmissionState.OPEN, 0.0, policy, now_s),
        capacity_slots=None, state=PolicyState(),
    )
