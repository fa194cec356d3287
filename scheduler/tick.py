"""plan_tick: the one entry point of the policy — a snapshot in, a TickPlan out, no side effects."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from scheduler.baselines import plan_edf, plan_fifo, plan_least_slack, plan_priority, plan_srpt
from scheduler.invariants import check_plan_invariants
from scheduler.model import ClusterSnapshot, JobView
from scheduler.plan import TickPlan
from scheduler.planner import plan_stepline
from scheduler.policy import PolicyConfig, PolicyKind
from scheduler.queues import STANDBY_QUEUE
from scheduler.recovery import Failure, plan_recoveries

__all__ = ["check_plan_invariants", "plan_tick"]


def plan_tick(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Plan one tick under ``policy.policy``; ``now_s`` is on the clock of the snapshot's times.

    Recovery comes first (lost, stuck, unpublished and parked chunks; jobs that can never run).
    The policy still sees the jobs it moves (a requeued chunk keeps its slot) but takes no
    action on them this tick."""
    return with_recoveries(snapshot, policy, now_s, _plan_policy(snapshot, policy, now_s),
                           snapshot.jobs)


def with_recoveries(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float,
                    plan: TickPlan, jobs: Iterable[JobView]) -> TickPlan:
    """The policy's ``plan`` with this tick's recoveries and failures, and no action on the jobs
    they move. ``jobs``: the snapshot's jobs in order, or those of them that recovery may act on
    (QUEUED or RUNNING, or PENDING with a failed dependency)."""
    alive = frozenset(w.name for w in snapshot.workers if w.alive)
    recoveries, failures = plan_recoveries(jobs, alive, snapshot.cost, policy.recovery, now_s,
                                           snapshot.workers)
    failures += tuple(Failure(job_id, f"unreadable record: {problem}")
                      for job_id, problem in snapshot.unreadable)
    moving = {r.job_id for r in recoveries} | {f.job_id for f in failures}
    if not moving:
        return plan
    return replace(_without(plan, moving), recoveries=recoveries, failures=failures)


def _without(plan: TickPlan, moving: set[str]) -> TickPlan:
    """``plan`` with no action on the jobs in ``moving``. If the policy freed a slot by taking
    one of them out of flight (preempt, standby, suspend, expire), what it put in that slot
    waits for the next tick too: the recovered job still holds it."""
    freed = moving & {*plan.preempt, *plan.standby, *plan.suspend,
                      *(e.job_id for e in plan.expire)}
    keep_adding = not freed or plan.capacity_slots is None
    return replace(
        plan,
        releases=tuple(r for r in plan.releases if r.job_id not in moving and keep_adding),
        requeues=tuple(r for r in plan.requeues if r.job_id not in moving
                       and (keep_adding or r.from_queue != STANDBY_QUEUE)),
        retargets=tuple(r for r in plan.retargets if r.job_id not in moving),
        preempt=tuple(j for j in plan.preempt if j not in moving),
        suspend=tuple(j for j in plan.suspend if j not in moving),
        standby=tuple(j for j in plan.standby if j not in moving),
        expire=tuple(e for e in plan.expire if e.job_id not in moving),
    )


_BASELINES = {PolicyKind.FIFO: plan_fifo, PolicyKind.PRIORITY: plan_priority,
              PolicyKind.EDF: plan_edf, PolicyKind.SRPT: plan_srpt,
              PolicyKind.LEAST_SLACK: plan_least_slack}


def _plan_policy(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    baseline = _BASELINES.get(policy.policy)
    if baseline is not None:
        return baseline(snapshot, policy, now_s)
    return plan_stepline(snapshot, policy, now_s)
