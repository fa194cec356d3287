"""The baseline policies the benchmarks compare Stepline against: FIFO, static priority, and
three step-preemptive "top-cap by key" schedulers (EDF, SRPT, least slack)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from scheduler.admission import admission_status
from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot, JobView
from scheduler.plan import LevelMark, Release, Requeue, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import BATCH_QUEUE, STANDBY_QUEUE, queue_for_level
from scheduler.reserve import worker_queues
from scheduler.state import AdmissionState, PolicyState

_RELEASABLE = frozenset({JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED})
_IN_FLIGHT = frozenset({JobState.QUEUED, JobState.RUNNING})

RankKey = Callable[[JobView, float, float], float]
"""(job, its estimated remaining work in seconds, now_s) → rank; the smallest goes first."""
_Rank = tuple[float, float, bool, str]
"""(key, arrival, not running, job id): on a tie the earlier arrival, then a running job (it
keeps its worker; a queued victim yields at its claim, having run nothing)."""


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


def plan_edf(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Step-preemptive earliest deadline first: the slots go to the earliest absolute
    deadlines."""
    return _plan_top_cap(snapshot, policy, now_s, lambda job, _work_s, _now_s: job.deadline_s)


def plan_srpt(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Step-preemptive shortest remaining processing time: the slots go to the least estimated
    remaining work."""
    return _plan_top_cap(snapshot, policy, now_s, lambda _job, work_s, _now_s: work_s)


def plan_least_slack(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Step-preemptive least slack first: the slots go to the least deadline − now − estimated
    remaining work (a job already late has negative slack and goes first)."""
    return _plan_top_cap(snapshot, policy, now_s,
                         lambda job, work_s, at_s: job.deadline_s - at_s - work_s)


def remaining_work_estimator(snapshot: ClusterSnapshot) -> Callable[[JobView], float]:
    """A job's estimated remaining work in seconds: its remaining cost units at the alive
    fleet's mean seconds per unit for its cost key (each key's rate worked out once)."""
    devices = [w.device for w in snapshot.workers if w.alive]
    rates: dict[str, float] = {}

    def remaining_s(job: JobView) -> float:
        rate = rates.get(job.cost_key)
        if rate is None:
            rate = rates[job.cost_key] = snapshot.cost.fleet_seconds_per_unit(job.cost_key,
                                                                               devices)
        return job.remaining_cost_units * rate

    return remaining_s


def _plan_top_cap(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float,
                  key: RankKey) -> TickPlan:
    """The ``cap`` best live jobs by ``key`` should be in flight: the desired waiting ones are
    released (a free slot each, else an undesired in-flight job is preempted for it, worst
    first); the in-flight ones stay."""
    cap = sum(1 for w in snapshot.workers if w.alive) * policy.slots_per_worker
    in_flight = [j for j in snapshot.jobs if _in_flight(j)]
    ranks = _ranks(snapshot, [*in_flight, *_releasable(snapshot.jobs)], key, now_s)
    desired = set(heapq.nsmallest(cap, ranks, key=ranks.__getitem__))
    flying = {j.job_id for j in in_flight}
    wanted = sorted(desired - flying, key=ranks.__getitem__)
    free = cap - len(in_flight)
    victims = _pick_victims([j for j in in_flight if j.job_id not in desired], ranks,
                            len(wanted) - max(free, 0), policy.max_preemptions)
    jobs = {j.job_id: j for j in snapshot.jobs}
    releases = tuple(Release(job_id, queue_for_level(_rank(jobs[job_id])))
                     for job_id in wanted[:max(free + len(victims), 0)])
    return _baseline_plan(snapshot, policy, now_s, releases, (), atomic=False, levels={},
                          preempt=victims, capacity_slots=cap)


def _releasable(jobs: Sequence[JobView]) -> list[JobView]:
    """Waiting jobs free to run: none of their dependencies is still live."""
    live = {j.job_id for j in jobs if not j.state.is_terminal}
    return [j for j in jobs if j.state in _RELEASABLE
            and not any(dep in live for dep in j.depends_on)]


def _ranks(snapshot: ClusterSnapshot, jobs: Sequence[JobView], key: RankKey,
           now_s: float) -> dict[str, _Rank]:
    remaining_s = remaining_work_estimator(snapshot)
    return {j.job_id: (key(j, remaining_s(j), now_s), j.submitted_at_s,
                       j.state is not JobState.RUNNING, j.job_id) for j in jobs}


def _in_flight(job: JobView) -> bool:
    return (job.state in _IN_FLIGHT and not job.preempt_requested
            and job.queue != STANDBY_QUEUE)


def _pick_victims(undesired: Sequence[JobView], ranks: Mapping[str, _Rank], count: int,
                  max_preemptions: int) -> tuple[str, ...]:
    """Up to ``count`` of ``undesired``, worst rank first, none preempted ``max_preemptions``
    times already."""
    if count <= 0:
        return ()
    eligible = [j.job_id for j in undesired if j.preemptions < max_preemptions]
    return tuple(heapq.nlargest(count, eligible, key=ranks.__getitem__))


def _rank(job: JobView) -> int:
    return job.slo_class.rank


def _baseline_plan(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float,
                   releases: tuple[Release, ...], requeues: tuple[Requeue, ...], atomic: bool,
                   levels: dict[str, LevelMark], preempt: tuple[str, ...] = (),
                   capacity_slots: int | None = None) -> TickPlan:
    alive = [w for w in snapshot.workers if w.alive]
    return TickPlan(
        policy=policy.policy,
        now_s=now_s, origin_id=None, origin_score=None, top_scores=(), releases=releases,
        atomic_release=atomic, requeues=requeues, retargets=(), preempt=preempt, suspend=(),
        standby=(), expire=(), levels=levels, reserved_workers=frozenset(),
        worker_queues=worker_queues(alive, ()),
        admission=admission_status(AdmissionState.OPEN, 0.0, policy, now_s),
        capacity_slots=capacity_slots, state=PolicyState(),
    )
