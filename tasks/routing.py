"""Task names, and the queue names the tasks layer uses (defined once, in ``scheduler.queues``)."""

from __future__ import annotations

from scheduler.queues import (
    ALL_QUEUES,
    BATCH_QUEUE,
    CLASS_QUEUE,
    CONTROL_QUEUE,
    FIFO_QUEUE,
    INTERACTIVE_QUEUE,
    NORMAL_WORKER_QUEUES,
    REALTIME_QUEUE,
    STANDBY_QUEUE,
)

__all__ = [
    "AFFINITY_CLASSES", "ALL_QUEUES", "BATCH", "BATCH_TASK", "CHUNK_TASK", "CLASS_QUEUE",
    "CONTROL", "FIFO_QUEUE", "INTERACTIVE", "REALTIME", "STANDBY", "TICK_TASK", "WORK_QUEUES",
    "affinity_queue", "affinity_worker", "class_queue_of", "with_affinity",
]

TICK_TASK = "scheduler.tick"
CHUNK_TASK = "stepline.chunk"
BATCH_TASK = "stepline.batch"
"""Several jobs' next chunks in one task, run as one batched forward (step-level batching)."""

REALTIME, INTERACTIVE, BATCH, CONTROL, STANDBY = (
    REALTIME_QUEUE, INTERACTIVE_QUEUE, BATCH_QUEUE, CONTROL_QUEUE, STANDBY_QUEUE,
)
WORK_QUEUES = NORMAL_WORKER_QUEUES
"""What a normal worker consumes, in strict priority order."""

AFFINITY_CLASSES = (INTERACTIVE, BATCH)
"""Class queues with a per-worker affinity queue in front of them. Not realtime: a realtime
chunk wants the first free worker; not standby: parked work has no worker to return to."""


def affinity_queue(worker: str, class_queue: str) -> str:
    """``<worker>.<class>``: the queue only ``worker`` consumes, right before ``class_queue``."""
    return f"{worker}.{class_queue}"


def affinity_worker(queue: str) -> str | None:
    """The worker an affinity queue belongs to (None for a class queue)."""
    worker, dot, tail = queue.rpartition(".")
    return worker if dot and worker and tail in AFFINITY_CLASSES else None


def class_queue_of(queue: str) -> str:
    """The class queue behind ``queue`` (itself for a class queue)."""
    return queue.rpartition(".")[2] if affinity_worker(queue) is not None else queue


def with_affinity(worker: str, queues: tuple[str, ...]) -> tuple[str, ...]:
    """``queues`` with the worker's affinity queue right before each class that has one:
    ``realtime, w.interactive, interactive, w.batch, batch, standby`` keeps class priority."""
    expanded: list[str] = []
    for queue in queues:
        if queue in AFFINITY_CLASSES:
            expanded.append(affinity_queue(worker, queue))
        expanded.append(queue)
    return tuple(expanded)
