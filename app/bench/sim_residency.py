"""Model residency of one simulated worker: which base models its device and host memory hold
under byte budgets, which LoRA adapters are loaded on them, and what a chunk needing a model it
lacks pays first.

The eviction policies are those of ``workers.residency.ModelResidency`` on the same terms: ``lru``
evicts the least recently used model; ``cost`` the lowest *expected reuse × reload cost*, reuse an
exponentially decayed count of acquisitions (half-life ``half_life_s``), cost the seconds this
worker last measured loading it from the tier it would fall to (host memory when there is a host
tier, else disk). A device victim falls to host memory when the host tier can hold it, else to
disk; the host tier evicts by the same policy. The model a chunk is about to use is never the
victim (one chunk at a time: it is the only one in use).

Adapters are small next to a base (100 MB-1 GB against 1-20 GB) and are kept by count:
``adapter_slots`` on each resident base, least recently used first out, as the live runners
keep them (``MAX_LOADED_ADAPTERS`` per transformer, and per simulated model). A base moved to
host memory keeps its adapters there and brings them back (the live runners' adapters are layers
of the base's own modules, moved with it); a base dropped to disk loses them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from app.bench.models_workload import HOST_FRACTION, Catalog
from scheduler.placement import PlacementPolicy
from workers.residency import MAX_LOADED_ADAPTERS, adapters_to_unload, counted_use, eviction_score

Eviction = Literal["lru", "cost"]
GB = 1_000_000_000


@dataclass(frozen=True, slots=True)
class ResidencyConfig:
    """How a simulated run models residency and placement (None in ``SimConfig``: not at all)."""

    catalog: Catalog
    placement: PlacementPolicy = PlacementPolicy.STEPLINE
    eviction: Eviction = "cost"
    device_budget_bytes: int = 20 * GB
    host_budget_bytes: int = 0
    """0: no host tier (an evicted model goes back to disk)."""
    adapter_slots: int = MAX_LOADED_ADAPTERS
    """Adapters kept loaded on each resident base."""
    stage: bool = False
    """Stage models whose queue builds into host memory (``scheduler.placement.stage``)."""
    stage_min_queued: int = 2
    free_loads: bool = False
    """Every load takes no time (the oracle: a cluster whose every worker holds every model)."""
    loads_in_plan: bool = True
    """The planner counts a job's expected load into its remaining time (``JobView.load_s``)."""
    half_life_s: float = 300.0
    park_max_wait_s: float = 60.0
    """A chunk parked on a busy worker's own queue moves to its class queue after this wait."""
    seed: int = 11
    """Seeds the load-time draws (the same for every policy on a trace)."""


@dataclass(frozen=True, slots=True)
class Load:
    """What a chunk paid before it could run: its base model's load (None: resident) and its
    adapters'."""

    base_tier: str | None
    base_s: float
    adapters: int
    adapter_s: float

    @property
    def seconds(self) -> float:
        return self.base_s + self.adapter_s


