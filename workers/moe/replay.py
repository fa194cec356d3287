"""Replay a routing trace through the project's own :class:`ExpertCache` on a simulated link,
and compare it with Belady's optimum on the same sequences.

The cache under replay is the live one (same policies, prefetch, protection, rebalancing); only
the copy engine is simulated: a virtual clock advances by one unit per MoE layer computed, and
copying one expert takes ``copy_cost`` units on a single host-to-device link (demand copies jump
the prefetch queue). So "in time" means what it means on a device: the copy finished before the
layer that needs it started. Expert tensors are one element each: the replay counts bytes in
experts, and ratios to demand paging are what it reports.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from workers.moe.copy import SimulatedCopier, VirtualClock
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts
from workers.moe.policy import POLICY_NAMES, PolicyName, belady_hits
from workers.moe.prefetch import Lookahead
from workers.moe.traces import RequestTrace, RoutingTrace

DEFAULT_SLOTS = (4, 8, 16, 32)
DEFAULT_COPY_COST = 0.5
"""One expert copy over one layer's compute: ~0.5 for a large MoE decode step on PCIe 5 with
fused kernels; raise it for slower links. The live cache measures its own (stall_s)."""


@dataclass(frozen=True, slots=True)
class CacheRun:
    """One replay of a trace through one cache configuration."""

    policy: str
    allocation: str
    prefetch: int
    lookahead: bool
    accesses: int
    hits: int
    late: int
    misses: int
    bytes_moved: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_late: int
    prefetch_wasted: int
    stall: float
    lookahead_accuracy: float | None
    capacities: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 6)}


@dataclass(frozen=True, slots=True)
class SlotsRow:
    """Every figure of one slots-per-layer size."""

    slots: int
    belady: float
    demand: dict[str, CacheRun]
    """Per policy name (uniform slots) and ``default`` (the configured cache, no prefetch)."""
    prefetch: CacheRun | None

    def as_dict(self) -> dict[str, Any]:
        default = self.demand["default"]
        row: dict[str, Any] = {
            "slots_per_layer": self.slots,
            "belady": round(self.belady, 6),
            "demand_hit_rate": {k: round(v.hit_rate, 6) for k, v in self.demand.items()},
            "default_over_belady": round(default.hit_rate / self.belady, 6)
            if self.belady else None,
            "runs": {k: v.as_dict() for k, v in self.demand.items()},
        }
        if self.prefetch is not None:
            p = self.prefetch
            row["prefetch"] = {
                **p.as_dict(),
                "stall_free": round(p.hit_rate, 6),
                "stall_free_over_belady": round(p.hit_rate / self.belady, 6)
                if self.belady else None,
                "bytes_over_demand": round(p.bytes_moved / default.bytes_moved, 6)
                if default.bytes_moved else None,
            }
        return row


def _host(layers: Sequence[int], experts: int) -> HostExperts:
    """One-element experts: residency bookkeeping is real, the bytes are counted in experts."""
    return HostExperts(
        gate_up={layer: torch.zeros(experts, 1, 1) for layer in layers},
        down={layer: torch.zeros(experts, 1, 1) for layer in layers},
    )


def _config_for(slots: int, layers: int, expert_bytes: int, base: CacheConfig) -> CacheConfig:
    # Half an expert of headroom so the floor in slots_per_layer lands on ``slots`` exactly.
    budget = math.ceil((slots + 0.5) * expert_bytes * layers / base.memory_threshold)
    return replace(base, budget_bytes=budget, warmup_experts=0, idle_unload_s=math.inf,
                   overlap=False)


def replay_cache(trace: RoutingTrace, slots: int, config: CacheConfig,
                 copy_cost: float = DEFAULT_COPY_COST, use_lookahead: bool = True) -> CacheRun:
    """Serve ``trace`` (requests one after another) through an :class:`ExpertCache` built from
    ``config`` with ``slots`` per layer; lookahead predictions come from the trace when it has
    them and ``use_lookahead`` is set."""
    layers = trace.moe_layers()
    experts = trace.experts()
    host = _host(layers, experts)
    clock = VirtualClock()
    copier = SimulatedCopier(clock, copy_cost)
    cache = ExpertCache(host, _config_for(slots, len(layers), host.expert_bytes, config),
                        copier=copier, min_slots=min(slots, top_k(trace)))
    look = use_lookahead and trace.has_lookahead()
    for request in trace.requests:
        cache.begin_request()
        for t, step in enumerate(request.steps):
            routed = [layer for layer in layers if step.get(layer)]
            for i, layer in enumerate(routed):
                chosen = sorted(set(step[layer] or ()))
                prediction = _lookahead(request, t, routed, i, layers) if look else None
                cache.observe_routing(layer, chosen, prediction)
                capacity = cache.capacity(layer)
                for start in range(0, len(chosen), capacity):
                    group = chosen[start : start + capacity]
                    cache.acquire(layer, group)
                    cache.release(layer, group)
                clock.advance(1.0)  # this layer's compute
            cache.end_forward()
    c = cache.counters
    return CacheRun(
        policy=config.policy, allocation=config.allocation, prefetch=config.prefetch_experts,
        lookahead=look, accesses=c.accesses, hits=c.hits, late=c.late, misses=c.misses,
        bytes_moved=c.loads, prefetch_issued=c.prefetch_issued, prefetch_used=c.prefetch_used,
        prefetch_late=c.prefetch_late, prefetch_wasted=c.prefetch_wasted, stall=c.stall_s,
        lookahead_accuracy=c.lookahead_accuracy, capacities=cache.capacities(),
    )


def top_k(trace: RoutingTrace) -> int:
    """Experts per token: the header's, else the most common group size after the prefills."""
    if trace.top_k is not None:
        return trace.top_k
    sizes = Counter(len(group) for request in trace.requests for step in request.steps[1:]
                    for group in step.values() if group)
    return sizes.most_common(1)[0][0] if sizes else 1


