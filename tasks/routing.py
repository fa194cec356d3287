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
    "AFFINITY_CLASSES",
    "ALL_QUEUES",
    "BATCH",
    "BATCH_TASK",
    "CHUNK_TASK",
    "CLASS_QUEUE",
    "CONTROL",
    "FIFO_QUEUE",
    "INTERACTIVE",
    "OWN_QUEUE_CLASSES",
    "PLACED",
    "REALTIME",
    "STANDBY",
    "TICK_TASK",
    "WORK_QUEUES",
    "affinity_queue",
    "affinity_worker",
    "class_queue_of",
    "hop_worker",
    "placed_queue",
    "replaced_from",
    "with_affinity",
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
chunk wants the first free worker."""
OWN_QUEUE_CLASSES = (*AFFINITY_CLASSES, STANDBY)
"""Class queues with a worker's own queue in front: the affinity classes, and standby for a
job on a model that the tick moves to standby while it waits on a worker holding its model
(``<worker>.standby``: it stays there, behind everything else the worker has, rather than
paying a load elsewhere when it comes back)."""


def affinity_queue(worker: str, class_queue: str) -> str:
    """``<worker>.<class>``: the queue only ``worker`` consumes, right before ``class_queue``:
    the next chunks of the jobs it runs (their hops)."""
    return f"{worker}.{class_queue}"


PLACED = "placed"
"""The last part of a placement queue's name (:func:`placed_queue`)."""


def placed_queue(worker: str, class_queue: str) -> str:
    """``<worker>.<class>.placed``: where placement by model residency parks a job's chunk for
    ``worker``, consumed after the worker's own queue for the class (the next chunks of the jobs
    it runs) and before the class queue. A job placed on a busy worker that holds its model
    waits there for the jobs the worker runs to finish rather than sharing it chunk by chunk."""
    return f"{affinity_queue(worker, class_queue)}.{PLACED}"


def replaced_from(worker: str, class_queue: str) -> str:
    """The queue ``worker`` would take a chunk of ``class_queue`` from once placement puts it
    anew there: its placement queue for a class with one, else the class queue itself (the
    shared standby queue)."""
    return placed_queue(worker, class_queue) if class_queue in AFFINITY_CLASSES else class_queue


def _split(queue: str) -> tuple[str, str] | None:
    """(worker, class) of a worker's own queue (affinity, standby or placement), None for
    others."""
    head, dot, tail = queue.rpartition(".")
    classes: tuple[str, ...] = OWN_QUEUE_CLASSES
    if dot and tail == PLACED:
        head, dot, tail = head.rpartition(".")
        classes = AFFINITY_CLASSES
    return (head, tail) if dot and head and tail in classes else None


def affinity_worker(queue: str) -> str | None:
    """The worker whose own queue ``queue`` is, affinity or placement (None for a class
    queue)."""
    parts = _split(queue)
    return None if parts is None else parts[0]


def hop_worker(queue: str) -> str | None:
    """The worker whose own queue for the next chunks of the jobs it runs ``queue`` is
    (``<worker>.<class>``, ``<worker>.standby``: the worker that ran the job's last chunk);
    None for a placement queue (a chunk placed there to start) or a class queue."""
    return None if queue.rpartition(".")[2] == PLACED else affinity_worker(queue)


def class_queue_of(queue: str) -> str:
    """The class queue behind ``queue`` (itself for a class queue)."""
    parts = _split(queue)
    return queue if parts is None else parts[1]


def with_affinity(worker: str, queues: tuple[str, ...]) -> tuple[str, ...]:
    """``queues`` with the worker's own queues right before each class that has them:
    ``realtime, w.interactive, w.interactive.placed, interactive, w.batch, w.batch.placed,
    batch, w.standby, standby`` keeps class priority."""
    expanded: list[str] = []
    for queue in queues:
        if queue in OWN_QUEUE_CLASSES:
            expanded.append(affinity_queue(worker, queue))
        if queue in AFFINITY_CLASSES:
            expanded.append(placed_queue(worker, queue))
        expanded.append(queue)
    return tuple(expanded)
