"""Placement that knows a cold start: which worker should run a job's next chunk when the pool
serves more models than one worker holds.

A worker that does not hold a job's base model on its device pays a load first: seconds from
host memory, more from disk, plus each missing LoRA adapter (the production figures in the
reference: a LoRA load p50 4.4 s, a whole pipeline switch p50 8.5 s, p99 54 s). The policy here
puts a job where its start comes soonest counting that load, keeps same-model work together (a
load that evicts a model other queued jobs need and no other worker holds is charged its
reload), and names models whose queue builds so a worker can stage them into host memory ahead
of their jobs.

Pure policy: the live release path (``tasks.affinity``) and the simulator (``app.bench.simulate``)
call the same :func:`place`. Times are seconds; a worker's ``free_in_s`` is 0 when it is idle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

LoadTier = Literal["disk", "host", "adapter"]


class PlacementPolicy(str, Enum):
    OBLIVIOUS = "oblivious"
    """Any worker takes the job from its class queue (the placement before residency)."""
    WARM = "warm"
    """Route to an idle worker holding the model, else any worker (Ray Serve's model
    multiplexing: per-replica LRU, requests routed to a replica that holds their model)."""
    STEPLINE = "stepline"
    """Soonest expected start counting the load, waiting for a warm worker soon free, and
    charging a load the reloads it causes to other queued jobs (:func:`place`)."""


@dataclass(frozen=True, slots=True)
class ModelNeed:
    """What a job's chunk needs resident: its base model and its LoRA adapters."""

    model: str
    adapters: frozenset[str] = frozenset()
    bytes: int = 0
    """The base model's size (0: unknown; a worker's fullness is then judged by count)."""


@dataclass(frozen=True, slots=True)
class Holding:
    """One alive worker as placement sees it: when it is free and what it holds."""

    name: str
    free_in_s: float = 0.0
    """Seconds until it can start another chunk: 0 when idle, ``math.inf`` when busy with no
    estimate."""
    device: frozenset[str] = frozenset()
    """Base models on its device."""
    host: frozenset[str] = frozenset()
    """Base models in its host memory (a cheaper load than from disk)."""
    adapters: frozenset[str] = frozenset()
    """Adapters loaded on its bases, on the device or in host memory (a base moved back from
    host memory brings its adapters)."""
    capacity: int = 0
    """Base models its device budget holds (0: no limit known; a load evicts nothing)."""
    free_bytes: int | None = None
    """Device budget bytes not taken by its models (None: not known; ``capacity`` judges)."""

    @property
    def idle(self) -> bool:
        return self.free_in_s <= 0.0

    def full_for(self, need: ModelNeed) -> bool:
        """Whether loading ``need``'s base here must evict a model: by bytes when both sizes
        are known, else by count against ``capacity``."""
        if need.model in self.device:
            return False
        if self.free_bytes is not None and need.bytes > 0:
            return need.bytes > self.free_bytes
        return 0 < self.capacity <= len(self.device)

    def holds(self, need: ModelNeed) -> bool:
        return need.model in self.device and need.adapters <= self.adapters


@dataclass(frozen=True, slots=True)
class LoadPriors:
    """Load seconds assumed before any is measured (the production figures' medians: a
    pipeline switch from storage 8.45 s, a LoRA adapter 4.38 s; host memory a quarter of disk,
    as an SDXL-size base loads in ~20 s from disk and 4-6 s from host memory)."""

    disk_s: float = 8.454
    host_s: float = 2.1
    adapter_s: float = 4.378

    def of(self, tier: LoadTier) -> float:
        return {"disk": self.disk_s, "host": self.host_s, "adapter": self.adapter_s}[tier]


SEEN_LOADS = 4096
"""Loads :meth:`LoadEstimates.observe_once` remembers to skip a repeat."""


