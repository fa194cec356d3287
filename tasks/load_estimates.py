"""Load times learned from the workers' heartbeats, and the loads waiting jobs expect from
them: :class:`LearnedLoads` is one process's estimates (its holder passes it to what reads or
places by them: the tick's :class:`ExpectedLoads`, the API's ``JobService``), and
:class:`ExpectedLoads` sets each waiting model job's ``JobView.load_s`` and its marks
(``model_left``, ``idle_holder``) from the records and heartbeats a tick read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot, JobKind, JobView
from scheduler.placement import (
    Holding,
    LoadEstimates,
    LoadTier,
    ModelNeed,
    PlacementPolicy,
    QueuedChunk,
    built_on,
    cold_load_s,
    expected_load_s,
    mark_moves,
)
from tasks.heartbeat import Heartbeat
from tasks.holdings import holding, model_need, resident_model
from tasks.record import JobRecord
from tasks.routing import CONTROL, OWN_QUEUE_CLASSES, class_queue_of, hop_worker, replaced_from
from tasks.settings import Settings


def observe_loads(estimates: LoadEstimates, beats: Iterable[Heartbeat]) -> None:
    """Fold the heartbeats' recent measured loads into ``estimates`` (each load once)."""
    for beat in beats:
        recent = beat.residency.get("recent")
        for load in recent if isinstance(recent, list) else ():
            if not isinstance(load, Mapping) or "at" not in load:
                continue
            model = resident_model(str(load.get("model", "")))
            tier = load.get("tier")
            if model is None or tier not in ("disk", "host", "adapter"):
                continue
            kind = model.split(":")[0]
            name = f"{kind}:{load.get('adapter')}" if tier == "adapter" else model
            estimates.observe_once(name, tier, float(load["s"]), float(load["at"]))


@dataclass(eq=False)
class LearnedLoads:
    """Load seconds one process learned from every worker's heartbeat (its measured loads,
    :func:`observe_loads`), and the lock its threads read and fold them under. Its holder
    keeps it across reads: the tick's :class:`ExpectedLoads` (the snapshot's ``reload_s``, the
    busy workers' load windows and the tick's placements read it too), the API's
    ``JobService`` (a submit's placements)."""

    estimates: LoadEstimates = field(default_factory=LoadEstimates)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def locked(self) -> Iterator[LoadEstimates]:
        """The estimates, held for a read or fold no other thread interleaves with."""
        with self._lock:
            yield self.estimates

    def observe(self, beats: Iterable[Heartbeat]) -> None:
        """Fold the heartbeats' recent measured loads in (each load once)."""
        with self._lock:
            observe_loads(self.estimates, beats)

    def reload_s(self, kind: JobKind | str, params: Mapping[str, Any]) -> float:
        """Seconds a worker not holding the job's model would spend loading it (0: a job on
        no model): ``JobView.reload_s``."""
        need = model_need(kind, params)
        if need is None:
            return 0.0
        with self._lock:
            return cold_load_s(need, self.estimates)

    def window_estimate(self, key: str, source: str) -> float:
        """Seconds an announced load of residency key ``key`` from ``source`` takes (an
        adapter load: the mean of the adapter loads measured; 0 for a key placement does not
        route by)."""
        model = resident_model(key)
        if model is None or source not in ("disk", "host", "adapter"):
            return 0.0
        tier = cast(LoadTier, source)
        name = f"{model.split(':')[0]}:?" if tier == "adapter" else model
        with self._lock:
            return self.estimates.estimate(name, tier)


