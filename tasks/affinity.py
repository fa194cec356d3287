"""Expert and checkpoint affinity: a job's next chunk goes to the worker that ran its last one
(``<worker>.<class>``, consumed right before the class queue), a new text job to an idle worker
whose resident experts fit its model, a released chunk of a job that runs on a model where the
placement policy (``scheduler.placement``, ``affinity.placement``) puts it. A chunk parked too
long is the tick's to move back to its class queue (``scheduler.recovery``). Each placement on a
worker is marked (``tasks.keys.placed``) for the next read of the workers until their
heartbeats and the tick count it. What the workers hold is read by ``tasks.holdings``; the
load times placement counts are learned by ``tasks.load_estimates``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.lifecycle import JobState
from scheduler.model import JobKind
from scheduler.placement import (
    Holding,
    ModelNeed,
    Placement,
    PlacementPolicy,
    assign,
    built_on,
    place,
    slack_s,
    stage,
)
from scheduler.policy import PolicyConfig
from tasks import keys
from tasks.heartbeat import Heartbeat
from tasks.holdings import StageRequest, holding, host_slots, mean_model_bytes, model_need
from tasks.load_estimates import LearnedLoads
from tasks.record import JobRecord
from tasks.routing import (
    AFFINITY_CLASSES,
    OWN_QUEUE_CLASSES,
    affinity_queue,
    affinity_worker,
    placed_queue,
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
    """Make ``consumer`` take its queues as ``realtime, <w>.interactive, <w>.interactive.placed,
    interactive, <w>.batch, <w>.batch.placed, batch, <w>.standby, standby``. Kombu's redis
    transport (``queue_order_strategy=priority``) reads queues in the order they were added, so
    the queues after the first change are cancelled and re-added in order. Returns the queues
    now consumed."""
    current = tuple(q.name for q in consumer.task_consumer.queues)
    wanted = with_affinity(worker, tuple(q for q in current if affinity_worker(q) is None))
    keep = common_prefix(current, wanted)
    for queue in current[len(keep):]:
        consumer.cancel_task_queue(queue)
    for queue in wanted[len(keep):]:
        consumer.add_task_queue(queue)  # an unknown name gets its own direct exchange
    return wanted


def hop_queues(settings: Settings, worker: str, consuming: Iterable[str],
               kind: str, params: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Where this worker publishes a job's next chunk, per class queue: its own queue for the
    class when affinity applies (to the kind, or to a job on a model under a placement that
    is not oblivious: it keeps its model) and it consumes that queue now (a reserved worker
    does not); a class missing from the map hops to its class queue. The commit picks the
    entry of the job's class as it stands at commit time (the scheduler may have changed it)."""
    mine = set(consuming)
    keeps = params is not None and keeps_model(settings, kind, params)
    return {cls: affinity_queue(worker, cls)
            for cls in (OWN_QUEUE_CLASSES if keeps else AFFINITY_CLASSES)
            if (keeps or applies(settings, kind, cls)) and affinity_queue(worker, cls) in mine}


# placement by model residency -----------------------------------------------------------------
def placement_policy(settings: Settings) -> PlacementPolicy:
    return PlacementPolicy(settings.affinity.placement)


def keeps_model(settings: Settings, kind: JobKind | str, params: Mapping[str, Any]) -> bool:
    """Whether a job's chunks stay on the worker that holds its model (placement by model,
    not oblivious)."""
    return settings.affinity.enabled and model_need(kind, params) is not None \
        and placement_policy(settings) is not PlacementPolicy.OBLIVIOUS


def common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    prefix: list[str] = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        prefix.append(x)
    return tuple(prefix)


