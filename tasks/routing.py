"""Queue and task names, and how a class maps to its queue: defined here once."""

from __future__ import annotations

from scheduler.lifecycle import SloClass

TICK_TASK = "scheduler.tick"
CHUNK_TASK = "stepline.chunk"
BATCH_TASK = "stepline.batch"
"""Several jobs' next chunks in one task, run as one batched forward (step-level batching)."""

REALTIME, INTERACTIVE, BATCH, CONTROL, STANDBY = (
    "realtime", "interactive", "batch", "control", "standby",
)
ALL_QUEUES = (REALTIME, INTERACTIVE, BATCH, CONTROL, STANDBY)
WORK_QUEUES = (REALTIME, INTERACTIVE, BATCH, STANDBY)
"""What a normal worker consumes, in strict priority order."""

CLASS_QUEUE = {
    SloClass.REALTIME: REALTIME, SloClass.INTERACTIVE: INTERACTIVE, SloClass.BATCH: BATCH,
}
FIFO_QUEUE = BATCH
"""Under the fifo baseline every job is one atomic task on this one queue."""

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
