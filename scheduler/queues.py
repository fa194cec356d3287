"""Queue names, the class each serves, and which queues a worker consumes in which role: the one
definition every layer (the tick, the submit path, workers, the simulator) reads."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from scheduler.lifecycle import SloClass

REALTIME_QUEUE = "realtime"
INTERACTIVE_QUEUE = "interactive"
BATCH_QUEUE = "batch"
STANDBY_QUEUE = "standby"
CONTROL_QUEUE = "control"
"""The scheduler workers' queue: ticks run there, never job chunks."""

LEVEL_QUEUES: tuple[str, str, str] = (REALTIME_QUEUE, INTERACTIVE_QUEUE, BATCH_QUEUE)
"""MLFQ level → queue: level 0 is realtime, 1 interactive, 2 batch."""

CLASS_QUEUE: Mapping[SloClass, str] = MappingProxyType({
    SloClass.REALTIME: REALTIME_QUEUE, SloClass.INTERACTIVE: INTERACTIVE_QUEUE,
    SloClass.BATCH: BATCH_QUEUE,
})
"""The queue a class's work is submitted to (its level's queue: ``LEVEL_QUEUES[cls.rank]``)."""

FIFO_QUEUE = BATCH_QUEUE
"""Under the fifo baseline every job is one atomic task on this one queue."""

JOB_QUEUES = frozenset({*LEVEL_QUEUES, STANDBY_QUEUE})
"""Every queue a job's chunk may be published to."""

NORMAL_WORKER_QUEUES: tuple[str, ...] = (*LEVEL_QUEUES, STANDBY_QUEUE)
"""A normal worker's queues in strict priority order (``queue_order_strategy=priority``)."""

RESERVE_WORKER_QUEUES: tuple[str, ...] = (REALTIME_QUEUE,)
"""A reserved worker consumes only realtime work (origin jobs are released there too)."""

ALL_QUEUES: tuple[str, ...] = (*LEVEL_QUEUES, CONTROL_QUEUE, STANDBY_QUEUE)
"""Every queue the broker carries."""

LEVELS = range(len(LEVEL_QUEUES))
LOWEST_LEVEL = len(LEVEL_QUEUES) - 1


def queue_for_level(level: int) -> str:
    """The queue a job at MLFQ ``level`` is published to."""
    return LEVEL_QUEUES[level]
