"""Expert and checkpoint affinity: a job's next chunk goes to the worker that ran its last one
(``<worker>.<class>``, consumed right before the class queue), a new text job to an idle worker
whose resident experts fit its model; a chunk parked too long moves back to its class queue.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.settings import Settings
from app.store import JobStore
from scheduler.lifecycle import JobState
from tasks.context import WORKER_KEY
from tasks.dispatch import release
from tasks.routing import (
    AFFINITY_CLASSES,
    affinity_queue,
    affinity_worker,
    class_queue_of,
    with_affinity,
)

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


def hop_queue(settings: Settings, worker: str, consuming: Iterable[str], kind: str,
              queue: str) -> str:
    """Where this worker publishes a job's next chunk: its own queue for the job's class when
    it consumes that queue now (a reserved worker does not), else the class queue."""
    class_queue = class_queue_of(queue)
    if not applies(settings, kind, class_queue):
        return class_queue
    mine = affinity_queue(worker, class_queue)
    return mine if mine in set(consuming) else class_queue


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

    bodies: dict[str, dict[str, Any]]
    picked: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, store: JobStore) -> WorkerDirectory:
        keys = sorted(store.redis.scan_iter(WORKER_KEY + "*", count=1000))
        raws = store.redis.mget(keys) if keys else []
        bodies = {}
        for raw in raws:
            if raw is not None:
                body = json.loads(raw)
                bodies[body["name"]] = body
        return cls(bodies)

    @property
    def alive(self) -> set[str]:
        return set(self.bodies)

    def best_fit(self, model: str, class_queue: str, min_fit: float) -> str | None:
        """The idle worker consuming its affinity queue for ``class_queue`` whose resident
        experts best cover ``model``'s most frequent experts (merged over every worker's
        routing history), if that fit reaches ``min_fit``."""
        from workers.moe.expert_cache import residency_fit, signature_from_masks

        expected = self._expected_experts(model)
        best: tuple[float, str] | None = None
        for name, body in self.bodies.items():
            summary = body.get("experts", {}).get(model)
            idle = body.get("busy_job") is None and name not in self.picked
            consumes = affinity_queue(name, class_queue) in body.get("queues", ())
            if summary is None or not idle or not consumes:
                continue
            fit = residency_fit(signature_from_masks(summary["resident"]), expected)
            if fit >= min_fit and (best is None or (fit, name) > best):
                best = (fit, name)
        if best is None:
            return None
        self.picked.add(best[1])
        return best[1]

    def _expected_experts(self, model: str) -> dict[tuple[int, int], float]:
        expected: dict[tuple[int, int], float] = {}
        for body in self.bodies.values():
            for layer, expert, share in body.get("experts", {}).get(model, {}).get("hot", ()):
                key = (int(layer), int(expert))
                expected[key] = expected.get(key, 0.0) + float(share)
        return expected


def release_queue(settings: Settings, fields: Mapping[str, str], class_queue: str,
                  directory: WorkerDirectory | None) -> str:
    """The queue a job's release goes to: for the first chunk of a text job, the affinity queue
    of the idle worker whose experts fit best; otherwise ``class_queue``."""
    if (directory is None or fields.get("kind") != "text" or fields.get("next_chunk") != "0"
            or fields.get("atomic") == "1"
            or not applies(settings, "text", class_queue)):
        return class_queue
    model = json.loads(fields.get("params", "{}")).get("model")
    worker = directory.best_fit(str(model), class_queue, settings.affinity.prefill_min_fit)
    return affinity_queue(worker, class_queue) if worker else class_queue


# the tick side --------------------------------------------------------------------------------
def requeue_parked(store: JobStore, jobs: list[dict[str, str]], now_s: float,
                   max_wait_s: float) -> list[str]:
    """QUEUED jobs waiting in an affinity queue longer than ``max_wait_s``, or whose worker's
    heartbeat is gone, move to their class queue under a new epoch (the parked message is then
    stale). Updates ``jobs`` in place; returns the moved ids."""
    parked = [f for f in jobs if f["state"] == JobState.QUEUED.value
              and affinity_worker(f.get("queue", "")) is not None]
    if not parked:
        return []
    alive = WorkerDirectory.read(store).alive
    moved = []
    for fields in parked:
        worker = affinity_worker(fields["queue"])
        waited_s = now_s - float(fields.get("queued_at") or 0.0)
        if waited_s < max_wait_s and worker in alive:
            continue
        target = class_queue_of(fields["queue"])
        why = "gone" if worker not in alive else f"busy for {waited_s * 1000:.0f} ms"
        if release(store, fields["id"], queue=target, by="scheduler", bump_epoch=True,
                   reason=f"affinity: {worker} {why}; moved to {target}"):
            log.info("job %s: left %s (%s) for %s", fields["id"], fields["queue"], why, target)
            fields.update(queue=target, epoch=str(int(fields["epoch"]) + 1),
                          queued_at=repr(time.time()))
            moved.append(fields["id"])
    return moved


def expand_worker_queues(settings: Settings,
                         wanted: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The plan's per-worker queues with each worker's affinity queues placed in front of their
    classes (a reserved worker consumes only realtime, so it gets none)."""
    if not settings.affinity.enabled:
        return dict(wanted)
    return {worker: with_affinity(worker, tuple(queues)) for worker, queues in wanted.items()}
