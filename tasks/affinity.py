"""Expert and checkpoint affinity: a job's next chunk goes to the worker that ran its last one
(``<worker>.<class>``, consumed right before the class queue), a new text job to an idle worker
whose resident experts fit its model. A chunk parked too long is the tick's to move back to its
class queue (``scheduler.recovery``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.model import JobKind
from tasks.heartbeat import Heartbeat
from tasks.record import JobRecord
from tasks.routing import (
    AFFINITY_CLASSES,
    affinity_queue,
    affinity_worker,
    with_affinity,
)
from tasks.settings import Settings
from tasks.store import JobStore

log = logging.getLogger(__name__)


def applies(settings: Settings, kind: str, class_queue: str) -> bool:
    """Whether a chunk of ``kind`` headed for ``class_queue`` may go to an affinity queue."""
    a = settings.affinity
    return a.enabled and kind in a.kinds and class_queue in AFFINITY_CLASSES


# the worker side ------------------------------------------------------------------------------
def consume_in_affinity_order(consumer: Any, worker: str) -> tuple[str, ...]:
    """Make ``consumer`` take its queues as ``realtime, <w>.interactive, interactive, <w>.batch,
    batch, standby``. Kombu's redis transport (``queue_order_strategy=priority``) reads queues in
    the order they were added, so the queues after the first change are cancelled and re-added
    in order. Returns the queues now consumed."""
    current = tuple(q.name for q in consumer.task_consumer.queues)
    wanted = with_affinity(worker, tuple(q for q in current if affinity_worker(q) is None))
    keep = common_prefix(current, wanted)
    for queue in current[len(keep):]:
        consumer.cancel_task_queue(queue)
    for queue in wanted[len(keep):]:
        consumer.add_task_queue(queue)  # an unknown name gets its own direct exchange
    return wanted


def hop_queues(settings: Settings, worker: str, consuming: Iterable[str],
               kind: str) -> dict[str, str]:
    """Where this worker publishes a job's next chunk, per class queue: its own queue for the
    class when affinity applies and it consumes that queue now (a reserved worker does not);
    a class missing from the map hops to its class queue. The commit picks the entry of the
    job's class as it stands at commit time (the scheduler may have changed it)."""
    mine = set(consuming)
    return {cls: affinity_queue(worker, cls) for cls in AFFINITY_CLASSES
            if applies(settings, kind, cls) and affinity_queue(worker, cls) in mine}


def common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    prefix: list[str] = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        prefix.append(x)
    return tuple(prefix)


# the first chunk ------------------------------------------------------------------------------
@dataclass
class WorkerDirectory:
    """The alive workers' heartbeats, read once and used for several release decisions."""

    bodies: dict[str, Heartbeat]
    picked: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, store: JobStore) -> WorkerDirectory:
        return cls(store.heartbeats())

    @property
    def alive(self) -> set[str]:
        return set(self.bodies)

    def best_fit(self, model: str, class_queue: str, min_fit: float) -> str | None:
        """The idle worker consuming its affinity queue for ``class_queue`` whose resident
        experts best cover ``model``'s most frequent experts (merged over every worker's
        routing history), if that fit reaches ``min_fit``."""
        from workers.moe.expert_cache import (  # deferred: loads torch
            residency_fit,
            signature_from_masks,
        )

        expected = self._expected_experts(model)
        fits = [(residency_fit(signature_from_masks(summary["resident"]), expected), name)
                for name, beat in self._idle(class_queue)
                if (summary := beat.experts.get(model)) is not None]
        return self._take(max((fit for fit in fits if fit[0] >= min_fit), default=None))

    def warm_idle(self, model: str, class_queue: str) -> str | None:
        """An idle worker consuming its affinity queue for ``class_queue`` that holds diffusion
        model ``model`` in device memory: the one holding the fewest bytes (the least to lose
        to another model's load), by name on a tie. None when no idle worker holds it."""
        prefix = f"diffusion:{model}:"
        holders = [(beat.resident_bytes(), name) for name, beat in self._idle(class_queue)
                   if isinstance(held := beat.residency.get("device", {}), Mapping)
                   and any(str(key).startswith(prefix) for key in held)]
        return self._take(min(holders, default=None))

    def _idle(self, class_queue: str) -> Iterator[tuple[str, Heartbeat]]:
        """The workers free for a release to ``class_queue``: idle, not picked yet this time,
        and consuming their own queue for that class."""
        for name, beat in self.bodies.items():
            if beat.busy_job is None and name not in self.picked \
                    and affinity_queue(name, class_queue) in beat.queues:
                yield name, beat

    def _take(self, best: tuple[Any, str] | None) -> str | None:
        """The worker named by the winning (score, name) pair, marked picked."""
        if best is None:
            return None
        self.picked.add(best[1])
        return best[1]

    def _expected_experts(self, model: str) -> dict[tuple[int, int], float]:
        expected: dict[tuple[int, int], float] = {}
        for beat in self.bodies.values():
            for layer, expert, share in beat.experts.get(model, {}).get("hot", ()):
                key = (int(layer), int(expert))
                expected[key] = expected.get(key, 0.0) + float(share)
        return expected


WARM_KINDS = frozenset({JobKind.IMAGE, JobKind.VIDEO})
"""Kinds whose releases look for a worker holding their model (``affinity.warm_release``)."""


def needs_directory(settings: Settings, job: JobRecord) -> bool:
    """Whether :func:`release_queue` may consult the workers' heartbeats for ``job``."""
    return job.kind is JobKind.TEXT or (settings.affinity.warm_release
                                        and job.kind in WARM_KINDS)


def release_queue(settings: Settings, job: JobRecord, class_queue: str,
                  directory: WorkerDirectory | None) -> str:
    """The queue a job's release goes to: for the first chunk of a text job, the affinity queue
    of the idle worker whose experts fit best; for an image or video chunk, that of an idle
    worker holding its model (no load before its step); otherwise ``class_queue``. A chunk
    parked there while that worker turns busy moves back to its class queue after
    ``affinity.max_wait`` (the tick's recovery)."""
    a = settings.affinity
    if directory is None or job.atomic or not a.enabled or class_queue not in AFFINITY_CLASSES:
        return class_queue
    model = job.params.get("model")
    if job.kind is JobKind.TEXT:
        if job.next_chunk != 0 or not applies(settings, "text", class_queue):
            return class_queue
        worker = directory.best_fit(str(model), class_queue, a.prefill_min_fit)
    elif job.kind in WARM_KINDS and a.warm_release and model is not None:
        worker = directory.warm_idle(str(model), class_queue)
    else:
        return class_queue
    return affinity_queue(worker, class_queue) if worker else class_queue


def expand_worker_queues(settings: Settings,
                         wanted: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The plan's per-worker queues with each worker's affinity queues placed in front of their
    classes (a reserved worker consumes only realtime, so it gets none)."""
    if not settings.affinity.enabled:
        return dict(wanted)
    return {worker: with_affinity(worker, tuple(queues)) for worker, queues in wanted.items()}
