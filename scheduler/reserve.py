"""The reserve: a share of workers that consume only the realtime queue while it is needed."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from scheduler.model import WorkerView
from scheduler.policy import PolicyConfig
from scheduler.queues import NORMAL_WORKER_QUEUES, RESERVE_WORKER_QUEUES


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