@dataclass(slots=True)
class LoadEstimates:
    """Load seconds learned from measured loads: per (model or adapter, tier) an exponentially
    weighted mean; a model never loaded from a tier gets the mean of every load measured from
    that tier, and before any, the prior."""

    priors: LoadPriors = field(default_factory=LoadPriors)
    alpha: float = 0.3
    _own: dict[tuple[str, LoadTier], float] = field(default_factory=dict)
    _tier_sum: dict[LoadTier, float] = field(default_factory=dict)
    _tier_n: dict[LoadTier, int] = field(default_factory=dict)
    _seen: dict[tuple[str, LoadTier, float], None] = field(default_factory=dict)
    """Loads already learned, oldest first, at most ``SEEN_LOADS`` (a heartbeat repeats only
    its worker's few most recent loads)."""

    def observe(self, name: str, tier: LoadTier, seconds: float) -> None:
        """One measured load of ``name`` (a base model, or an adapter with tier ``adapter``)."""
        if not math.isfinite(seconds) or seconds < 0.0:
            return
        key = (name, tier)
        old = self._own.get(key)
        self._own[key] = seconds if old is None else old + self.alpha * (seconds - old)
        self._tier_sum[tier] = self._tier_sum.get(tier, 0.0) + seconds
        self._tier_n[tier] = self._tier_n.get(tier, 0) + 1

    def observe_once(self, name: str, tier: LoadTier, seconds: float, at_s: float) -> None:
        """:meth:`observe`, ignoring a load already seen (the same record read again from a
        later heartbeat's list of recent loads)."""
        mark = (name, tier, at_s)
        if mark in self._seen:
            return
        self._seen[mark] = None
        if len(self._seen) > SEEN_LOADS:
            del self._seen[next(iter(self._seen))]
        self.observe(name, tier, seconds)

    def estimate(self, name: str, tier: LoadTier) -> float:
        """Seconds a load of ``name`` from ``tier`` takes: its own measured loads from that
        tier; else its own from the other base tier (disk or host), scaled by the priors'
        ratio of the two; else the mean of every load measured from ``tier``; else the prior,
        scaled as the loads measured from the other tiers compare with their priors. A tier
        never measured is never judged by an absolute prior beside measured ones: on a pool
        whose loads all take a tenth of the priors, a prior host load would look four times a
        disk load, and a model kept in host memory would never be chosen to learn otherwise."""
        own = self._own.get((name, tier))
        if own is not None:
            return own
        if tier != "adapter":
            other: LoadTier = "host" if tier == "disk" else "disk"
            theirs = self._own.get((name, other))
            if theirs is not None:
                return theirs * self.priors.of(tier) / self.priors.of(other)
        n = self._tier_n.get(tier, 0)
        if n:
            return self._tier_sum[tier] / n
        return self.priors.of(tier) * self._measured_scale()

    def _measured_scale(self) -> float:
        """How the loads measured so far compare with the priors (the mean ratio of each
        measured tier's mean to its prior; 1 before any load)."""
        ratios = [self._tier_sum[t] / n / self.priors.of(t)
                  for t, n in self._tier_n.items() if n and self.priors.of(t) > 0.0]
        return sum(ratios) / len(ratios) if ratios else 1.0

    def load_s(self, need: ModelNeed, worker: Holding) -> float:
        """Seconds ``worker`` spends loading before it can run ``need``'s chunk."""
        held = worker.adapters  # a base back from host memory brings the adapters it held
        if need.model in worker.device:
            base = 0.0
        elif need.model in worker.host:
            base = self.estimate(need.model, "host")
        else:
            base, held = self.estimate(need.model, "disk"), frozenset()
        return base + sum(self.estimate(a, "adapter") for a in sorted(need.adapters - held))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a chunk goes. ``worker`` None: its class queue (whichever worker frees first)."""

    worker: str | None
    start_in_s: float
    """Expected seconds until its chunk starts running: the worker's wait plus its load."""
    load_s: float
    """Expected load seconds on that worker (on the class queue: on a worker not holding it)."""
    reason: str