# the first chunk ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlacementView:
    """What the tick knows for placement and a submit does not (:data:`tasks.keys.
    PLACEMENT_VIEW`): when each worker with work of its own is expected free (its running job's
    remaining work and every job parked on it: ``tasks.adapter.busy_free_in_s``) and the queued
    jobs per model, as of ``at_s``. A submit between two ticks places by it, as the tick does,
    rather than by the heartbeats alone (which count only a busy worker's running job)."""

    at_s: float
    free_in_s: Mapping[str, float]
    demand: Mapping[str, int]
    rates: Mapping[str, float] = field(default_factory=dict)
    """Seconds per cost unit of the cost keys of the jobs placed by model (the tick's learned
    cost model): what a placed job's remaining work takes."""
    built: Sequence[tuple[str, ModelNeed]] = ()
    """Chunks run since their worker's heartbeat, as the tick read them
    (:attr:`tasks.load_estimates.ExpectedLoads.built`)."""

    def encode(self) -> str:
        built = [[w, n.model, sorted(n.adapters), n.bytes] for w, n in self.built]
        return json.dumps({"at": self.at_s, "free": dict(self.free_in_s),
                           "demand": dict(self.demand), "rates": dict(self.rates),
                           "built": built}, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str | None) -> PlacementView | None:
        """The view, or None for none or one that cannot be read (placement then goes by the
        heartbeats)."""
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            return cls(float(body["at"]),
                       {str(k): float(v) for k, v in body["free"].items()},
                       {str(k): int(v) for k, v in body["demand"].items()},
                       {str(k): float(v) for k, v in body.get("rates", {}).items()},
                       tuple((str(w), ModelNeed(str(m), frozenset(map(str, a)), int(b)))
                             for w, m, a, b in body.get("built", ())))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("unreadable placement view; placing by the heartbeats")
            return None

    def free_at(self, now_s: float) -> dict[str, float]:
        """Each worker's free time as of ``now_s`` (what ran since the tick is done)."""
        gone = max(now_s - self.at_s, 0.0)
        return {name: max(free - gone, 0.0) for name, free in self.free_in_s.items()}


def _mark_work(member: bytes | str) -> float:
    """The seconds of work a placement mark's member (``<work>:<nonce>``) records."""
    text = member.decode() if isinstance(member, bytes) else member
    try:
        return max(float(text.split(":", 1)[0]), 0.0)
    except ValueError:
        return 0.0


_PRIOR_COST = PolicyConfig().new_cost_model()
"""The cost model's priors: a placed job's work where no learned rate is at hand."""


def placement_rates(records: Iterable[JobRecord],
                    rate: Callable[[str], float]) -> dict[str, float]:
    """Seconds per cost unit of each cost key among the jobs placed by model."""
    return {key: rate(key) for key in {r.cost_key for r in records
                                       if model_need(r.kind, r.params) is not None}}


def publish_placement_view(store: JobStore, view: PlacementView, ttl_s: float) -> None:
    store.redis.set(keys.PLACEMENT_VIEW, view.encode(), px=max(1, int(ttl_s * 1000)))