@dataclass
class ExpectedLoads:
    """The tick's ``JobView.load_s``: per waiting job on a model, the load placement expects
    before its next chunk runs (none when a worker holds its model and adapters, else the
    cheapest load on any alive worker: :func:`scheduler.placement.expected_load_s`), so that
    its deadline, lateness and admission count a cold start, as the simulator's plans do; its
    ``model_left`` (:func:`model_left`: the worker it is parked on evicted its model) and its
    ``idle_holder`` (:func:`idle_holder_jobs`: it waits on a worker busy with another job while
    an idle one holds its model). Kept across ticks: a view whose load and marks did not
    change is handed out as the same object (the incremental planner finds its rows by
    identity)."""

    _views: dict[str, tuple[JobView, tuple[float, bool, bool], JobView]] = field(
        default_factory=dict)
    _needs: dict[str, tuple[JobRecord, ModelNeed | None]] = field(default_factory=dict)
    """Per job, its record as last seen and what it needs (kept while the record is)."""
    built: tuple[tuple[str, ModelNeed], ...] = ()
    """The last apply's chunks run since their worker's heartbeat: (worker, what the chunk
    needed), the models those workers hold though their heartbeats do not list them yet
    (:func:`scheduler.placement.built_on`); the tick's placements count them too."""
    learned: LearnedLoads = field(default_factory=LearnedLoads)
    """The load times the tick learned from the heartbeats, each apply's folded in (its
    snapshot reads, load windows and placements count by them too)."""

    def apply(self, settings: Settings, snapshot: ClusterSnapshot,
              records: Mapping[str, JobRecord], beats: Mapping[str, Heartbeat]
              ) -> ClusterSnapshot:
        """``snapshot`` with each waiting model job's ``load_s`` and marks set (only under
        the Stepline placement: the one that counts loads; a pass over the live jobs per
        tick)."""
        if not settings.affinity.enabled \
                or PlacementPolicy(settings.affinity.placement) is not PlacementPolicy.STEPLINE:
            self._views.clear()
            self._needs.clear()
            self.built = ()
            return snapshot
        heard = [holding(name, beat, 0.0) for name, beat in beats.items()
                 if CONTROL not in beat.queues]
        pending: list[tuple[int, ModelNeed]] = []
        ran: list[tuple[str, ModelNeed]] = []  # chunks run since their worker's heartbeat
        running: set[str] = set()  # workers running a chunk, as the snapshot has it
        parked_on: set[str] = set()  # workers a queued chunk waits on
        needs: dict[str, tuple[JobRecord, ModelNeed | None]] = {}
        queued: list[QueuedChunk] = []
        for i, view in enumerate(snapshot.jobs):
            if view.state.is_terminal:
                continue
            record = records.get(view.job_id)
            need = None if record is None else self._need(record, needs)
            if view.state is JobState.RUNNING:
                if view.running_on is not None:
                    running.add(view.running_on)
                    if need is not None:
                        ran.append((view.running_on, need))
                continue
            if view.state is JobState.QUEUED and view.parked_on is not None:
                parked_on.add(view.parked_on)
            if record is None or need is None:
                continue
            chunk = queued_chunk(view, record, need, beats)
            if chunk is not None:
                queued.append(chunk)
                if chunk.hop and not chunk.read_since and record.queued_at_s is not None:
                    ran.append((chunk.worker, need))  # its last chunk ended since the beat
            pending.append((i, need))
        workers = built_on(heard, ran)
        self.built = tuple(ran)
        memo: dict[ModelNeed, float] = {}
        loads: dict[int, float] = {}
        with self.learned.locked() as estimates:
            observe_loads(estimates, beats.values())
            for i, need in pending:
                load_s = memo.get(need)
                if load_s is None:
                    load_s = memo[need] = expected_load_s(need, workers, estimates)
                loads[i] = load_s
        idle = idle_takers(workers, running, parked_on, beats) \
            if any(c.worker in running and c.class_queue for c in queued) else {}
        moves = mark_moves(queued, {w.name: w.device for w in heard}, running, idle)
        marks = {i: (load_s, snapshot.jobs[i].job_id in moves.model_left)
                 for i, load_s in loads.items()}
        moved = moves.idle_holder
        kept: dict[str, tuple[JobView, tuple[float, bool, bool], JobView]] = {}
        jobs: list[JobView] | None = None
        for i, (load_s, left) in marks.items():
            view = snapshot.jobs[i]
            key = (load_s, left, view.job_id in moved)
            if key == (view.load_s, view.model_left, view.idle_holder):
                continue
            held = self._views.get(view.job_id)
            loaded = held[2] if held is not None and held[0] is view and held[1] == key \
                else replace(view, load_s=load_s, model_left=left, idle_holder=key[2])
            kept[view.job_id] = (view, key, loaded)
            if jobs is None:
                jobs = list(snapshot.jobs)
            jobs[i] = loaded
        self._views, self._needs = kept, needs
        return snapshot if jobs is None else replace(snapshot, jobs=tuple(jobs))

    def _need(self, record: JobRecord, needs: dict[str, tuple[JobRecord, ModelNeed | None]]
              ) -> ModelNeed | None:
        """What ``record``'s job needs resident (kept while its record is the same object),
        noted in ``needs`` for the next tick."""
        known = self._needs.get(record.job_id)
        need = known[1] if known is not None and known[0] is record \
            else model_need(record.kind, record.params)
        needs[record.job_id] = (record, need)
        return need


def queued_chunk(view: JobView, record: JobRecord, need: ModelNeed,
                 beats: Mapping[str, Heartbeat]) -> QueuedChunk | None:
    """A queued job's next chunk on a worker's own queue as the marks read it
    (:func:`scheduler.placement.mark_moves`); None for one not waiting on a worker. The
    worker's heartbeat counts as read since the chunk was queued when it was written after
    ``record.queued_at_s``."""
    if view.state is not JobState.QUEUED or view.parked_on is None:
        return None
    beat = beats.get(view.parked_on)
    written_s = None if beat is None else beat.ts
    read_since = written_s is not None and record.queued_at_s is not None \
        and written_s >= record.queued_at_s
    class_queue = class_queue_of(record.queue)
    return QueuedChunk(view.job_id, need, view.deadline_s, view.parked_on,
                       hop_worker(record.queue) == view.parked_on,
                       class_queue if class_queue in OWN_QUEUE_CLASSES else None, read_since)


def idle_takers(workers: Sequence[Holding], running: Set[str], parked_on: Set[str],
                beats: Mapping[str, Heartbeat]) -> dict[str, list[Holding]]:
    """Per class queue with own queues, the idle workers that take a chunk placed anew from
    it: no running chunk in the snapshot (``running``) nor in the heartbeat, no queued chunk
    parked on it (``parked_on``), consuming its placement queue for the class."""
    idle: dict[str, list[Holding]] = {}
    for w in workers:
        beat = beats[w.name]
        if beat.busy_job is not None or w.name in running or w.name in parked_on:
            continue
        for queue in OWN_QUEUE_CLASSES:
            if replaced_from(w.name, queue) in beat.queues:
                idle.setdefault(queue, []).append(w)
    return idle

