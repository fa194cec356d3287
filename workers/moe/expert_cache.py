"""The per-worker expert cache: every expert in host memory, device slots per layer sized from
a memory budget, loads on miss, eviction by policy, prefetch of the next layer's experts on a
side copy lane, slots rebalanced toward the layers that reuse them, warm-up, idle unload and
pinning of experts in use.

How one forward pass drives it, layer by layer: the router calls :meth:`ExpertCache.observe_routing`
as soon as the layer is routed (with the lookahead for the next layer, if any); that records the
routing and issues the next layer's prefetches, which copy while this layer computes. The experts
module then :meth:`~ExpertCache.acquire`\\ s the routed experts (waiting for any still in flight)
and :meth:`~ExpertCache.release`\\ s them; :meth:`~ExpertCache.end_forward` closes the token.

Time is injected: the worker calls :meth:`ExpertCache.tick` with ``time.monotonic()``; policy
code never reads a clock. On CPU a device slot is a separate tensor copy, so the budget and the
bytes moved are real there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch

from workers.errors import ExpertCacheError
from workers.moe.allocation import ReuseTracker
from workers.moe.copy import CopyEngine, CopyHandle, Weights, copier_for
from workers.moe.policy import EvictionPolicy, PolicyName, make_policy
from workers.moe.prefetch import (
    Calibration,
    Lookahead,
    LookaheadAccuracy,
    RoutingHistory,
    lookahead_inclusion,
)

ExpertKey = tuple[int, int]  # (layer, expert)
Allocation = Literal["uniform", "reuse"]
_MIB = 1024 * 1024
_MAX_GROWTH = 3
"""A layer holds at most this many times its uniform share of slots after rebalancing."""
_REUSE_WINDOW = 1024
"""Tokens per layer whose reuse decides the slot split."""
_UNTRUSTED_LOOKAHEAD = 0.5
_USEFUL_LOOKAHEAD = 0.5
"""Below this measured accuracy a layer's lookahead is computed only to probe it again."""
_PROBE_EVERY = 2
_IDLE_PREDICTIONS = 512
"""Predictions in a row that issued nothing before a layer is only probed."""
"""The accuracy a layer's lookahead is credited with before it has been scored once."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Expert cache knobs; ``budget_bytes=None`` means every expert fits."""

    budget_bytes: int | None = None
    memory_threshold: float = 0.85
    idle_unload_s: float = 300.0
    warmup_experts: int = 16
    policy: PolicyName = "lfru"
    allocation: Allocation = "reuse"
    """``uniform``: every layer the same slots; ``reuse``: the same total, rebalanced every
    ``rebalance_every`` forwards toward the layers whose measured reuse gains most per slot."""
    rebalance_every: int = 256
    prefetch_experts: int = 2
    """Most experts of the next layer prefetched per layer per forward (0 disables)."""
    prefetch_min_confidence: float = 0.5
    """Least estimated chance of being routed for a prefetch (it costs a slot and a copy)."""
    lookahead_weight: float = 0.7
    """Weight of the next router's lookahead against routing history when both predict."""
    history_decay: float = 0.999
    """Per-observation decay of routing history counts (half-life ~700 tokens per layer)."""
    overlap: bool = True
    """Prefetches copy on a side lane (CUDA stream, or a copy thread on the CPU)."""