@dataclass
class WorkerDirectory:
    """The alive workers' heartbeats, read once and used for several release decisions."""

    bodies: dict[str, Heartbeat]
    picked: set[str] = field(default_factory=set)
    busy_free_in_s: Mapping[str, float] = field(default_factory=dict)
    """Per busy worker, the seconds its running chunk is expected to take still (the tick's
    snapshot knows them); a busy worker missing here is free at an unknown time."""
    demand: Callable[[], Mapping[str, int]] | None = None
    """The queued jobs per model (:func:`tasks.holdings.model_need`'s names), read when first
    needed."""
    learned: LearnedLoads = field(default_factory=LearnedLoads)
    """The load times placement counts, learned from heartbeats: its holder's (the tick's, a
    service's), each directory's read folded in."""
    placed: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)
    """Per worker, the chunks placement gave it lately (:func:`tasks.keys.placed`): when, and
    the seconds of work (load and run) each brought. Those given after what ``busy_free_in_s``
    and the worker's heartbeat counted add to its free time."""
    counted_until_s: float = -math.inf
    """``busy_free_in_s`` counts the jobs placed up to this time (the tick's read, or the
    published view's)."""
    rate: Callable[[str], float] = field(default_factory=lambda: _PRIOR_COST.seconds_per_unit)
    """Seconds per cost unit of a cost key (the tick's cost model; else the priors)."""
    store: JobStore | None = None
    """Where a placement on a worker is marked for the next directory (None: not marked)."""
    mark_ttl_s: float = 10.0
    now_s: float | None = None
    """The clock busy workers' heartbeats are read against (None: the wall clock)."""
    built: Sequence[tuple[str, ModelNeed]] = ()
    """Chunks run since their worker's heartbeat (the tick's
    :attr:`tasks.load_estimates.ExpectedLoads.built`): their models count as held there."""
    _holdings: dict[str, Holding] | None = None
    _demand: Mapping[str, int] | None = None

    @classmethod
    def read(cls, store: JobStore, busy_free_in_s: Mapping[str, float] | None = None,
             demand: Callable[[], Mapping[str, int]] | None = None,
             mark_ttl_s: float = 10.0, counted_until_s: float | None = None,
             rate: Callable[[str], float] | None = None,
             built: Sequence[tuple[str, ModelNeed]] | None = None,
             learned: LearnedLoads | None = None) -> WorkerDirectory:
        """The heartbeats and placement marks; a tick passes what its snapshot counted
        (``busy_free_in_s`` as of ``counted_until_s``, its ``rate``, the models ``built``
        since the heartbeats), a submit reads the last tick's published view for them
        (:class:`PlacementView`)."""
        bodies = store.heartbeats()
        names = sorted(bodies)
        now = time.time()
        pipe = store.redis.pipeline(transaction=False)
        for name in names:
            pipe.zrangebyscore(keys.placed(name), now - mark_ttl_s, "+inf", withscores=True)
        pipe.get(keys.PLACEMENT_VIEW)
        *marks, raw = pipe.execute()
        placed = {n: [(at, _mark_work(m)) for m, at in got]
                  for n, got in zip(names, marks, strict=True) if got}
        counted = -math.inf if counted_until_s is None else counted_until_s
        view = PlacementView.decode(raw) if busy_free_in_s is None else None
        if view is not None:  # a submit: the last tick's free times, demand and rates
            busy_free_in_s, counted = view.free_at(now), view.at_s
            if demand is None:
                demand = functools.partial(dict, view.demand)
            if rate is None and view.rates:
                rates = dict(view.rates)
                rate = lambda key: rates.get(key) or _PRIOR_COST.seconds_per_unit(key)  # noqa: E731
            if built is None:  # what a heartbeat written since the tick read says is newer
                built = [(w, need) for w, need in view.built
                         if (beat := bodies.get(w)) is not None
                         and (beat.ts is None or beat.ts < view.at_s)]
        directory = cls(bodies, busy_free_in_s=busy_free_in_s or {}, demand=demand,
                        placed=placed, counted_until_s=counted, store=store,
                        built=tuple(built or ()),
                        mark_ttl_s=mark_ttl_s,
                        rate=rate or _PRIOR_COST.seconds_per_unit,
                        learned=LearnedLoads() if learned is None else learned)
        directory.learned.observe(directory.bodies.values())
        return directory

    def _free_in_s(self, name: str, beat: Heartbeat) -> float:
        """When a worker is expected free of the work that stays on it: the tick's estimate
        where it has one (the running job's remaining work and the jobs parked on it), else
        0 for an idle worker, its heartbeat's for a busy one (when its running job's work
        ends), or inf; plus the work of every chunk placement gave it since both were
        written (the marks)."""
        if name in self.busy_free_in_s:  # the tick's: parked work counted, busy or idle
            base, since = self.busy_free_in_s[name], self.counted_until_s
        else:  # the heartbeat's: its running job (a chunk given before it may be running)
            since = max(self.counted_until_s, -math.inf if beat.ts is None else beat.ts)
            if beat.busy_job is None:
                base = 0.0
            else:
                told = beat.free_in_s(self.clock_s())
                base = math.inf if told is None else told
        return base + sum(work for at, work in self.placed.get(name, ()) if at > since)

    def clock_s(self) -> float:
        """Now, on the clock busy workers' heartbeats are read against (``now_s``, else the
        wall clock)."""
        return self.now_s if self.now_s is not None else time.time()

    def work_s(self, job: JobRecord) -> float:
        """Seconds of work ``job`` has left (its remaining cost units at its key's rate)."""
        return sum(job.cost_units[job.next_chunk:]) * self.rate(job.cost_key)

    def place(self, need: ModelNeed, class_queue: str, policy: PlacementPolicy,
              work_s: float = 0.0, slack_s: float = 0.0) -> Placement:
        """Where ``need``'s chunk goes among the alive workers consuming their own queue for
        ``class_queue`` (:func:`scheduler.placement.place`, the job's ``slack_s`` with it),
        each free when the work that stays on it ends; the chosen worker then has this job's
        load and ``work_s`` more work, for the rest of this directory's releases and (marked)
        for the next directory's."""
        holdings = self._current_holdings()
        if self._demand is None and policy is PlacementPolicy.STEPLINE:
            self._demand = self.demand() if self.demand is not None else {}
        # A chunk placed on a busy worker waits in its placement queue, behind the next chunks
        # of the jobs it runs (their own queue), for its free time as counted.
        workers = [h for name, h in holdings.items()
                   if placed_queue(name, class_queue) in self.bodies[name].queues]
        with self.learned.locked() as estimates:
            chosen = place(need, workers, estimates, policy, self._demand, slack_s)
        if chosen.worker is not None:
            busy_s = work_s if work_s > 0.0 else math.inf  # no estimate: busy, free unknown
            if self.store is not None:
                self._mark(chosen.worker, chosen.load_s + busy_s)
            after = assign(workers, chosen, need, busy_s)
            holdings.update((h.name, h) for h in after)
        return chosen

    def _current_holdings(self) -> dict[str, Holding]:
        """The workers as placement sees them, built from the heartbeats (and the models
        built since them) once, then as this directory's placements left them."""
        if self._holdings is None:
            heard = [holding(name, beat, self._free_in_s(name, beat))
                     for name, beat in self.bodies.items()]
            self._holdings = {h.name: h for h in built_on(heard, self.built)}
        return self._holdings

    def stage_models(self, waiting: Iterable[JobRecord], min_queued: int
                     ) -> list[tuple[str, str, StageRequest]]:
        """Which models to read into which worker's host memory now
        (:func:`scheduler.placement.stage`: a model with ``min_queued`` or more jobs waiting
        that no worker holds, to the worker free soonest with host room): (worker, model,
        request), the request naming one waiting job's parameters (how the worker builds it).
        Counts this directory's placements so far; a model a worker is staging already counts
        as held."""
        demand = self._demand if self._demand is not None else (
            self.demand() if self.demand is not None else {})
        if min_queued <= 0:
            return []
        example: dict[str, JobRecord] = {}
        needs: list[ModelNeed] = []
        for job in waiting:
            need = model_need(job.kind, job.params)
            if need is not None and need.model not in example:
                example[need.model] = job
                needs.append(need)
        size = mean_model_bytes(self.bodies.values(), needs)
        slots = {name: n for name, beat in self.bodies.items()
                 if (n := host_slots(beat, size)) > 0}
        if not slots:
            return []
        with self.learned.locked() as estimates:
            pairs = stage(demand, list(self._current_holdings().values()), estimates,
                          min_queued, slots)
        return [(worker, model, StageRequest(kind=example[model].kind,
                                             params=dict(example[model].params)))
                for worker, model in pairs if model in example]

    def _mark(self, worker: str, work_s: float) -> None:
        """Note that ``worker`` was given ``work_s`` seconds of work now (expiring after
        ``mark_ttl_s``, by when its heartbeat and the tick count it)."""
        assert self.store is not None
        now = time.time()
        key = keys.placed(worker)
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.zadd(key, {f"{work_s!r}:{uuid.uuid4().hex[:8]}": now})
        pipe.zremrangebyscore(key, "-inf", now - self.mark_ttl_s)
        pipe.pexpire(key, max(1, int(self.mark_ttl_s * 1000)))
        pipe.execute()

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