def _lookahead(request: RequestTrace, t: int, routed: list[int], i: int,
               layers: list[int]) -> Lookahead | None:
    """The recorded prediction for the layer served after ``routed[i]`` at step ``t``: the next
    routed layer of this step, or the first MoE layer of the next step."""
    if i + 1 < len(routed):
        step, target = t, routed[i + 1]
    elif t + 1 < len(request.steps):
        step, target = t + 1, layers[0]
    else:
        return None
    ranked = request.lookahead[step].get(target)
    if not ranked:
        return None
    # Only the ranks were recorded: give them a decreasing prior for the cache's tail estimate.
    probs = tuple(1.0 / (r + 1) for r in range(len(ranked)))
    return Lookahead(target, tuple(ranked), probs)


def belady_rate(trace: RoutingTrace, slots: int) -> float:
    """Belady's optimal demand-paging hit rate with ``slots`` per layer (uniform)."""
    hits = accesses = 0
    for sequence in trace.layer_sequences().values():
        # Groups larger than the slots run in slot-sized parts, as the live cache runs them.
        groups = [part for g in sequence for part in _parts(sorted(set(g)), slots)]
        accesses += sum(len(g) for g in groups)
        hits += belady_hits(groups, slots)
    return hits / accesses if accesses else 0.0


def _parts(group: list[int], size: int) -> list[list[int]]:
    return [group[i : i + size] for i in range(0, len(group), size)]


def replay_table(trace: RoutingTrace, slots: Sequence[int], config: CacheConfig,
                 policies: Sequence[PolicyName] = POLICY_NAMES,
                 copy_cost: float = DEFAULT_COPY_COST, prefetch: bool = True) -> list[SlotsRow]:
    """Per slots-per-layer size: Belady, each policy's demand hit rate on uniform slots, the
    configured cache's (``default``), and the configured cache with prefetch."""
    rows = []
    experts = trace.experts()
    for size in slots:
        if size >= experts:
            continue
        demand: dict[str, CacheRun] = {}
        for name in policies:
            uniform = replace(config, policy=name, allocation="uniform", prefetch_experts=0)
            demand[name] = replay_cache(trace, size, uniform, copy_cost)
        demand["default"] = replay_cache(trace, size, replace(config, prefetch_experts=0),
                                         copy_cost)
        with_prefetch = None
        if prefetch and config.prefetch_experts > 0:
            with_prefetch = replay_cache(trace, size, config, copy_cost)
        rows.append(SlotsRow(size, belady_rate(trace, size), demand, with_prefetch))
    return rows


def format_table(rows: Sequence[SlotsRow], policies: Sequence[PolicyName]) -> str:
    """The replay table as text, one line per slots-per-layer size."""
    head = (f"{'S':>3} " + " ".join(f"{p:>7}" for p in policies)
            + f" {'default':>8} {'belady':>7} {'def/bel':>7} {'stallfree':>9} {'sf/bel':>6}"
            + f" {'used':>6} {'late':>6} {'wasted':>6} {'bytes':>6} {'look':>5}")
    lines = [head]
    for row in rows:
        d = row.as_dict()
        rates = d["demand_hit_rate"]
        line = (f"{row.slots:>3} " + " ".join(f"{rates[p]:>7.3f}" for p in policies)
                + f" {rates['default']:>8.3f} {row.belady:>7.3f}"
                + f" {d['default_over_belady'] or 0:>7.3f}")
        p = d.get("prefetch")
        if p:
            issued = max(1, p["prefetch_issued"])
            look = p["lookahead_accuracy"]
            line += (f" {p['stall_free']:>9.3f} {p['stall_free_over_belady'] or 0:>6.3f}"
                     f" {p['prefetch_used'] / issued:>6.1%} {p['prefetch_late'] / issued:>6.1%}"
                     f" {p['prefetch_wasted'] / issued:>6.1%} {p['bytes_over_demand'] or 0:>5.2f}x"
                     f" {'-' if look is None else format(look, '.3f'):>5}")
        lines.append(line)
    return "\n".join(lines)