@dataclass(slots=True)
class CacheCounters:
    """Cumulative counters of one cache (per worker, across jobs).

    Every access is exactly one of ``hits`` (resident and arrived: no stall), ``late`` (a
    prefetch still in flight: a shorter stall) or ``misses`` (a demand load: a full stall)."""

    hits: int = 0
    misses: int = 0
    late: int = 0
    loads: int = 0
    bytes_moved: int = 0
    bytes_prefetched: int = 0
    evictions: int = 0
    idle_unloads: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    """Prefetched experts used before eviction (in time or late)."""
    prefetch_late: int = 0
    """Of those, used while still in flight (the wait was shorter than a demand load)."""
    prefetch_wasted: int = 0
    """Prefetched experts evicted or unloaded without being used."""
    stall_s: float = 0.0
    """Time the forward waited for expert copies (demand loads and late prefetches)."""
    late_wait_s: float = 0.0
    """Of that, waiting on late prefetches."""
    lookahead_scored: int = 0
    lookahead_overlap: float = 0.0
    """Sum over scored lookahead predictions of their top-k overlap with the routed experts."""
    rebalances: int = 0
    expert_runs: int = 0
    """Experts run through :meth:`ExpertCache.acquire`: one per expert, layer and forward, however
    many tokens (batched rows) that forward routes to it."""
    token_lookups: int = 0
    """Token x expert routings those runs served: ``token_lookups / expert_runs`` is how many
    tokens one read of an expert's weights serves (1 in single-job decode, up to the number of
    rows in batched decode)."""
    token_hits: int = 0
    """Of ``token_lookups``, those whose expert was a stall-free hit."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @property
    def token_hit_rate(self) -> float:
        """Stall-free share of token routings (``hit_rate`` weighted by the tokens served)."""
        return self.token_hits / self.token_lookups if self.token_lookups else 0.0

    @property
    def tokens_per_run(self) -> float:
        """Token routings served per expert run."""
        return self.token_lookups / self.expert_runs if self.expert_runs else 0.0

    @property
    def tokens_per_load(self) -> float:
        """Token routings served per expert load (demand, warm-up or prefetch copy)."""
        return self.token_lookups / self.loads if self.loads else 0.0

    @property
    def accesses(self) -> int:
        return self.hits + self.late + self.misses

    @property
    def hit_rate(self) -> float:
        """Stall-free share of accesses (hits, including prefetches that arrived in time)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        done = self.prefetch_used + self.prefetch_wasted
        return self.prefetch_used / done if done else 0.0

    @property
    def lookahead_accuracy(self) -> float | None:
        return self.lookahead_overlap / self.lookahead_scored if self.lookahead_scored else None