@dataclass(slots=True)
class WorkerMemory:
    """One simulated worker's device and host tiers (model → last use time) and adapters."""

    config: ResidencyConfig
    rng: random.Random
    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    adapters: dict[str, float] = field(default_factory=dict)
    host_adapters: dict[str, float] = field(default_factory=dict)
    """Adapters loaded on the bases in host memory (back on the device with their base)."""
    reuse: dict[str, tuple[float, float]] = field(default_factory=dict)
    cost_s: dict[tuple[str, str], float] = field(default_factory=dict)
    peak_device_bytes: int = 0
    evictions: int = 0

    def bytes_of(self, model: str) -> int:
        return self.config.catalog.by_name[model].bytes

    def device_bytes(self) -> int:
        return sum(self.bytes_of(m) for m in self.device)

    def host_bytes(self) -> int:
        return sum(self.bytes_of(m) for m in self.host)

    def free_device_bytes(self) -> int:
        return self.config.device_budget_bytes - self.device_bytes()

    def free_host_bytes(self) -> int:
        return self.config.host_budget_bytes - self.host_bytes()

    def acquire(self, model: str, adapters: tuple[str, ...], now_s: float,
                spare: frozenset[str] = frozenset()) -> Load:
        """Make ``model`` and ``adapters`` resident for a chunk starting now: the loads it pays.
        ``spare``: models of jobs in progress whose next chunks wait on this worker, evicted
        only when nothing else can go (a job in flight keeps its model, as a running chunk's
        is pinned)."""
        self._count_use(model, now_s)
        tier: str | None = None
        base_s = 0.0
        if model not in self.device:
            tier = "host" if model in self.host else "disk"
            self.host.pop(model, None)
            for a in _of_base(self.host_adapters, model):
                self.adapters[a] = self.host_adapters.pop(a)
            self._make_room(self.bytes_of(model), keep=model, now_s=now_s, spare=spare)
            base_s = self._draw(model, tier)
            self.cost_s[(model, tier)] = base_s
        self.device[model] = now_s
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes())
        missing = [a for a in adapters if a not in self.adapters]
        adapter_s = sum(self._draw_adapter() for _ in missing)
        for a in adapters:
            self.adapters[a] = now_s
        on_base = sorted(_of_base(self.adapters, model), key=self.adapters.__getitem__)
        for a in adapters_to_unload(on_base, adapters, self.config.adapter_slots):
            del self.adapters[a]
        return Load(tier, base_s, len(missing), adapter_s)

    def stage(self, model: str, now_s: float) -> bool:
        """``model`` read into host memory ahead of its jobs (False: it is resident already,
        or the host tier cannot hold it)."""
        if model in self.device or model in self.host \
                or self.bytes_of(model) > self.config.host_budget_bytes:
            return False
        self.host[model] = now_s
        self._trim_host(keep=model, now_s=now_s)
        return True

    def score(self, model: str, fallback: str, now_s: float) -> float:
        """Expected reuse × reload cost (``workers.residency.ModelResidency.score``)."""
        cost = self.cost_s.get((model, fallback), self.cost_s.get((model, "disk"), 0.0))
        return eviction_score(self.reuse.get(model), cost, now_s, self.config.half_life_s)

    def _count_use(self, model: str, now_s: float) -> None:
        self.reuse[model] = counted_use(self.reuse.get(model), now_s, self.config.half_life_s)

    def _victim(self, tier: dict[str, float], keep: str, fallback: str,
                now_s: float, spare: frozenset[str] = frozenset()) -> str | None:
        candidates = [m for m in tier if m != keep and m not in spare] or [
            m for m in tier if m != keep]
        if not candidates:
            return None
        if self.config.eviction == "lru":
            return min(candidates, key=lambda m: (tier[m], m))
        return min(candidates, key=lambda m: (self.score(m, fallback, now_s), tier[m], m))

    def _make_room(self, incoming: int, keep: str, now_s: float,
                   spare: frozenset[str] = frozenset()) -> None:
        host_tier = self.config.host_budget_bytes > 0
        fallback = "host" if host_tier else "disk"
        while self.device_bytes() + incoming > self.config.device_budget_bytes:
            victim = self._victim(self.device, keep, fallback, now_s, spare)
            if victim is None:
                raise ValueError(f"model {keep} ({incoming} bytes) exceeds the device budget "
                                 f"of {self.config.device_budget_bytes} bytes")
            last = self.device.pop(victim)
            self.evictions += 1
            kept = host_tier and self.bytes_of(victim) <= self.config.host_budget_bytes
            for a in _of_base(self.adapters, victim):
                at_s = self.adapters.pop(a)
                if kept:
                    self.host_adapters[a] = at_s
            if kept:
                self.host[victim] = last
        self._trim_host(keep=keep, now_s=now_s)

    def _trim_host(self, keep: str, now_s: float) -> None:
        while self.host_bytes() > self.config.host_budget_bytes:
            victim = self._victim(self.host, keep, "disk", now_s)
            if victim is None:
                break
            del self.host[victim]
            for a in _of_base(self.host_adapters, victim):
                del self.host_adapters[a]

    def read_into_host_s(self, model: str) -> float:
        """Seconds to read ``model`` from disk into host memory (staging): a load from disk
        less the host-to-device part it skips."""
        return self._draw(model, "disk") * (1.0 - HOST_FRACTION)

    def _draw(self, model: str, tier: str) -> float:
        seconds = self.config.catalog.draw_load_s(self.rng, model, tier)
        return 0.0 if self.config.free_loads else seconds

    def _draw_adapter(self) -> float:
        seconds = self.config.catalog.draw_adapter_s(self.rng)
        return 0.0 if self.config.free_loads else seconds


def _of_base(adapters: dict[str, float], model: str) -> list[str]:
    """The adapters of base ``model`` among ``adapters`` (an adapter is named ``<base>/<n>``)."""
    return [a for a in adapters if a.split("/", 1)[0] == model]