def needs_directory(settings: Settings, job: JobRecord) -> bool:
    """Whether :func:`release_queue` may consult the workers' heartbeats for ``job``."""
    return job.kind is JobKind.TEXT or keeps_model(settings, job.kind, job.params)


def queued_demand(records: Iterable[JobRecord]) -> dict[str, int]:
    """Jobs waiting to run (pending or queued) per model they need."""
    demand: dict[str, int] = {}
    for job in records:
        if job.state in (JobState.PENDING, JobState.QUEUED) \
                and (need := model_need(job.kind, job.params)) is not None:
            demand[need.model] = demand.get(need.model, 0) + 1
    return demand


def release_queue(settings: Settings, job: JobRecord, class_queue: str,
                  directory: WorkerDirectory | None) -> str:
    """The queue a job's release goes to: for the first chunk of a text job, the affinity queue
    of the idle worker whose experts fit best; for a chunk of a job on a model, that of the
    worker the placement policy chooses (``affinity.placement``); otherwise ``class_queue``. A
    chunk parked there while that worker turns busy moves back to its class queue after
    ``affinity.max_wait`` (the tick's recovery)."""
    a = settings.affinity
    if directory is None or job.atomic or not a.enabled or class_queue not in AFFINITY_CLASSES:
        return class_queue
    model = job.params.get("model")
    if job.kind is JobKind.TEXT:
        if job.next_chunk != 0 or not applies(settings, "text", class_queue):
            return class_queue
        worker = directory.best_fit(str(model), class_queue, a.prefill_min_fit)
    elif keeps_model(settings, job.kind, job.params):
        need = model_need(job.kind, job.params)
        assert need is not None
        work_s = directory.work_s(job)
        chosen = directory.place(need, class_queue, placement_policy(settings), work_s,
                                 slack_s=slack_s(job.deadline_at_s, directory.clock_s(), work_s))
        if chosen.worker is None:
            return class_queue
        log.debug("job %s: %s on %s (%s, start in %.2fs)", job.job_id, need.model,
                  chosen.worker, chosen.reason, chosen.start_in_s)
        return placed_queue(chosen.worker, class_queue)
    else:
        return class_queue
    return affinity_queue(worker, class_queue) if worker else class_queue


def kept_queue(job: JobRecord, queue: str, directory: WorkerDirectory | None) -> str | None:
    """Where a queued chunk of a job parked on a worker goes when the tick moves it to
    ``queue`` (a class change, standby): that worker's own queue for ``queue`` (its placement
    queue while the job has not run yet), if the worker is alive and consumes it; None: no
    worker keeps it."""
    worker = affinity_worker(job.queue)
    if worker is None or directory is None or queue not in OWN_QUEUE_CLASSES:
        return None
    beat = directory.bodies.get(worker)
    own = placed_queue(worker, queue) if job.service_s == 0 and queue in AFFINITY_CLASSES \
        else affinity_queue(worker, queue)
    return own if beat is not None and own in beat.queues else None


def expand_worker_queues(settings: Settings,
                         wanted: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The plan's per-worker queues with each worker's affinity queues placed in front of their
    classes (a reserved worker consumes only realtime, so it gets none)."""
    if not settings.affinity.enabled:
        return dict(wanted)
    return {worker: with_affinity(worker, tuple(queues)) for worker, queues in wanted.items()}
