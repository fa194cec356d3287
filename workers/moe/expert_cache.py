"""The per-worker expert cache: every expert in host memory, a device slot pool per layer sized
from a memory budget, loads on miss, eviction by policy, prefetch from routing history, warm-up,
idle unload and pinning of experts in use.

Time is injected: the worker calls :meth:`ExpertCache.tick` with ``time.monotonic()``; policy
code never reads a clock. On CPU a device slot is a separate tensor copy, so the budget and the
bytes moved are real there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from workers.errors import ExpertCacheError
from workers.moe.policy import EvictionPolicy, PolicyName, make_policy
from workers.moe.prefetch import RoutingHistory

ExpertKey = tuple[int, int]  # (layer, expert)
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Expert cache knobs; ``budget_bytes=None`` means every expert fits."""

    budget_bytes: int | None = None
    memory_threshold: float = 0.85
    idle_unload_s: float = 300.0
    warmup_experts: int = 16
    policy: PolicyName = "lfru"
    prefetch_experts: int = 2
    prefetch_min_confidence: float = 0.3


@dataclass(slots=True)
class CacheCounters:
    """Cumulative counters of one cache (per worker, across jobs)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    bytes_moved: int = 0
    evictions: int = 0
    idle_unloads: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        done = self.prefetch_used + self.prefetch_wasted
        return self.prefetch_used / done if done else 0.0


@dataclass(slots=True)
class HostExperts:
    """One model's fused expert weights in host memory, per MoE layer."""

    gate_up: dict[int, torch.Tensor]  # layer -> [E, 2I, H]
    down: dict[int, torch.Tensor]  # layer -> [E, H, I]

    @property
    def layers(self) -> list[int]:
        return sorted(self.gate_up)

    @property
    def num_experts(self) -> int:
        return int(next(iter(self.gate_up.values())).shape[0])

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate/up plus down projections)."""
        layer = self.layers[0]
        per = self.gate_up[layer][0].numel() + self.down[layer][0].numel()
        return per * self.gate_up[layer].element_size()

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * len(self.layers)


@dataclass(slots=True)
class _LayerSlots:
    """Residency of one layer: expert -> (gate_up, down) device tensors."""

    capacity: int
    policy: EvictionPolicy
    resident: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    last_use_s: dict[int, float] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    prefetched: set[int] = field(default_factory=set)


class ExpertCache:
    """Device-resident experts of one model, within ``budget_bytes * memory_threshold``."""

    def __init__(self, host: HostExperts, config: CacheConfig, device: str = "cpu") -> None:
        self.host = host
        self.config = config
        self.device = torch.device(device)
        self.counters = CacheCounters()
        self.history = RoutingHistory(host.layers, host.num_experts)
        self.slots_per_layer = slots_per_layer(host, config)
        self.now_s = 0.0
        self._layers = {
            layer: _LayerSlots(self.slots_per_layer, make_policy(config.policy))
            for layer in host.layers
        }
        self._previous: tuple[int, list[int]] | None = None

    # -- residency ---------------------------------------------------------------------------

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, tuple[torch.Tensor, ...]]:
        """Make ``experts`` of ``layer`` resident and pin them; returns their device weights.

        Call :meth:`release` when the forward pass no longer needs them.
        """
        self.ensure_resident(layer, experts)
        slots = self._layers[layer]
        slots.pinned.update(experts)
        return {e: slots.resident[e] for e in experts}

    def release(self, layer: int, experts: Iterable[int]) -> None:
        """Unpin experts acquired with :meth:`acquire`."""
        self._layers[layer].pinned.difference_update(experts)

    def ensure_resident(self, layer: int, experts: Sequence[int]) -> None:
        """Load the missing ones of ``experts`` (a miss each), evicting by policy if needed."""
        slots = self._layers[layer]
        if len(set(experts)) > slots.capacity:
            raise ExpertCacheError(
                f"layer {layer} needs {len(set(experts))} experts at once but holds "
                f"{slots.capacity}; acquire them in groups or raise moe.cache.budget_mb"
            )
        protected = set(experts)
        for expert in experts:
            self._touch(slots, expert)
            if expert in slots.resident:
                self.counters.hits += 1
                if expert in slots.prefetched:
                    slots.prefetched.discard(expert)
                    self.counters.prefetch_used += 1
            else:
                self.counters.misses += 1
                self._load(layer, expert, protected)

    def is_resident(self, layer: int, expert: int) -> bool:
        return expert in self._layers[layer].resident

    def resident_signature(self) -> frozenset[ExpertKey]:
        """The (layer, expert) pairs resident now: cheap, for expert-affinity routing."""
        return frozenset((layer, e) for layer, s in self._layers.items() for e in s.resident)

    def residency_summary(self, hot_experts: int = 16) -> dict[str, object]:
        """A compact, JSON-ready view for a worker's heartbeat: a hex bitmask of resident
        experts per layer, and the most frequently routed experts with their shares."""
        masks = {str(layer): format(sum(1 << e for e in s.resident), "x")
                 for layer, s in self._layers.items()}
        total = float(self.history.frequency.sum())
        hot = []
        for layer, expert in self.history.ranking()[:hot_experts]:
            count = float(self.history.frequency[self.history.layers.index(layer), expert])
            if count > 0:
                hot.append([layer, expert, round(count / total, 6)])
        return {"resident": masks, "hot": hot}

    def resident_bytes(self) -> int:
        return len(self.resident_signature()) * self.host.expert_bytes

    # -- routing history, prefetch, warm-up, idle unload --------------------------------------

    def observe_routing(self, layer: int, experts: Sequence[int]) -> None:
        """Record that a forward used ``experts`` at ``layer``; prefetch the next layer's."""
        previous = self._previous[1] if self._previous and self._previous[0] < layer else None
        self.history.record(layer, experts, previous)
        self._previous = (layer, list(experts))
        next_layer = self.history.next_layer(layer)
        if next_layer is None or self.config.prefetch_experts <= 0:
            self._previous = None if next_layer is None else self._previous
            return
        predicted = self.history.predict_next(layer, experts, self.config.prefetch_experts)
        for expert, confidence in predicted:
            self.prefetch(next_layer, expert, confidence)

    def prefetch(self, layer: int, expert: int, confidence: float = 1.0) -> bool:
        """Load ``expert`` ahead of need into a free slot, or over the policy's victim when the
        prediction is confident enough; True if it loaded."""
        slots = self._layers[layer]
        if expert in slots.resident or len(slots.pinned) >= slots.capacity:
            return False
        full = len(slots.resident) >= slots.capacity
        if full and confidence < self.config.prefetch_min_confidence:
            return False
        self._load(layer, expert, protected=set())
        slots.prefetched.add(expert)
        slots.last_use_s[expert] = self.now_s
        self.counters.prefetch_issued += 1
        return True

    def warm_up(self, ranking: Sequence[ExpertKey] | None = None) -> int:
        """Load the ``warmup_experts`` first of ``ranking`` (default: the routing history's)."""
        ranked = list(ranking) if ranking is not None else self.history.ranking()
        loaded = 0
        for layer, expert in ranked[: self.config.warmup_experts]:
            slots = self._layers[layer]
            if expert not in slots.resident and len(slots.resident) < slots.capacity:
                self._load(layer, expert, protected=set())
                slots.last_use_s[expert] = self.now_s
                loaded += 1
        return loaded

    def mirror(self, other: ExpertCache) -> int:
        """Load the experts resident in ``other`` (another version of the same model), hottest
        first, so a new version does not start cold against the live one; returns how many."""
        resident = other.resident_signature()
        ranked = [key for key in other.history.ranking() if key in resident]
        loaded = 0
        for layer, expert in ranked:
            slots = self._layers[layer]
            if expert not in slots.resident and len(slots.resident) < slots.capacity:
                self._load(layer, expert, protected=set())
                slots.last_use_s[expert] = self.now_s
                loaded += 1
        self.history.frequency += other.history.frequency
        self.history.transitions += other.history.transitions
        return loaded

    def tick(self, now_s: float) -> int:
        """Advance the cache's clock to ``now_s`` and unload idle experts; returns how many."""
        self.now_s = now_s
        unloaded = 0
        for layer, slots in self._layers.items():
            idle = [
                e
                for e in slots.resident
                if e not in slots.pinned
                and now_s - slots.last_use_s.get(e, now_s) >= self.config.idle_unload_s
            ]
            for expert in idle:
                self._evict(layer, expert)
                unloaded += 1
        self.counters.idle_unloads += unloaded
        return unloaded

    def end_forward(self) -> None:
        """A forward pass finished: the next ``observe_routing`` starts a new token."""
        self._previous = None

    # -- internals ----------------------------------------------------------------------------

    def _touch(self, slots: _LayerSlots, expert: int) -> None:
        slots.policy.record_access(expert)
        slots.last_use_s[expert] = self.now_s

    def _load(self, layer: int, expert: int, protected: set[int]) -> None:
        slots = self._layers[layer]
        if len(slots.resident) >= slots.capacity:
            candidates = [e for e in slots.resident if e not in slots.pinned | protected]
            if not candidates:
                raise ExpertCacheError(f"layer {layer}: every resident expert is pinned")
            self._evict(layer, slots.policy.choose_victim(candidates))
            self.counters.evictions += 1
        gate_up = self.host.gate_up[layer][expert].to(self.device, non_blocking=True, copy=True)
        down = self.host.down[layer][expert].to(self.device, non_blocking=True, copy=True)
        slots.resident[expert] = (gate_up, down)
        self.counters.loads += 1
        self.counters.bytes_moved += self.host.expert_bytes

    def _evict(self, layer: int, expert: int) -> None:
        slots = self._layers[layer]
        del slots.resident[expert]
        slots.last_use_s.pop(expert, None)
        slots.policy.forget(expert)
        if expert in slots.prefetched:
            slots.prefetched.discard(expert)
            self.counters.prefetch_wasted += 1


