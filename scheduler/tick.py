"""plan_tick: the one entry point of the policy — a snapshot in, a TickPlan out, no side effects."""

from __future__ import annotations

from scheduler.baselines import plan_fifo, plan_priority
from scheduler.invariants import check_plan_invariants
from scheduler.model import ClusterSnapshot
from scheduler.plan import TickPlan
from scheduler.policy import PolicyConfig, PolicyKind
from scheduler.stepline import plan_stepline

__all__ = ["check_plan_invariants", "plan_tick"]


def plan_tick(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """Plan one tick under ``policy.policy``; ``now_s`` is on the clock of the snapshot's times."""
    if policy.policy is PolicyKind.FIFO:
        return plan_fifo(snapshot, policy, now_s)
    if policy.policy is PolicyKind.PRIORITY:
        return plan_priority(snapshot, policy, now_s)
    return plan_stepline(snapshot, policy, now_s)