def slack_s(deadline_s: float, now_s: float, work_s: float) -> float:
    """How long a job can still wait and meet its deadline: the deadline less now and its
    remaining work (the ``slack_s`` :func:`place` takes; the recovery's rule for a chunk
    parked where its model is uses the same)."""
    return deadline_s - now_s - work_s


WAIT_SHARE = 0.5
"""Of a job's slack, the share it may spend waiting for a worker that holds its model rather
than load it elsewhere sooner (the rest absorbs error in the free-time estimates)."""


def place(need: ModelNeed, workers: Sequence[Holding], estimates: LoadEstimates,
          policy: PlacementPolicy = PlacementPolicy.STEPLINE,
          demand: Mapping[str, int] | None = None, slack_s: float = 0.0) -> Placement:
    """Where ``need``'s chunk should go among ``workers`` (the alive ones, minus any already
    given a chunk this round). ``demand`` counts the queued jobs per base model; the Stepline
    policy charges a load that must evict a model the reload its queued jobs will pay when no
    other worker holds it (once: one reload serves them all). ``slack_s``: how long the job
    can wait and still meet its deadline (:func:`slack_s`); it
    waits for a worker that holds its model while that wait stays within ``WAIT_SHARE`` of
    it, though a load elsewhere would start it sooner: the load's seconds are worker time
    every other job loses, the wait costs this one nothing it needs — unless that load would
    start at once on an idle worker, displacing nothing queued jobs need: time no other job
    would use (at low load, waiting then only costs the job; measured, waiting there too
    lowered the highest load held at 99 % attainment)."""
    cold = cold_load_s(need, estimates)
    if policy is PlacementPolicy.OBLIVIOUS or not workers:
        return Placement(None, 0.0, cold, "class queue")
    warm_idle = [w for w in workers if w.idle and w.holds(need)]
    if policy is PlacementPolicy.WARM:
        if warm_idle:
            return Placement(min(w.name for w in warm_idle), 0.0, 0.0, "idle and warm")
        return Placement(None, 0.0, cold, "class queue: no idle worker holds it")
    queued = demand or {}
    holders = _holders(workers) if queued else {}
    best: tuple[float, float, bool, str] | None = None  # (start, load, evicts, name)
    warm: tuple[float, str] | None = None
    for w in workers:
        if not math.isfinite(w.free_in_s):
            continue
        load = estimates.load_s(need, w)
        start = w.free_in_s + load + _displacement_s(need, w, estimates, queued, holders)
        # on a tie, a worker with room: a load there evicts nothing a later job may want
        candidate = (start, load, w.full_for(need), w.name)
        if best is None or candidate < best:
            best = candidate
        if load == 0.0 and (warm is None or (start, w.name) < warm):
            warm = (start, w.name)
    if best is None:
        return Placement(None, 0.0, cold, "class queue: no worker's free time is known")
    if best[1] > 0.0 and best[0] > best[1] and warm is not None \
            and warm[0] <= WAIT_SHARE * slack_s:
        return Placement(warm[1], warm[0], 0.0, "warm: waits for it within its slack")
    start, load, _, name = best
    reason = "warm" if load == 0.0 else "cold: the soonest start counting its load"
    return Placement(name, start, load, reason)


def cold_load_s(need: ModelNeed, estimates: LoadEstimates) -> float:
    """The load a worker not holding the model pays (from disk, plus every adapter): what a
    job parked where its model is would pay by moving (``JobView.reload_s``)."""
    return estimates.load_s(need, Holding(""))


def _displacement_s(need: ModelNeed, worker: Holding, estimates: LoadEstimates,
                    demand: Mapping[str, int], holders: Mapping[str, int]) -> float:
    """What loading ``need`` on a full ``worker`` costs other jobs: the cheapest model it could
    evict, charged one reload when queued jobs need it and no other worker holds it on its
    device (with another holder, its jobs lose nothing; a reload serves all its queued jobs,
    so it is charged once, not per job)."""
    if not worker.full_for(need):
        return 0.0
    return min((estimates.estimate(m, "disk")
                if demand.get(m, 0) > 0 and holders.get(m, 0) <= 1 else 0.0
                for m in worker.device), default=0.0)


