"""The reserve: a share of workers that consume only the realtime queue while it is needed."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from scheduler.lifecycle import SloClass
from scheduler.model import WorkerView
from scheduler.ordering import Order
from scheduler.policy import PolicyConfig
from scheduler.queues import NORMAL_WORKER_QUEUES, RESERVE_WORKER_QUEUES
from scheduler.state import PolicyState


def reserve_size(alive_workers: int, ratio: float) -> int:
    """ceil(ratio × workers), but at least one worker always stays unreserved so other work
    can run at all (one worker alone is never reserved)."""
    if alive_workers < 2 or ratio <= 0:
        return 0
    return min(math.ceil(round(ratio * alive_workers, 9)), alive_workers - 1)


def reserve_until_s(pressure: bool, previous_until_s: float | None, policy: PolicyConfig,
                    now_s: float) -> float | None:
    """Pressure (origin or realtime work live) extends the hold; without it the hold runs out."""
    if pressure:
        return now_s + policy.reserve_hold_s
    return previous_until_s


def choose_reserved(alive: Sequence[WorkerView], count: int, previous: Collection[str],
                    urgent_jobs: Collection[str]) -> frozenset[str]:
    """``count`` workers to reserve: last tick's first (no consumer churn), then idle ones or
    those already running urgent work (nothing else is displaced), then by name."""
    def rank(worker: WorkerView) -> tuple[bool, bool, str]:
        serves_urgent = worker.busy_job is None or worker.busy_job in urgent_jobs
        return (worker.name not in previous, not serves_urgent, worker.name)

    return frozenset(w.name for w in sorted(alive, key=rank)[:count])


def worker_queues(alive: Sequence[WorkerView],
                  reserved: Collection[str]) -> dict[str, tuple[str, ...]]:
    """Each alive worker's queues in strict priority order."""
    return {w.name: RESERVE_WORKER_QUEUES if w.name in reserved else NORMAL_WORKER_QUEUES
            for w in alive}


@dataclass(frozen=True, slots=True)
class Reserve:
    """The tick's reserve: the workers held for realtime work (none while it is lent out)."""

    workers: frozenset[str]
    reason: str | None
    """Why the reserve is held (None: lent out)."""
    until_s: float | None
    """How long the hold lasts without new pressure."""


def hold_reserve(order: Order, staying: Sequence[int], previous: PolicyState,
                 policy: PolicyConfig, now_s: float,
                 realtime_slack: tuple[bool, float] | None = None) -> Reserve:
    """Reserved workers consume only realtime work. The reserve is lent out — other work runs
    on every worker, and realtime work reclaims it by preemption — unless a block group of the
    lent work outlasts the slack of the realtime work in sight: then preemption would come too
    late, and the reserve is held (idle if need be)."""
    live, levels = order.survey.live, order.levels
    realtime, budget_s = realtime_slack or _realtime_slack(order)
    pressure = levels.origin is not None or realtime
    until_s = reserve_until_s(pressure, previous.reserve_until_s, policy, now_s)
    yield_s = _yield_s(order, staying)
    reason: str | None = None
    if realtime and yield_s > budget_s:
        reason = (f"a block group of lent work takes ~{yield_s * 1e3:.0f} ms, "
                  f"realtime work has ~{max(budget_s, 0.0) * 1e3:.0f} ms of "
                  "slack: preemption would come too late")
    elif previous.reserved_workers and until_s is not None and now_s < until_s:
        reason = "held after realtime work that preemption could not serve"
    if reason is None:
        return Reserve(frozenset(), None, None)
    urgent_running = {live[i].job_id for i in staying if levels.level(i) == 0}
    count = reserve_size(len(order.alive), policy.resource_reserve_ratio)
    return Reserve(choose_reserved(order.alive, count, previous.reserved_workers, urgent_running),
                   reason, until_s)


def _realtime_slack(order: Order) -> tuple[bool, float]:
    """Whether realtime work (not demoted) is live, and the least positive slack it arrived
    with (realtime work with no slack at all is beyond any reserve's help)."""
    live, demoted = order.survey.live, order.judgement.demoted
    realtime = [i for i in range(len(live))
                if live[i].slo_class is SloClass.REALTIME and i not in demoted]
    budget_s = min((slack_s for i in realtime if (slack_s := _arrival_slack_s(order, i)) > 0),
                   default=math.inf)
    return bool(realtime), budget_s


def _yield_s(order: Order, staying: Sequence[int]) -> float:
    """How long the slowest in-flight non-realtime job takes to yield: one block group of its
    next chunk."""
    live, levels, ranking = order.survey.live, order.levels, order.ranking
    worst = 0.0
    for i in staying:
        if levels.level(i) > 0:
            worst = max(worst, ranking.chunk_s(i) / max(live[i].block_groups, 1))
    return worst


def _arrival_slack_s(order: Order, i: int) -> float:
    """A job's slack when it arrived: its deadline budget less its whole estimated work."""
    job = order.survey.live[i]
    return job.deadline_s - job.submitted_at_s - job.service_s - order.survey.remaining_s[i]
