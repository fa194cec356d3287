"""Which built models a worker process keeps, under a memory budget in bytes.

Three tiers: the **device** (usable now), **host** memory (evicted from the device but kept, so a
reload is a copy rather than a build) and **disk** (dropped: rebuilt from the recipe's seed or
read back from its local ``weights:`` folder). Seeded construction makes a rebuilt model
bit-identical to the one dropped, so eviction never changes an output.

A model's size is measured, not guessed: the bytes of its modules' parameters and buffers (and,
for a MoE model, its expert caches' host and device copies), each storage counted once. Every
load is timed and recorded (model, tier it came from, seconds, bytes); those seconds are the
reload cost the eviction policy weighs.

Policies: ``lru`` evicts the least recently used model; ``cost`` (the default) evicts the model
with the lowest *expected reuse × reload cost*: reuse is an exponentially decayed count of
acquisitions (half-life ``half_life_s``), cost the seconds its last load from the tier it would
fall to took. A cheap, rarely used model goes first; an expensive one that recurs stays.

Models acquired inside :meth:`ModelResidency.in_use` (the worker's bracket around a task's
chunks) are pinned until the bracket closes: a running chunk's or batch's model is never
evicted. A model that cannot fit beside the pinned ones raises :class:`ModelMemoryError`.

A model whose jobs are queued can be **staged**: read from disk straight into the host tier by a
background thread (:meth:`ModelResidency.stage`, asked by the scheduler's placement), so that
the chunk that needs it pays a move from host memory instead of a build. Staging never touches
the device tier, and a chunk that needs a model being staged waits for that read rather than
starting a second one.

A load a chunk waits for is announced while it runs (:meth:`ModelResidency.loading`: the model,
when it began on the wall clock, the seconds it is expected to take) and its end is kept
(``loaded_at``): the heartbeat carries both, so the scheduler counts the rest of a load under way
into when the worker is free, as it counts the rest of the chunk's work.

On a CPU-only worker the device and the host are the same memory; the host tier is then a second
budget of models kept beyond the device budget, and a reload from it costs next to nothing. On a
GPU a diffusion model's modules move with ``.to("cpu")`` and back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from workers.errors import WorkerError

if TYPE_CHECKING:  # the residency itself never loads torch: a simulated worker imports it too
    import torch
    from torch import nn

log = logging.getLogger(__name__)
T = TypeVar("T")
Tier = Literal["device", "host", "disk"]
LoadSource = Literal["device", "host", "disk", "adapter", "stage"]
Policy = Literal["lru", "cost"]
POLICIES: tuple[Policy, ...] = ("lru", "cost")
RECENT_LOADS = 16
"""Loads kept for the heartbeat (the most recent)."""


MAX_LOADED_ADAPTERS = 8
"""LoRA adapters kept loaded on one base model; beyond it the least recently used that the
running chunk does not apply are unloaded."""

Reuse = tuple[float, float]
"""A model's decayed acquisition count and when it was last counted."""


def decayed(reuse: Reuse | None, now_s: float, half_life_s: float) -> float:
    """A model's acquisition count decayed to ``now_s`` (0 for one never acquired)."""
    if reuse is None:
        return 0.0
    count, at_s = reuse
    return count * math.pow(0.5, max(0.0, now_s - at_s) / half_life_s)


def counted_use(reuse: Reuse | None, now_s: float, half_life_s: float) -> Reuse:
    """``reuse`` after one more acquisition at ``now_s``."""
    return decayed(reuse, now_s, half_life_s) + 1.0, now_s


def eviction_score(reuse: Reuse | None, reload_s: float, now_s: float,
                   half_life_s: float) -> float:
    """The ``cost`` policy's keep score: expected reuse × reload seconds (the lowest goes
    first; a load never timed counts as a microsecond)."""
    return decayed(reuse, now_s, half_life_s) * max(reload_s, 1e-6)