def _holders(workers: Iterable[Holding]) -> dict[str, int]:
    """How many workers hold each base model on their device."""
    count: dict[str, int] = {}
    for w in workers:
        for m in w.device:
            count[m] = count.get(m, 0) + 1
    return count


def built_on(workers: Sequence[Holding], ran: Iterable[tuple[str, ModelNeed]]
             ) -> list[Holding]:
    """``workers`` with, on each one's device, the models and adapters of the chunks it ran
    (or runs) since its residency was read: a model is resident from the completion of the
    chunk that loaded it, not from the worker's next report of it (its bytes taken from the
    device's free bytes where both are known). ``ran``: (worker, what the chunk needed); a
    worker not among ``workers`` is skipped."""
    built: dict[str, dict[str, ModelNeed]] = {}
    for name, need in ran:
        built.setdefault(name, {}).setdefault(need.model, need)
    return [w if w.name not in built else _with_built(w, list(built[w.name].values()))
            for w in workers]


def _with_built(w: Holding, needs: Sequence[ModelNeed]) -> Holding:
    new = [n for n in needs if n.model not in w.device]
    adapters: frozenset[str] = frozenset().union(*(n.adapters for n in needs))
    if not new and adapters <= w.adapters:
        return w
    models = frozenset(n.model for n in new)
    free = w.free_bytes
    if free is not None:
        free = max(free - sum(n.bytes for n in new), 0)
    return replace(w, device=w.device | models, host=w.host - models,
                   adapters=w.adapters | adapters, free_bytes=free)


def expected_load_s(need: ModelNeed, workers: Sequence[Holding],
                    estimates: LoadEstimates) -> float:
    """The load a job should expect before it runs: none when a worker holds it, else the
    cheapest load on any worker (counted into its deadline, admission and batching)."""
    if not workers:
        return cold_load_s(need, estimates)
    if any(w.holds(need) for w in workers):  # the common case, without an estimate per worker
        return 0.0
    return min(estimates.load_s(need, w) for w in workers)


@dataclass(frozen=True, slots=True)
class Parked:
    """A queued job's next chunk waiting on the own queue of a worker busy with another job's
    chunk (the candidates of :func:`idle_holders`)."""

    job_id: str
    need: ModelNeed
    deadline_s: float
    class_queue: str
    """The class queue behind its queue: an idle worker serves it only if it consumes it."""


def idle_holders(parked: Iterable[Parked], idle: Mapping[str, Sequence[Holding]]
                 ) -> frozenset[str]:
    """The jobs of ``parked`` to place anew because an idle worker holds their base model and
    adapters (``JobView.idle_holder``): earliest deadline first, each idle worker given to one
    job (so that two jobs do not both move to a worker that can start only one), the holder
    with the fewest adapters first. ``idle``: per class queue, the idle workers that consume
    it with nothing parked on them. A worker is its name: listed under two queues it is one
    worker, taken once, even where the two lists see it differently."""
    taken: set[str] = set()
    moved: set[str] = set()
    for job in sorted(parked, key=lambda p: (p.deadline_s, p.job_id)):
        takers = [w for w in idle.get(job.class_queue, ())
                  if w.name not in taken and w.holds(job.need)]
        if not takers:
            continue
        # the least specialised holder: one with adapters others may need is kept for them
        taker = min(takers, key=lambda w: (len(w.adapters), w.name))
        moved.add(job.job_id)
        taken.add(taker.name)  # one job per idle worker, whichever class it serves
    return frozenset(moved)


@dataclass(frozen=True, slots=True)
class QueuedChunk:
    """A queued job's next chunk waiting on a worker's own queue, as :func:`mark_moves` reads
    it."""

    job_id: str
    need: ModelNeed
    deadline_s: float
    worker: str
    """The worker whose own queue it waits on."""
    hop: bool
    """That queue holds the next chunks of the jobs the worker ran (not a placement queue)."""
    class_queue: str | None
    """The class queue behind it when that class has own queues (an idle worker may take it
    from there placed anew); None otherwise."""
    read_since: bool = True
    """The worker's residency was read after the chunk was queued there (an older reading
    may predate the load of the chunk that just ran, and says nothing of an eviction)."""