def slots_per_layer(host: HostExperts, config: CacheConfig) -> int:
    """Experts per layer that fit in ``budget_bytes * memory_threshold`` (at least one)."""
    if config.budget_bytes is None:
        return host.num_experts
    usable = config.budget_bytes * config.memory_threshold
    per_layer = int(usable // (host.expert_bytes * len(host.layers)))
    if per_layer < 1:
        need_mib = host.expert_bytes * len(host.layers) / config.memory_threshold / _MIB
        raise ExpertCacheError(
            f"an expert budget of {config.budget_bytes / _MIB:.2f} MiB holds no expert per "
            f"layer; set moe.cache.budget_mb to at least {need_mib:.2f}"
        )
    return min(per_layer, host.num_experts)


def signature_from_masks(masks: Mapping[str, str]) -> frozenset[ExpertKey]:
    """The residency signature a :meth:`ExpertCache.residency_summary` advertised."""
    keys: set[ExpertKey] = set()
    for layer, mask in masks.items():
        bits = int(mask, 16)
        keys.update((int(layer), e) for e in range(bits.bit_length()) if bits >> e & 1)
    return frozenset(keys)


def residency_fit(
    signature: frozenset[ExpertKey], expected: Mapping[ExpertKey, float] | Iterable[ExpertKey]
) -> float:
    """How well a worker's residency fits a job: the (weighted) share of the job's expected
    experts already resident, in [0, 1]; 1.0 when nothing is expected."""
    weights = expected if isinstance(expected, Mapping) else dict.fromkeys(expected, 1.0)
    total = sum(weights.values())
    if total <= 0:
        return 1.0
    return sum(w for key, w in weights.items() if key in signature) / total
