"""Queue names, and which queues a worker consumes in which role."""

from __future__ import annotations

REALTIME_QUEUE = "realtime"
INTERACTIVE_QUEUE = "interactive"
BATCH_QUEUE = "batch"
STANDBY_QUEUE = "standby"

LEVEL_QUEUES: tuple[str, str, str] = (REALTIME_QUEUE, INTERACTIVE_QUEUE, BATCH_QUEUE)
"""MLFQ level → queue: level 0 is realtime, 1 interactive, 2 batch."""

JOB_QUEUES = frozenset({*LEVEL_QUEUES, STANDBY_QUEUE})
"""Every queue a job's chunk may be published to."""

NORMAL_WORKER_QUEUES: tuple[str, ...] = (*LEVEL_QUEUES, STANDBY_QUEUE)
"""A normal worker's queues in strict priority order (``queue_order_strategy=priority``)."""

RESERVE_WORKER_QUEUES: tuple[str, ...] = (REALTIME_QUEUE,)
"""A reserved worker consumes only realtime work (origin jobs are released there too)."""

LEVELS = range(len(LEVEL_QUEUES))
LOWEST_LEVEL = len(LEVEL_QUEUES) - 1


def queue_for_level(level: int) -> str:
    """The queue a job at MLFQ ``level`` is published to."""
    return LEVEL_QUEUES[level]