@dataclass(slots=True)
class HostExperts:
    """One model's fused expert weights in host memory, per MoE layer. Families whose experts
    carry biases (gpt-oss) hold them beside the weights; an expert's slice is its row of each."""

    gate_up: dict[int, torch.Tensor]  # layer -> [E, 2I, H] ([E, H, 2I] for gpt-oss)
    down: dict[int, torch.Tensor]  # layer -> [E, H, I] ([E, I, H] for gpt-oss)
    gate_up_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, 2I]
    down_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, H]
    shared_bytes: int = 0
    """Bytes of the model's shared experts (DeepSeek-V3), all layers: dense MLPs every token
    runs, always resident beside the cache (model parameters, never evicted); the cache's
    budget holds them first and its slots share what is left."""

    @property
    def layers(self) -> list[int]:
        return sorted(self.gate_up)

    @property
    def num_experts(self) -> int:
        return int(next(iter(self.gate_up.values())).shape[0])

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's slice (gate/up plus down projections, and their biases)."""
        return sum(t.numel() * t.element_size() for t in self.weights(self.layers[0], 0))

    def weights(self, layer: int, expert: int) -> Weights:
        """Expert ``expert``'s slice of layer ``layer``: (gate_up, down), then (gate_up bias,
        down bias) for a family with expert biases."""
        if layer in self.gate_up_bias:
            return (self.gate_up[layer][expert], self.down[layer][expert],
                    self.gate_up_bias[layer][expert], self.down_bias[layer][expert])
        return self.gate_up[layer][expert], self.down[layer][expert]

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every host tensor (weights and biases), for the model residency."""
        for part in (self.gate_up, self.down, self.gate_up_bias, self.down_bias):
            yield from part.values()


@dataclass(slots=True)
class _Slot:
    """A resident expert: its device weights, or the copy still bringing them."""

    weights: Weights | None
    handle: CopyHandle | None = None


@dataclass(slots=True)
class _LayerSlots:
    """Residency of one layer."""

    capacity: int
    policy: EvictionPolicy
    resident: dict[int, _Slot] = field(default_factory=dict)
    last_use_s: dict[int, float] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    protected: set[int] = field(default_factory=set)
    """Prefetched for this layer's coming forward, or routed in its current one: evicted only
    when nothing else can go."""
    prefetched: set[int] = field(default_factory=set)
    """Prefetched and not used yet."""


class ExpertCache:
    """Device-resident experts of one model, within ``budget_bytes * memory_threshold``."""

    def __init__(self, host: HostExperts, config: CacheConfig, device: str = "cpu",
                 copier: CopyEngine | None = None, min_slots: int = 1) -> None:
        self.host = host
        self.config = config
        self.device = torch.device(device)
        self.copier = copier or copier_for(self.device, config.overlap)
        self.counters = CacheCounters()
        self._expert_bytes = host.expert_bytes
        self.slots_per_layer = slots_per_layer(host, config)
        """The uniform share of the budget per layer (layers may hold more or fewer)."""
        self.min_slots = max(1, min(min_slots, self.slots_per_layer))
        self.token_group = 2 * max(1, min_slots)
        """Routings of at most this many experts are one token's (decode); larger ones are a
        prefill's union, which teaches nothing about what follows what and needs no prefetch."""
        self.history = RoutingHistory(host.layers, host.num_experts, config.history_decay,
                                      max_group=self.token_group)
        self.lookahead = LookaheadAccuracy()
        self.calibration = Calibration()
        self._candidates: dict[int, list[tuple[int, float]]] = {}
        """Per layer, the raw confidences of the last prediction for it, to calibrate against
        what the layer then routes."""
        self.reuse = ReuseTracker(window=_REUSE_WINDOW)
        self.now_s = 0.0
        self._layers = {
            layer: _LayerSlots(self.slots_per_layer,
                               make_policy(config.policy, self.slots_per_layer))
            for layer in host.layers
        }
        self._previous: tuple[int, list[int]] | None = None
        self._predicted: dict[int, Lookahead] = {}
        self._forwards = 0
        self._idle_predictions: dict[int, int] = {}

    # -- residency ---------------------------------------------------------------------------

    def capacity(self, layer: int) -> int:
        """Slots ``layer`` holds now."""
        return self._layers[layer].capacity

    def capacities(self) -> dict[int, int]:
        return {layer: s.capacity for layer, s in self._layers.items()}

    def acquire(self, layer: int, experts: Sequence[int],
                tokens: Mapping[int, int] | None = None) -> dict[int, Weights]:
        """Make ``experts`` of ``layer`` resident and pin them, to run them once each; returns
        their device weights. ``tokens``: per expert, the token routings its run serves (None:
        one each, a single decode token's).

        Call :meth:`release` when the forward pass no longer needs them.
        """
        hits = self._serve(layer, experts)
        for expert, hit in zip(experts, hits, strict=True):
            served = 1 if tokens is None else tokens.get(expert, 0)
            self.counters.expert_runs += 1
            self.counters.token_lookups += served
            self.counters.token_hits += served if hit else 0
        slots = self._layers[layer]
        slots.pinned.update(experts)
        return {e: self._arrived(slots, e) for e in experts}

    def release(self, layer: int, experts: Iterable[int]) -> None:
        """Unpin experts acquired with :meth:`acquire`."""
        self._layers[layer].pinned.difference_update(experts)

    def ensure_resident(self, layer: int, experts: Sequence[int]) -> None:
        """Count and serve each access: a hit, a late prefetch (wait for it) or a miss (load
        it, evicting by policy if needed)."""
        self._serve(layer, experts)

    def _serve(self, layer: int, experts: Sequence[int]) -> list[bool]:
        """:meth:`ensure_resident`; per expert, whether it was a stall-free hit."""
        slots = self._layers[layer]
        needed = set(experts)
        if len(needed) > slots.capacity:
            raise ExpertCacheError(
                f"layer {layer} needs {len(needed)} experts at once but holds "
                f"{slots.capacity}; acquire them in groups or raise moe.cache.budget_mb"
            )
        return [self._serve_one(layer, slots, expert, needed) for expert in experts]

    def _serve_one(self, layer: int, slots: _LayerSlots, expert: int, needed: set[int]) -> bool:
        hit = False
        entry = slots.resident.get(expert)
        if entry is None:
            self.counters.misses += 1
            self._make_room(layer, needed)
            started = self.copier.now()
            weights, _ = self.copier.copy(self.host.weights(layer, expert), False).wait()
            self.counters.stall_s += self.copier.now() - started
            slots.resident[expert] = _Slot(weights)
            self._count_load(prefetch=False)
        elif entry.weights is None:
            assert entry.handle is not None
            if entry.handle.ready():
                self.counters.hits += 1
                hit = True
            else:
                self.counters.late += 1
                started = self.copier.now()
                self._arrived(slots, expert)
                waited = self.copier.now() - started
                self.counters.stall_s += waited
                self.counters.late_wait_s += waited
                if expert in slots.prefetched:
                    self.counters.prefetch_late += 1
        else:
            self.counters.hits += 1
            hit = True
        if expert in slots.prefetched:
            slots.prefetched.discard(expert)
            self.counters.prefetch_used += 1
        self._touch(slots, expert)
        return hit

    def is_resident(self, layer: int, expert: int) -> bool:
        """Resident or on its way (a prefetch in flight holds its slot)."""
        return expert in self._layers[layer].resident

    def resident_signature(self) -> frozenset[ExpertKey]:
        """The (layer, expert) pairs resident now: cheap, for expert-affinity routing."""
        return frozenset((layer, e) for layer, s in self._layers.items() for e in s.resident)

    def residency_summary(self, hot_experts: int = 16) -> dict[str, object]:
        """A compact, JSON-ready view for a worker's heartbeat: a hex bitmask of resident
        experts per layer, and the most frequently routed experts with their shares."""
        masks = {str(layer): format(sum(1 << e for e in s.resident), "x")
                 for layer, s in self._layers.items()}
        hot = []
        layers = len(self._layers)
        for layer, expert in self.history.ranking()[:hot_experts]:
            share = self.history.share(layer, expert) / layers
            if share > 0:
                hot.append([layer, expert, round(share, 6)])
        return {"resident": masks, "hot": hot}

    def tensors(self) -> Iterator[torch.Tensor]:
        """The device copies of the resident experts (arrived ones)."""
        for slots in list(self._layers.values()):
            for slot in list(slots.resident.values()):
                if slot.weights is not None:
                    yield from slot.weights

    def resident_bytes(self) -> int:
        return len(self.resident_signature()) * self.host.expert_bytes

    # -- routing history, prefetch, rebalancing, warm-up, idle unload ------------------------

    def begin_request(self) -> None:
        """A new request starts: its first layer does not follow the last request's last."""
        self._previous = None
        self._predicted.clear()
        self._candidates.clear()

    def observe_routing(self, layer: int, experts: Sequence[int],
                        lookahead: Lookahead | None = None) -> None:
        """``layer`` was just routed to ``experts`` (before they run): record it, score the
        lookahead made for this layer, and prefetch the next layer's likely experts (from
        ``lookahead``, the next router applied to this layer's hidden state, and history)."""
        slots = self._layers[layer]
        routed = sorted(set(experts))
        # Predictions for this layer are settled: the routed experts stay protected through this
        # forward; wrong guesses become ordinary residents (the policy decides their fate).
        slots.protected = set(routed)
        token = len(routed) <= self.token_group
        candidates = self._candidates.pop(layer, None)
        if candidates is not None and token:
            for expert, raw in candidates:
                self.calibration.observe(raw, expert in routed)
        prediction = self._predicted.pop(layer, None)
        if prediction is not None and token:
            self.counters.lookahead_scored += 1
            self.counters.lookahead_overlap += self.lookahead.score(prediction, routed)
        previous = None
        if self._previous is not None and self._previous[0] == self._layer_before(layer):
            previous = self._previous[1]
        self.history.record(layer, routed, previous)
        if token:  # a prefill's union would read as "every slot is needed at once"
            self.reuse.record(layer, routed)
        self._previous = (layer, routed)
        if lookahead is not None:
            self._predicted[lookahead.layer] = lookahead
        if self.config.prefetch_experts > 0 and token and self._worth_predicting(layer):
            self._prefetch_after(layer, routed, lookahead)

    def wants_lookahead(self, layer: int) -> bool:
        """Whether a lookahead for the layer after ``layer`` is worth computing now: prefetch is
        on, that layer has experts left to bring, and its lookahead has proven useful (one
        token in ``_PROBE_EVERY`` still probes a layer whose lookahead has not, so a predictor
        that starts working is noticed)."""
        if self.config.prefetch_experts <= 0 or not self._worth_predicting(layer):
            return False
        accuracy = self.lookahead.recent(self.history.next_layer(layer))
        useful = accuracy is None or accuracy >= _USEFUL_LOOKAHEAD
        return useful or self._forwards % _PROBE_EVERY == 0

    def predict_next(self, layer: int, experts: Sequence[int], lookahead: Lookahead | None = None,
                     count: int = 8) -> list[tuple[int, float]]:
        """The ``count`` likeliest experts of the next layer that are not resident, most likely
        first, each with its estimated chance of being routed (lookahead blended with history)."""
        next_layer = self.history.next_layer(layer)
        confidence = self.history.inclusion(layer, experts)
        if lookahead is not None and lookahead.layer == next_layer:
            accuracy = self.lookahead.recent(next_layer)
            accuracy = _UNTRUSTED_LOOKAHEAD if accuracy is None else accuracy
            ahead = lookahead_inclusion(lookahead, accuracy, self.host.num_experts,
                                        max(1, len(experts)))
            w = self.config.lookahead_weight
            confidence = w * ahead + (1.0 - w) * confidence
        resident = list(self._layers[next_layer].resident)
        if resident:
            confidence[resident] = -1.0  # ranked among the experts a prefetch would bring
        order = np.argsort(-confidence, kind="stable")[:count]
        raw = [(int(e), float(confidence[e])) for e in order if confidence[e] > 0.0]
        self._candidates[next_layer] = raw
        calibrated = [(e, self.calibration(c)) for e, c in raw]
        return sorted(calibrated, key=lambda item: -item[1])

    def prefetch(self, layer: int, expert: int, confidence: float = 1.0) -> bool:
        """Start copying ``expert`` of ``layer`` ahead of need, into a free slot or over the
        policy's victim; it is protected until that layer has been routed. True if started."""
        slots = self._layers[layer]
        if expert in slots.resident or confidence < self.config.prefetch_min_confidence:
            return False
        if len(slots.resident) >= slots.capacity and not self._evict_one(
                layer, slots.pinned, protected_too=False):
            return False
        handle = self.copier.copy(self.host.weights(layer, expert), True)
        slots.resident[expert] = _Slot(None, handle)
        slots.prefetched.add(expert)
        slots.protected.add(expert)
        self._touch(slots, expert)  # a prefetch is an access: the policy must not evict it first
        self.counters.prefetch_issued += 1
        self._count_load(prefetch=True)
        return True

    def end_forward(self) -> None:
        """A forward pass (one token step) finished; rebalances slots every so often."""
        self._forwards += 1
        every = self.config.rebalance_every
        if self.config.allocation == "reuse" and every > 0 and self._forwards % every == 0:
            self.rebalance()

    def rebalance(self) -> dict[int, int]:
        """Re-split the layers' total slots by measured reuse (more slots where they gain more
        hits); a layer that shrinks evicts by its policy. Returns the new capacities."""
        total = self.slots_per_layer * len(self._layers)
        most = min(self.host.num_experts, _MAX_GROWTH * self.slots_per_layer)
        # A layer keeps at least half its share: the plan reads LRU curves, which undersell
        # what a frequency-aware policy gets from a few slots in a skewed layer.
        least = max(self.min_slots, self.slots_per_layer // 2)
        plan = self.reuse.plan(total, dict.fromkeys(self._layers, least),
                               dict.fromkeys(self._layers, most))
        if not plan:
            return self.capacities()
        for layer, capacity in plan.items():
            slots = self._layers[layer]
            capacity = max(capacity, len(slots.pinned), self.min_slots)
            while len(slots.resident) > capacity:
                self._evict_one(layer, slots.pinned)
            slots.capacity = capacity
            slots.policy.resize(capacity)
        self.counters.rebalances += 1
        return self.capacities()

    def warm_up(self, ranking: Sequence[ExpertKey] | None = None) -> int:
        """Load the ``warmup_experts`` first of ``ranking`` (default: the routing history's)."""
        ranked = list(ranking) if ranking is not None else self.history.ranking()
        loaded = 0
        for layer, expert in ranked[: self.config.warmup_experts]:
            if self._fill(layer, expert):
                loaded += 1
        return loaded

    def mirror(self, other: ExpertCache) -> int:
        """Load the experts resident in ``other`` (another version of the same model), hottest
        first, with its slot split, so a new version does not start cold against the live one;
        returns how many."""
        for layer, capacity in other.capacities().items():
            self._layers[layer].capacity = capacity
            self._layers[layer].policy.resize(capacity)
        resident = other.resident_signature()
        ranked = [key for key in other.history.ranking() if key in resident]
        loaded = sum(1 for layer, expert in ranked if self._fill(layer, expert))
        self.history.merge(other.history)
        self.reuse.merge(other.reuse)
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

    def close(self) -> None:
        """Stop the copy lane (pending prefetches finish)."""
        self.copier.close()

    # -- internals ----------------------------------------------------------------------------

    def _layer_before(self, layer: int) -> int:
        layers = self.history.layers
        return layers[(layers.index(layer) - 1) % len(layers)]

    def _worth_predicting(self, layer: int) -> bool:
        """False while the layer after ``layer`` has nothing left to bring, or its recent
        predictions have issued no prefetch (then one token in ``_PROBE_EVERY`` tries again):
        a prediction costs the forward pass time, so it must earn it."""
        next_layer = self.history.next_layer(layer)
        if len(self._layers[next_layer].resident) >= self.host.num_experts:
            return False
        idle = self._idle_predictions.get(next_layer, 0) >= _IDLE_PREDICTIONS
        return not idle or self._forwards % _PROBE_EVERY == 0

    def _prefetch_after(self, layer: int, routed: Sequence[int],
                        lookahead: Lookahead | None) -> None:
        next_layer = self.history.next_layer(layer)
        issued = 0
        count = self.config.prefetch_experts
        for expert, confidence in self.predict_next(layer, routed, lookahead, 2 * count):
            if issued >= self.config.prefetch_experts:
                break
            if confidence < self.config.prefetch_min_confidence:
                break
            if self.prefetch(next_layer, expert, confidence):
                issued += 1
        self._idle_predictions[next_layer] = (
            0 if issued else self._idle_predictions.get(next_layer, 0) + 1)

    def _fill(self, layer: int, expert: int) -> bool:
        """Load ``expert`` into a free slot (no eviction); True if it loaded."""
        slots = self._layers[layer]
        if expert in slots.resident or len(slots.resident) >= slots.capacity:
            return False
        weights, _ = self.copier.copy(self.host.weights(layer, expert), False).wait()
        slots.resident[expert] = _Slot(weights)
        slots.last_use_s[expert] = self.now_s
        self._count_load(prefetch=False)
        return True

    def _arrived(self, slots: _LayerSlots, expert: int) -> Weights:
        entry = slots.resident[expert]
        if entry.weights is None:
            assert entry.handle is not None
            entry.weights, _ = entry.handle.wait()
            entry.handle = None
        return entry.weights

    def _touch(self, slots: _LayerSlots, expert: int) -> None:
        slots.policy.record_access(expert)
        slots.last_use_s[expert] = self.now_s

    def _make_room(self, layer: int, needed: set[int]) -> None:
        slots = self._layers[layer]
        if len(slots.resident) < slots.capacity:
            return
        if not self._evict_one(layer, slots.pinned | needed):
            raise ExpertCacheError(f"layer {layer}: every resident expert is pinned")

    def _evict_one(self, layer: int, keep: set[int], protected_too: bool = True) -> bool:
        """Evict the policy's victim among the residents outside ``keep``, sparing protected
        ones (pending prefetches, this forward's routing) unless nothing else can go and
        ``protected_too`` allows it; False if there was no candidate."""
        slots = self._layers[layer]
        candidates = [e for e in slots.resident if e not in keep and e not in slots.protected]
        if not candidates and protected_too:
            candidates = [e for e in slots.resident if e not in keep]
        if not candidates:
            return False
        self._evict(layer, slots.policy.choose_victim(candidates))
        self.counters.evictions += 1
        return True

    def _count_load(self, prefetch: bool) -> None:
        self.counters.loads += 1
        self.counters.bytes_moved += self._expert_bytes
        if prefetch:
            self.counters.bytes_prefetched += self._expert_bytes

    def _evict(self, layer: int, expert: int) -> None:
        slots = self._layers[layer]
        del slots.resident[expert]
        slots.last_use_s.pop(expert, None)
        slots.protected.discard(expert)
        slots.policy.forget(expert)
        if expert in slots.prefetched:
            slots.prefetched.discard(expert)
            self.counters.prefetch_wasted += 1


def slots_per_layer(host: HostExperts, config: CacheConfig) -> int:
    """Experts per layer that fit in ``budget_bytes * memory_threshold``, less the shared
    experts (at least one)."""
    if config.budget_bytes is None:
        return host.num_experts
    usable = config.budget_bytes * config.memory_threshold - host.shared_bytes
    per_layer = int(max(0.0, usable) // (host.expert_bytes * len(host.layers)))
    if per_layer < 1:
        need = host.expert_bytes * len(host.layers) + host.shared_bytes
        shared = f" beside {host.shared_bytes} bytes of shared experts" if host.shared_bytes else ""
        raise ExpertCacheError(
            f"an expert budget of {config.budget_bytes / _MIB:.2f} MiB holds no expert per "
            f"layer{shared}; set moe.cache.budget_mb to at least "
            f"{need / config.memory_threshold / _MIB:.2f}"
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