@dataclass(frozen=True, slots=True)
class Marks:
    """:func:`mark_moves`' answer: the jobs to place anew, and why."""

    model_left: frozenset[str]
    """Hops whose worker no longer holds their base model (``JobView.model_left``)."""
    idle_holder: frozenset[str]
    """Chunks waiting on a busy worker while an idle one holds their model and adapters
    (``JobView.idle_holder``)."""


def mark_moves(queued: Iterable[QueuedChunk], device: Mapping[str, frozenset[str]],
               busy: Set[str], idle: Mapping[str, Sequence[Holding]]) -> Marks:
    """Which queued chunks should leave the worker they wait on (the live tick and the
    simulator alike): a hop whose worker's device (``device``, as last read) no longer holds
    its base model — evicted for another job's since; and, of the others, a chunk waiting on a
    worker busy with another job's chunk (``busy``) while an idle worker holds its model and
    adapters (:func:`idle_holders`; ``idle``: per class queue, the idle workers that take a
    chunk placed anew from it, nothing parked on them)."""
    left: set[str] = set()
    parked: list[Parked] = []
    for chunk in queued:
        held = device.get(chunk.worker)
        if chunk.hop and chunk.read_since and held is not None \
                and chunk.need.model not in held:
            left.add(chunk.job_id)
        elif chunk.worker in busy and chunk.class_queue is not None:
            parked.append(Parked(chunk.job_id, chunk.need, chunk.deadline_s,
                                 chunk.class_queue))
    moved = idle_holders(parked, idle) if parked and idle else frozenset()
    return Marks(frozenset(left), moved)


def stage(demand: Mapping[str, int], workers: Sequence[Holding], estimates: LoadEstimates,
          min_queued: int = 2, host_slots: Mapping[str, int] | None = None
          ) -> tuple[tuple[str, str], ...]:
    """(worker, model) pairs to stage into host memory now: each model with at least
    ``min_queued`` queued jobs that no worker holds in either tier goes to the worker free
    soonest among those with host room (``host_slots``: free host slots per worker; absent:
    none), most-demanded model first. A staged model loads from host memory when its job
    arrives: ``host_s`` instead of ``disk_s``."""
    slots = dict(host_slots or {})
    held = _held_anywhere(workers)
    out: list[tuple[str, str]] = []
    wanted = sorted(((-n, m) for m, n in demand.items() if n >= min_queued and m not in held))
    for _, model in wanted:
        room = [w for w in workers if slots.get(w.name, 0) > 0 and math.isfinite(w.free_in_s)]
        if not room:
            break
        target = min(room, key=lambda w: (w.free_in_s, w.name))
        slots[target.name] -= 1
        out.append((target.name, model))
    return tuple(out)


def _held_anywhere(workers: Iterable[Holding]) -> set[str]:
    held: set[str] = set()
    for w in workers:
        held |= w.device | w.host
    return held


def assign(workers: Sequence[Holding], placement: Placement, need: ModelNeed,
           busy_s: float) -> tuple[Holding, ...]:
    """``workers`` after ``placement`` gave its worker a chunk of ``busy_s`` seconds: free
    after the chunk starts and runs, holding the chunk's model and adapters (for the next
    placement of the same round)."""
    if placement.worker is None:
        return tuple(workers)
    out: list[Holding] = []
    for w in workers:
        if w.name == placement.worker:
            free = w.free_bytes
            if free is not None and need.model not in w.device:
                free = max(free - need.bytes, 0)
            w = Holding(w.name, placement.start_in_s + busy_s, w.device | {need.model},
                        w.host - {need.model}, w.adapters | need.adapters, w.capacity, free)
        out.append(w)
    return tuple(out)