def adapters_to_unload(loaded: Sequence[str], wanted: Collection[str],
                       cap: int = MAX_LOADED_ADAPTERS) -> list[str]:
    """Of the adapters ``loaded`` on one base (least recently used first), the ones to unload
    so that at most ``cap`` stay: the least recently used not ``wanted`` by the chunk."""
    return [n for n in loaded if n not in wanted][:max(0, len(loaded) - cap)]


class ModelMemoryError(WorkerError):
    """A model does not fit in the memory budget (alone, or beside the models in use)."""


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``: ``numel × element_size`` per storage, each storage counted
    once (tied weights and views of one buffer share theirs)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return sum(seen.values())


def module_tensors(modules: Iterable[nn.Module | None]) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``modules`` (None skipped)."""
    for module in modules:
        if module is not None:
            yield from module.parameters()
            yield from module.buffers()


@dataclass(frozen=True, slots=True)
class Resident:
    """How the residency handles one kind of model: its tensors (to measure it) and, where it
    can live in host memory, how to move it there and back (None: evicted straight to disk)."""

    tensors: Callable[[Any], Iterable[torch.Tensor]]
    to_host: Callable[[Any], None] | None = None
    to_device: Callable[[Any], None] | None = None
    release: Callable[[Any], None] | None = None
    """Frees what a dropped model holds beyond its tensors (a MoE model's copy threads)."""
    grows: bool = False
    """Its bytes change as it serves (a MoE model's expert caches): measured again after use."""


@dataclass(frozen=True, slots=True)
class LoadWindow:
    """A load a chunk waits for, under way: the model, when it began (wall clock, Unix
    seconds: the heartbeat's clock) and the seconds it is expected to take (None: not known)."""

    model: str
    since: float
    expected_s: float | None
    source: LoadSource | None = None
    """Where it loads from (``disk``, ``host``, ``adapter``: the first of a runner's loads);
    a reader that gets no ``expected_s`` can estimate it by model and source."""

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "since": round(self.since, 6)}
        if self.expected_s is not None:
            body["expected_s"] = round(self.expected_s, 6)
        if self.source is not None:
            body["from"] = self.source
        return body


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One load: which model, the tier it came from (``adapter``: a LoRA adapter loaded onto
    the resident model), how long it took, its bytes, when (the residency's clock)."""

    model: str
    tier: LoadSource
    seconds: float
    bytes: int
    at_s: float
    adapter: str | None = None
    """The adapter loaded, for a load of tier ``adapter``."""

    def as_dict(self) -> dict[str, Any]:
        body = {"model": self.model, "tier": self.tier, "s": round(self.seconds, 6),
                "bytes": self.bytes, "at": round(self.at_s, 6)}
        if self.adapter is not None:
            body["adapter"] = self.adapter
        return body


@dataclass(slots=True)
class _Entry:
    key: str
    value: Any
    kind: Resident
    build: Callable[[], Any]
    tier: Tier
    bytes: int
    last_use_s: float
    reuse: float = 0.0
    """Acquisitions, exponentially decayed to ``reuse_at_s``."""
    reuse_at_s: float = 0.0
    cost_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the last load from each tier (``disk``, ``host``)."""


@dataclass(slots=True)
class _Counters:
    loads: dict[str, int] = field(default_factory=lambda: {"disk": 0, "host": 0})
    load_s: dict[str, float] = field(default_factory=lambda: {"disk": 0.0, "host": 0.0})
    evictions: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    hits: int = 0
    peak_device_bytes: int = 0
    adapter_loads: int = 0
    adapter_load_s: float = 0.0
    staged: int = 0
    """Models read into the host tier ahead of their jobs (:meth:`ModelResidency.stage`)."""
    stage_s: float = 0.0


class ModelResidency:
    """A process's built models under ``budget_bytes`` on the device (None: unlimited) and
    ``host_budget_bytes`` in host memory (0: no host tier; None: unlimited). Thread-safe."""

    def __init__(self, budget_bytes: int | None = None, host_budget_bytes: int | None = 0,
                 policy: Policy = "cost", half_life_s: float = 300.0,
                 clock_s: Callable[[], float] = time.monotonic,
                 timer_s: Callable[[], float] = time.perf_counter,
                 wall_s: Callable[[], float] = time.time) -> None:
        if policy not in POLICIES:
            raise ValueError(f"residency policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.policy: Policy = policy
        self.half_life_s = half_life_s
        self._clock_s = clock_s
        self._timer_s = timer_s
        """Times loads (a test's clock can make a build take a chosen time)."""
        self._wall_s = wall_s
        """The clock a load under way is announced on (the heartbeat's)."""
        self._window: LoadWindow | None = None
        self.loaded_at: float | None = None
        """When the last announced load ended (wall clock)."""
        self.load_wait_s = 0.0
        """Seconds of announced loads so far (a chunk's work is timed without them)."""
        self.on_load: Callable[[], None] | None = None
        """Called as an announced load begins and as it ends (a worker beats at once)."""
        self._entries: dict[str, _Entry] = {}
        self._adapters: dict[str, tuple[str, ...]] = {}
        self._adapter_costs: dict[str, float] = {}
        """Seconds of each adapter's last load (kept after it is unloaded)."""
        """Adapters loaded on each held model (its owner reports them: :meth:`note_adapters`)."""
        self._costs: dict[str, dict[str, float]] = {}
        """Measured load seconds per model and source tier, kept after the model is dropped."""
        self._reuse: dict[str, tuple[float, float]] = {}
        """(decayed count, as of) per model, kept after the model is dropped."""
        self._pinned: dict[str, int] = {}
        self._scope_depth = 0
        self._scoped: set[str] = set()
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._loading: str | None = None
        """The model being moved back from host memory or built: no tier evicts it."""
        self._staging: dict[str, threading.Event] = {}
        """Models being read into the host tier (:meth:`stage`): set when each read ends."""
        self.counters = _Counters()
        self._refused = 0
        self.recent: deque[LoadRecord] = deque(maxlen=RECENT_LOADS)

    # -- use ---------------------------------------------------------------------------------

    def acquire(self, key: str, build: Callable[[], T], kind: Resident,
                expect_s: Mapping[str, float] | None = None) -> T:
        """The model ``key``: resident already, moved back from host memory, or built by
        ``build``; room is made by evicting unpinned models first (when its size is known) and
        after. Inside :meth:`in_use` it stays pinned until the bracket closes. Loads run one at
        a time and outside the state lock: a heartbeat reading :meth:`summary` never waits for
        a build. A model being staged is waited for (then moved from host memory). A load is
        announced (:meth:`loading`) as taking ``expect_s`` of its source tier (``disk``,
        ``host``), else as long as its last load from that tier took."""
        with self._lock:
            if (hit := self._hit(key)) is not None:
                return hit  # type: ignore[no-any-return]
            staging = self._staging.get(key)
        if staging is not None:
            staging.wait()
        with self._load_lock:
            with self._lock:
                if (hit := self._hit(key)) is not None:  # loaded meanwhile by another thread
                    return hit  # type: ignore[no-any-return]
                now_s = self._clock_s()
                self._count_use(key, now_s)
                entry = self._entries.get(key)
                incoming = entry.bytes if entry is not None else self._last_bytes(key)
                self._loading = key
                try:
                    self._make_room(incoming, keep=key, what=key)
                except ModelMemoryError:
                    self._loading = None
                    raise
                source: Tier = "disk" if entry is None else "host"
                expected = (expect_s or {}).get(source, self._measured_s(key, source))
            try:
                with self.loading(key, expected, source):
                    started_s = self._timer_s()
                    if entry is not None:  # in host memory: moved back
                        if entry.kind.to_device is not None:
                            entry.kind.to_device(entry.value)
                    else:
                        entry = _Entry(key, build(), kind, build, "device", 0, now_s)
                    seconds = self._timer_s() - started_s
                entry.bytes = tensor_bytes(kind.tensors(entry.value))
            finally:
                with self._lock:
                    self._loading = None
            with self._lock:
                entry.tier, entry.last_use_s = "device", now_s
                self._entries[key] = entry
                self._loaded(entry, source, seconds, now_s)
                self._make_room(0, keep=key, what=key)
                self._pin_in_scope(key)
                return entry.value  # type: ignore[no-any-return]

    @contextmanager
    def loading(self, model: str, expected_s: float | None,
                source: LoadSource | None = None) -> Iterator[None]:
        """Announce a load a chunk waits for while it runs (``summary()["loading"]``), keep
        when it ended (``loaded_at``) and add its seconds to ``load_wait_s``; :attr:`on_load`
        is told as it begins and ends. A load inside
        another (a base model's build inside a runner's load of base and adapters) is part of
        the outer one: only the outermost is announced."""
        with self._lock:
            outer = self._window is None
            if outer:
                self._window = LoadWindow(model, self._wall_s(), expected_s, source)
        if not outer:
            yield
            return
        self._told()
        started_s = self._timer_s()
        try:
            yield
        finally:
            with self._lock:
                self._window, self.loaded_at = None, self._wall_s()
                self.load_wait_s += self._timer_s() - started_s
            self._told()

    def _told(self) -> None:
        if self.on_load is not None:
            try:
                self.on_load()
            except Exception:  # advisory: a load never fails over its announcement
                log.debug("on_load failed", exc_info=True)

    def peek(self, key: str) -> Any | None:
        """``key``'s model in either tier, without counting a use (None: not held)."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def _measured_s(self, key: str, source: Tier) -> float | None:
        """The last load of ``key`` from ``source``, else the mean of this worker's last loads
        of every model from it (None: none measured)."""
        own = self._costs.get(key, {}).get(source)
        if own is not None:
            return own
        theirs = [c[source] for c in self._costs.values() if source in c]
        return sum(theirs) / len(theirs) if theirs else None

    def expected_load_s(self, key: str, expect_s: Mapping[str, float] | None = None
                        ) -> float:
        """Seconds a chunk would wait to have ``key`` on the device now: 0 when it is there,
        else ``expect_s`` of the tier it would come from, or what :meth:`acquire` would
        announce for it (:meth:`_measured_s`; 0 when nothing was measured)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.tier == "device":
                return 0.0
            source: Tier = "disk" if entry is None else "host"
            return float((expect_s or {}).get(source, self._measured_s(key, source) or 0.0))

    def expected_adapters_s(self, adapters: Iterable[str]) -> float | None:
        """Seconds loading ``adapters`` is expected to take: each one's last measured load,
        else the mean of every adapter load measured here (None: none measured yet)."""
        with self._lock:
            costs = self._adapter_costs
            if not costs:
                return None
            mean = sum(costs.values()) / len(costs)
            return sum(costs.get(name, mean) for name in adapters)

    def stage(self, key: str, build: Callable[[], Any], kind: Resident) -> bool:
        """Read model ``key`` into the host tier ahead of its jobs (``build``, then
        ``kind.to_host``), evicting host-tier models by the policy to fit; the device tier is
        not touched. Runs on the caller's thread, beside chunks (a worker's stager thread);
        loads by :meth:`acquire` go on meanwhile. False, and nothing held, when there is no
        host tier, the model is held or being loaded already, it does not fit the host budget,
        or its build fails (logged: staging is advisory, the job's chunk builds it then)."""
        if kind.to_host is None or not self._host_tier():
            return False
        with self._lock:
            if key in self._entries or key in self._staging or key == self._loading:
                return False
            if not self._fits_host(self._last_bytes(key)):
                return False
            done = self._staging[key] = threading.Event()
        try:
            started_s = self._timer_s()
            try:
                value = build()
                kind.to_host(value)
                size = tensor_bytes(kind.tensors(value))
            except Exception:
                log.warning("staging %s into host memory failed", key, exc_info=True)
                return False
            seconds = self._timer_s() - started_s
            with self._lock:
                if key in self._entries or not self._fits_host(size):
                    return False  # built meanwhile by a chunk that could not wait, or too big
                now_s = self._clock_s()
                self._count_use(key, now_s)  # staged for queued jobs: a use is expected
                entry = _Entry(key, value, kind, build, "host", size, now_s)
                self._entries[key] = entry
                costs = self._costs.setdefault(key, {})
                costs["disk"], costs["bytes"] = seconds, size
                self.counters.staged += 1
                self.counters.stage_s += seconds
                self.recent.append(LoadRecord(key, "stage", seconds, size, now_s))
                self._make_room(0, keep=key, what=None)
                return True
        finally:
            with self._lock:
                self._staging.pop(key, None)
            done.set()

    def _fits_host(self, size: int) -> bool:
        return self.host_budget_bytes is None or size <= self.host_budget_bytes

    def _hit(self, key: str) -> Any | None:
        """``key``'s model if it is on the device (counted as a use), else None."""
        entry = self._entries.get(key)
        if entry is None or entry.tier != "device":
            return None
        now_s = self._clock_s()
        self._count_use(key, now_s)
        self.counters.hits += 1
        entry.last_use_s = now_s
        self._pin_in_scope(key)
        return entry.value

    def _pin_in_scope(self, key: str) -> None:
        if self._scope_depth > 0 and key not in self._scoped:
            self._scoped.add(key)
            self._pinned[key] = self._pinned.get(key, 0) + 1

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Pin every model acquired inside (nested brackets share the outermost) until it
        closes; then re-measure them (a MoE model's expert cache grows as it serves) and evict
        down to the budgets."""
        with self._lock:
            self._scope_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._scope_depth -= 1
                if self._scope_depth == 0:
                    used, self._scoped = self._scoped, set()
                    for key in used:
                        self._unpin(key)
                    self.remeasure(used)

    @contextmanager
    def pinned(self, key: str) -> Iterator[None]:
        """Pin ``key`` (resident or not yet) for the bracket."""
        with self._lock:
            self._pinned[key] = self._pinned.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._unpin(key)

    def remeasure(self, keys: Iterable[str] | None = None) -> None:
        """Measure the held models of ``keys`` (None: all) whose size changes as they serve
        again, and evict down to the budgets."""
        with self._lock:
            for key in self._entries if keys is None else keys:
                entry = self._entries.get(key)
                if entry is not None and entry.kind.grows:
                    entry.bytes = tensor_bytes(entry.kind.tensors(entry.value))
            self._make_room(0, keep=None, what=None)

    # -- what it holds -----------------------------------------------------------------------

    def holding(self, prefix: str = "") -> dict[str, Any]:
        """Models in the device or host tier whose key starts with ``prefix``."""
        with self._lock:
            return {k: e.value for k, e in self._entries.items() if k.startswith(prefix)}

    def tier_of(self, key: str) -> Tier:
        with self._lock:
            entry = self._entries.get(key)
            return "disk" if entry is None else entry.tier

    def tier_bytes(self, tier: Tier) -> int:
        with self._lock:
            return sum(e.bytes for e in self._entries.values() if e.tier == tier)

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._pinned.get(key, 0) > 0

    def forget(self, prefix: str) -> None:
        """Drop the unpinned models whose key starts with ``prefix`` (their owner is gone)."""
        with self._lock:
            for entry in [e for k, e in self._entries.items()
                          if k.startswith(prefix) and not self._pinned.get(k)]:
                self._drop(entry, evicted=False)

    def clear(self) -> None:
        """Forget every model (a fresh process), keeping the measured costs and counters."""
        with self._lock:
            self._entries.clear()
            self._adapters.clear()

    def note_adapters(self, key: str, names: Iterable[str]) -> None:
        """The adapters now loaded on held model ``key`` (the heartbeat's ``adapters``); they
        go with the model when it is dropped."""
        with self._lock:
            if key in self._entries:
                self._adapters[key] = tuple(names)

    def adapter_loaded(self, key: str, adapter: str, seconds: float) -> None:
        """Record one load of ``adapter`` onto held model ``key`` that took ``seconds``."""
        with self._lock:
            self._adapter_costs[adapter] = seconds
            self.counters.adapter_loads += 1
            self.counters.adapter_load_s += seconds
            self.recent.append(LoadRecord(key, "adapter", seconds, 0, self._clock_s(), adapter))

    def summary(self) -> dict[str, Any]:
        """The heartbeat's ``residency`` entry: bytes per model in each tier, budgets, load
        counts and seconds per source tier, evictions, and the most recent loads (their ``at``
        on the residency's clock, which ``clock`` reads now)."""
        with self._lock:
            c = self.counters
            return {
                "clock": round(self._clock_s(), 6),
                "policy": self.policy,
                "budget_bytes": self.budget_bytes,
                "host_budget_bytes": self.host_budget_bytes,
                "device": {k: e.bytes for k, e in self._entries.items() if e.tier == "device"},
                "host": {k: e.bytes for k, e in self._entries.items() if e.tier == "host"},
                "peak_device_bytes": c.peak_device_bytes,
                "hits": c.hits,
                "loads": dict(c.loads),
                "load_s": {k: round(v, 6) for k, v in c.load_s.items()},
                "evictions": dict(c.evictions),
                "adapters": {k: list(names) for k, names in self._adapters.items()
                             if names and k in self._entries},
                "adapter_loads": c.adapter_loads,
                "adapter_load_s": round(c.adapter_load_s, 6),
                "staging": sorted(self._staging),
                "staged": c.staged,
                "stage_s": round(c.stage_s, 6),
                "recent": [r.as_dict() for r in self.recent],
                **({"loading": self._window.as_dict()} if self._window is not None else {}),
                **({"loaded_at": round(self.loaded_at, 6)} if self.loaded_at is not None
                   else {}),
            }

    # -- policy ------------------------------------------------------------------------------

    def score(self, key: str, now_s: float | None = None) -> float:
        """Expected reuse × reload cost of ``key`` (the ``cost`` policy evicts the lowest);
        ``lru`` uses the last use time."""
        with self._lock:
            entry = self._entries[key]
            if self.policy == "lru":
                return entry.last_use_s
            now = self._clock_s() if now_s is None else now_s
            fallback = "host" if entry.tier == "device" and self._host_tier() else "disk"
            costs = self._costs.get(key, {})
            cost = costs.get(fallback, costs.get("disk", 0.0))
            return eviction_score(self._reuse.get(key), cost, now, self.half_life_s)

    def _host_tier(self) -> bool:
        return self.host_budget_bytes is None or self.host_budget_bytes > 0

    def _count_use(self, key: str, now_s: float) -> None:
        self._reuse[key] = counted_use(self._reuse.get(key), now_s, self.half_life_s)

    def _last_bytes(self, key: str) -> int:
        return int(self._costs.get(key, {}).get("bytes", 0))

    def _loaded(self, entry: _Entry, source: Tier, seconds: float, now_s: float) -> None:
        costs = self._costs.setdefault(entry.key, {})
        costs[source] = seconds
        costs["bytes"] = entry.bytes
        self.counters.loads[source] += 1
        self.counters.load_s[source] += seconds
        self.recent.append(LoadRecord(entry.key, source, seconds, entry.bytes, now_s))

    def _unpin(self, key: str) -> None:
        left = self._pinned.get(key, 0) - 1
        if left > 0:
            self._pinned[key] = left
        else:
            self._pinned.pop(key, None)

    def _victim(self, tier: Tier, keep: str | None) -> _Entry | None:
        """The policy's choice among ``tier``'s models other than ``keep``; on the device,
        pinned ones are spared (in the host tier nothing is in use)."""
        candidates = [e for e in self._entries.values()
                      if e.tier == tier and e.key not in (keep, self._loading)
                      and (tier != "device" or not self._pinned.get(e.key))]
        if not candidates:
            return None
        now_s = self._clock_s()
        return min(candidates, key=lambda e: (self.score(e.key, now_s), e.last_use_s))

    def _make_room(self, incoming: int, keep: str | None, what: str | None) -> None:
        """Evict until the device tier plus ``incoming`` bytes fits its budget (a device victim
        falls to the host tier when that can hold it), then the host tier to its own; raises
        :class:`ModelMemoryError` when the models in use leave no room."""
        refused = False
        if self.budget_bytes is not None:
            while self.tier_bytes("device") + incoming > self.budget_bytes:
                victim = self._victim("device", keep)
                if victim is None:
                    refused = True
                    break
                self._demote(victim)
        if refused:
            self._refuse(incoming, what)  # drops a just-built model that cannot stay
        if self.host_budget_bytes is not None:
            while self.tier_bytes("host") > self.host_budget_bytes:
                victim = self._victim("host", keep)
                if victim is None:  # only ``keep``, on its way back to the device
                    break
                self._drop(victim)
        device = self.tier_bytes("device")
        self.counters.peak_device_bytes = max(self.counters.peak_device_bytes, device)
        if refused:
            raise ModelMemoryError(self._refusal(incoming, what))

    def _refuse(self, incoming: int, what: str | None) -> None:
        """A model just built that does not fit beside the pinned ones goes again."""
        if what is not None and what in self._entries and self._entries[what].tier == "device":
            self._refused = self._entries[what].bytes
            del self._entries[what]

    def _refusal(self, incoming: int, what: str | None) -> str:
        held = {k: e.bytes for k, e in self._entries.items()
                if e.tier == "device" and self._pinned.get(k)}
        size = incoming or self._refused or self._last_bytes(what or "")
        return (f"model {what or '?'} ({size} bytes) does not fit in the device memory budget "
                f"of {self.budget_bytes} bytes beside the models in use ({held}); raise "
                "residency.memory_budget_bytes")

    def _demote(self, entry: _Entry) -> None:
        if entry.kind.to_host is not None and self._host_tier() and self._fits_host(entry.bytes):
            entry.kind.to_host(entry.value)
            entry.tier = "host"
            self.counters.evictions["host"] += 1
        else:
            self._drop(entry)

    def _drop(self, entry: _Entry, evicted: bool = True) -> None:
        del self._entries[entry.key]
        self._adapters.pop(entry.key, None)
        if evicted:
            self.counters.evictions["disk"] += 1
        if entry.kind.release is not None:
            entry.kind.release(entry.value)


_PROCESS = ModelResidency()
_PROCESS_LOCK = threading.Lock()


def process_residency() -> ModelResidency:
    """This process's residency (unlimited until :func:`configure` sets its budgets)."""
    return _PROCESS


def configure(budget_bytes: int | None, host_budget_bytes: int | None = 0,
              policy: Policy = "cost", half_life_s: float = 300.0) -> ModelResidency:
    """Set this process's budgets and policy (models held stay; the next acquisition or release
    evicts down to the new budgets)."""
    with _PROCESS_LOCK:
        r = _PROCESS
        with r._lock:
            r.budget_bytes, r.host_budget_bytes = budget_bytes, host_budget_bytes
            if policy not in POLICIES:
                raise ValueError(f"residency policy {policy!r}: use one of {', '.join(POLICIES)}")
            r.policy, r.half_life_s = policy, half_life_s
        return r
