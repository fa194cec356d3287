"""check_plan_invariants: the rules every TickPlan keeps, checked against its snapshot.

The adapter checks every plan, so the check is O(jobs + plan) with one cheap pass over the jobs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from operator import attrgetter

from scheduler.errors import PlanInvariantViolated
from scheduler.lifecycle import TRANSITIONS, JobState
from scheduler.model import ClusterSnapshot, JobView
from scheduler.plan import Requeue, Retarget, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import BATCH_QUEUE, JOB_QUEUES, LEVELS, RESERVE_WORKER_QUEUES, STANDBY_QUEUE
from scheduler.state import AdmissionState

_S = JobState
_RELEASABLE = frozenset({_S.PENDING, _S.PREEMPTED, _S.SUSPENDED})
_SOURCES = {target: frozenset(s for s, targets in TRANSITIONS.items() if target in targets)
            for target in JobState}
"""Target state → the states it may be reached from (``TRANSITIONS`` read backwards)."""
_job_id = attrgetter("job_id")


def check_plan_invariants(plan: TickPlan, snapshot: ClusterSnapshot,
                          policy: PolicyConfig | None = None) -> None:
    """Raise :class:`PlanInvariantViolated` naming the first rule ``plan`` breaks; with
    ``policy``, also check the preemption bound and overload rules."""
    jobs = _by_id(snapshot.jobs)
    _check_disjoint(plan)
    _check_actions(plan, jobs)
    _check_capacity(plan, jobs)
    _check_workers(plan, snapshot)
    _check_origin(plan, jobs)
    if policy is not None:
        _check_policy_bounds(plan, jobs, policy)


_last: list[tuple[tuple[JobView, ...], dict[str, JobView]]] = []
"""The last snapshot's jobs and their index by id: a held snapshot cache hands the same tuple
to tick after tick while nothing changes, and the index is then not built again."""


def _by_id(jobs: tuple[JobView, ...]) -> Mapping[str, JobView]:
    for seen, by_id in _last:
        if seen is jobs:
            return by_id
    by_id = dict(zip(map(_job_id, jobs), jobs, strict=True))
    _last[:] = [(jobs, by_id)]
    return by_id


def _fail(rule: str) -> None:
    raise PlanInvariantViolated(f"plan breaks an invariant: {rule}")


def _acted_on(plan: TickPlan) -> list[str]:
    return [*(r.job_id for r in plan.releases), *(r.job_id for r in plan.requeues),
            *(r.job_id for r in plan.retargets), *plan.preempt, *plan.suspend, *plan.standby,
            *(e.job_id for e in plan.expire), *(r.job_id for r in plan.recoveries),
            *(f.job_id for f in plan.failures)]


def _check_disjoint(plan: TickPlan) -> None:
    acted = _acted_on(plan)
    if len(set(acted)) == len(acted):
        return
    twice = [job_id for job_id, n in Counter(acted).items() if n > 1]
    _fail(f"jobs acted on twice in one plan: {sorted(twice)[:5]}")


def _check_actions(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    for r in plan.releases:
        _check_transition(r.job_id, _S.QUEUED, jobs)
        if r.queue not in JOB_QUEUES:
            _fail(f"job {r.job_id} released to unknown queue {r.queue!r}")
    for job_ids, target in ((plan.preempt, _S.PREEMPTED), (plan.suspend, _S.SUSPENDED),
                            ((e.job_id for e in plan.expire), _S.EXPIRED)):
        _check_transitions(job_ids, target, jobs)
    if any(jobs[r.job_id].state not in _RELEASABLE for r in plan.releases):
        _fail("only PENDING, PREEMPTED or SUSPENDED jobs may be released")
    for recovery in plan.recoveries:
        job = jobs.get(recovery.job_id)
        if job is None or job.state not in (_S.QUEUED, _S.RUNNING):
            _fail(f"job {recovery.job_id} recovered but neither QUEUED nor RUNNING")
    for failure in plan.failures:
        if failure.job_id in jobs:
            _check_transition(failure.job_id, _S.FAILED, jobs)
    _check_moves(plan, jobs)


def _check_transitions(job_ids: Iterable[str], target: JobState,
                       jobs: Mapping[str, JobView]) -> None:
    sources, get = _SOURCES[target], jobs.get
    for job_id in job_ids:
        job = get(job_id)
        if job is None or job.state not in sources:
            _check_transition(job_id, target, jobs)


def _check_transition(job_id: str, target: JobState, jobs: Mapping[str, JobView]) -> None:
    job = jobs.get(job_id)
    if job is None or target not in TRANSITIONS[job.state]:
        _fail(f"job {job_id} cannot move to {target.value} from "
              f"{job.state.value if job else 'nowhere'}")


def _check_moves(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    moves: list[tuple[Requeue | Retarget, JobState]] = [
        *((r, _S.QUEUED) for r in plan.requeues), *((r, _S.RUNNING) for r in plan.retargets)]
    for move, state in moves:
        job = jobs.get(move.job_id)
        if job is None or job.state is not state or job.queue != move.from_queue:
            _fail(f"{type(move).__name__} of {move.job_id} does not match its job")
        if move.to_queue == move.from_queue or move.to_queue not in JOB_QUEUES:
            _fail(f"{type(move).__name__} of {move.job_id} to {move.to_queue!r} moves nothing")
    for job_id in plan.preempt:
        if jobs[job_id].state not in (_S.RUNNING, _S.QUEUED) or jobs[job_id].preempt_requested:
            _fail(f"job {job_id} preempted but not in flight, or already flagged")
    for job_id in plan.standby:
        job = jobs.get(job_id)
        if job is None or job.state not in (_S.QUEUED, _S.RUNNING) or job.queue == STANDBY_QUEUE:
            _fail(f"job {job_id} sent to standby from where it cannot go")
    if any(level not in LEVELS for level in (m.level for m in plan.levels.values())):
        _fail("a level outside the MLFQ's levels")


def _in_flight(job: JobView) -> bool:
    return (job.state in (_S.QUEUED, _S.RUNNING) and not job.preempt_requested
            and job.queue != STANDBY_QUEUE)


def _count_in_flight(jobs: Iterable[JobView]) -> int:
    """How many of ``jobs`` are in flight: :func:`_in_flight` inlined (one pass, every job)."""
    queued, running = _S.QUEUED, _S.RUNNING
    return sum([1 for job in jobs if (job.state is queued or job.state is running)
                and not job.preempt_requested and job.queue != STANDBY_QUEUE])


def _check_capacity(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    """Slots: the plan only adds jobs in flight where the capacity leaves room."""
    if plan.capacity_slots is None:
        return
    moves: list[Requeue | Retarget] = [*plan.requeues, *plan.retargets]
    restored = {r.job_id for r in moves if r.from_queue == STANDBY_QUEUE}
    added = {r.job_id for r in plan.releases} | restored
    if not added:
        return
    removed = {*plan.preempt, *plan.standby, *(e.job_id for e in plan.expire)}
    if any(r.batch is not None for r in plan.releases) or any(
            job.batch_id is not None for job in jobs.values()):
        _check_slots(plan, jobs, added, removed)
        return
    # |(before - removed) | added|, counted without building the set of every job in flight
    kept = _count_in_flight(jobs.values()) - _count_in_flight(
        jobs[job_id] for job_id in removed if job_id in jobs)
    already = _count_in_flight(
        jobs[job_id] for job_id in added if job_id not in removed and job_id in jobs)
    after = kept + len(added) - already
    if after > plan.capacity_slots:
        _fail(f"{after} jobs in flight after the plan, capacity {plan.capacity_slots}")


def _check_slots(plan: TickPlan, jobs: Mapping[str, JobView], added: set[str],
                 removed: set[str]) -> None:
    """Slots with step-level batching: a batch in flight, or one released, takes one slot
    however many jobs it carries (a job joining a batch in flight takes none)."""
    slots = {job.batch_id or job.job_id for job in jobs.values()
             if _in_flight(job) and job.job_id not in removed}
    batch_of = {r.job_id: r.batch for r in plan.releases}
    slots.update(batch_of.get(job_id) or job_id for job_id in added)
    if len(slots) > (plan.capacity_slots or 0):
        _fail(f"{len(slots)} slots in flight after the plan, capacity {plan.capacity_slots}")


def _check_workers(plan: TickPlan, snapshot: ClusterSnapshot) -> None:
    alive = {w.name for w in snapshot.workers if w.alive}
    if set(plan.worker_queues) != alive:
        _fail("worker_queues must name exactly the alive workers")
    if not plan.reserved_workers <= alive or (alive and plan.reserved_workers == alive
                                              and len(alive) > 1):
        _fail("reserved workers must be alive, and never all of several")
    for name in plan.reserved_workers:
        if plan.worker_queues[name] != RESERVE_WORKER_QUEUES:
            _fail(f"reserved worker {name} consumes {plan.worker_queues[name]}")


def _check_origin(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    if plan.origin_id is None:
        return
    origin = jobs.get(plan.origin_id)
    if origin is None or origin.state.is_terminal:
        _fail(f"origin {plan.origin_id} is not a live job")
    if plan.origin_id in plan.preempt or plan.origin_id in {e.job_id for e in plan.expire}:
        _fail(f"origin {plan.origin_id} is preempted or expired by its own plan")


def _check_policy_bounds(plan: TickPlan, jobs: Mapping[str, JobView],
                         policy: PolicyConfig) -> None:
    over = [job_id for job_id in plan.preempt if jobs[job_id].preemptions >= policy.max_preemptions]
    if over:
        _fail(f"jobs preempted past the bound {policy.max_preemptions}: {over[:5]}")
    converging = plan.admission.state is AdmissionState.CONVERGING
    if converging and plan.capacity_slots is not None and any(
            r.queue == BATCH_QUEUE for r in plan.releases):
        _fail("batch work released during overload convergence")
