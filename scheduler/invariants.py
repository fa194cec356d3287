"""check_plan_invariants: the rules every TickPlan keeps, checked against its snapshot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from scheduler.errors import PlanInvariantViolated
from scheduler.lifecycle import TRANSITIONS, JobState
from scheduler.model import ClusterSnapshot, JobView
from scheduler.plan import Requeue, Retarget, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import BATCH_QUEUE, JOB_QUEUES, LEVELS, RESERVE_WORKER_QUEUES, STANDBY_QUEUE
from scheduler.state import AdmissionState

_S = JobState
_RELEASABLE = frozenset({_S.PENDING, _S.PREEMPTED, _S.SUSPENDED})


def check_plan_invariants(plan: TickPlan, snapshot: ClusterSnapshot,
                          policy: PolicyConfig | None = None) -> None:
    """Raise :class:`PlanInvariantViolated` naming the first rule ``plan`` breaks; with
    ``policy``, also check the preemption bound and overload rules."""
    jobs = {job.job_id: job for job in snapshot.jobs}
    _check_disjoint(plan)
    _check_actions(plan, jobs)
    _check_capacity(plan, jobs)
    _check_workers(plan, snapshot)
    _check_origin(plan, jobs)
    if policy is not None:
        _check_policy_bounds(plan, jobs, policy)


def _fail(rule: str) -> None:
    raise PlanInvariantViolated(f"plan breaks an invariant: {rule}")


def _acted_on(plan: TickPlan) -> list[str]:
    return [*(r.job_id for r in plan.releases), *(r.job_id for r in plan.requeues),
            *(r.job_id for r in plan.retargets), *plan.preempt, *plan.suspend, *plan.standby,
            *(e.job_id for e in plan.expire)]


def _check_disjoint(plan: TickPlan) -> None:
    twice = [job_id for job_id, n in Counter(_acted_on(plan)).items() if n > 1]
    if twice:
        _fail(f"jobs acted on twice in one plan: {sorted(twice)[:5]}")


def _check_actions(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    moves = [*((r.job_id, _S.QUEUED, r.queue) for r in plan.releases),
             *((job_id, _S.PREEMPTED, None) for job_id in plan.preempt),
             *((job_id, _S.SUSPENDED, None) for job_id in plan.suspend),
             *((e.job_id, _S.EXPIRED, None) for e in plan.expire)]
    for job_id, target, queue in moves:
        job = jobs.get(job_id)
        if job is None or target not in TRANSITIONS[job.state]:
            _fail(f"job {job_id} cannot move to {target.value} from "
                  f"{job.state.value if job else 'nowhere'}")
        if queue is not None and queue not in JOB_QUEUES:
            _fail(f"job {job_id} released to unknown queue {queue!r}")
    if any(jobs[r.job_id].state not in _RELEASABLE for r in plan.releases):
        _fail("only PENDING, PREEMPTED or SUSPENDED jobs may be released")
    _check_moves(plan, jobs)


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
        if jobs[job_id].state is not _S.RUNNING or jobs[job_id].preempt_requested:
            _fail(f"job {job_id} preempted but not running, or already flagged")
    for job_id in plan.standby:
        job = jobs.get(job_id)
        if job is None or job.state not in (_S.QUEUED, _S.RUNNING) or job.queue == STANDBY_QUEUE:
            _fail(f"job {job_id} sent to standby from where it cannot go")
    if any(level not in LEVELS for level in (m.level for m in plan.levels.values())):
        _fail("a level outside the MLFQ's levels")


def _in_flight(job: JobView) -> bool:
    return (job.state in (_S.QUEUED, _S.RUNNING) and not job.preempt_requested
            and job.queue != STANDBY_QUEUE)


def _check_capacity(plan: TickPlan, jobs: Mapping[str, JobView]) -> None:
    """Slots: the plan only adds jobs in flight where the capacity leaves room."""
    if plan.capacity_slots is None:
        return
    before = {job_id for job_id, job in jobs.items() if _in_flight(job)}
    removed = {*plan.preempt, *plan.standby, *(e.job_id for e in plan.expire)}
    moves: list[Requeue | Retarget] = [*plan.requeues, *plan.retargets]
    restored = {r.job_id for r in moves if r.from_queue == STANDBY_QUEUE}
    added = {r.job_id for r in plan.releases} | restored
    after = (before - removed) | added
    if added and len(after) > plan.capacity_slots:
        _fail(f"{len(after)} jobs in flight after the plan, capacity {plan.capacity_slots}")


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
