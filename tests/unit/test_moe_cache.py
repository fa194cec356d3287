"""The expert cache: budget, eviction policies, pinning, prefetch, warm-up and idle unload."""

from __future__ import annotations

import random

import pytest
import torch

from workers.errors import ExpertCacheError
from workers.moe.expert_cache import (
    CacheConfig,
    ExpertCache,
    HostExperts,
    residency_fit,
    slots_per_layer,
)
from workers.moe.policy import LfruPolicy, LruPolicy, belady_hits, simulate_hits

pytestmark = pytest.mark.timeout(30)

NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER = 2, 8, 4, 3
EXPERT_BYTES = (2 * INTER * HIDDEN + HIDDEN * INTER) * 4


def _host() -> HostExperts:
    gen = torch.Generator().manual_seed(0)
    return HostExperts(
        gate_up={i: torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen)
                 for i in range(NUM_LAYERS)},
        down={i: torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
              for i in range(NUM_LAYERS)},
    )


def _cache(slots: int, **knobs: object) -> ExpertCache:
    budget = int(slots * EXPERT_BYTES * NUM_LAYERS / 0.85) + 1
    config = CacheConfig(budget_bytes=budget, prefetch_experts=0, **knobs)  # type: ignore[arg-type]
    return ExpertCache(_host(), config)


def test_the_slot_pool_is_sized_from_budget_times_memory_threshold() -> None:
    host = _host()
    budget = 10 * EXPERT_BYTES * NUM_LAYERS
    assert slots_per_layer(host, CacheConfig(budget_bytes=budget)) == 8  # 8.5 -> 8
    assert slots_per_layer(host, CacheConfig(budget_bytes=None)) == NUM_EXPERTS
    with pytest.raises(ExpertCacheError, match="budget_mb"):
        slots_per_layer(host, CacheConfig(budget_bytes=EXPERT_BYTES))


def test_a_miss_loads_a_device_copy_and_a_second_access_hits() -> None:
    cache = _cache(slots=2)
    weights = cache.acquire(0, [3])
    cache.release(0, [3])
    cache.ensure_resident(0, [3])
    assert torch.equal(weights[3][0], cache.host.gate_up[0][3])
    assert weights[3][0].data_ptr() != cache.host.gate_up[0][3].data_ptr()
    assert (cache.counters.misses, cache.counters.hits) == (1, 1)
    assert cache.counters.bytes_moved == EXPERT_BYTES


def test_lru_evicts_the_least_recently_used_expert() -> None:
    cache = _cache(slots=2, policy="lru")
    for expert in (1, 2, 1, 3):
        cache.ensure_resident(0, [expert])
    assert cache.resident_signature() == {(0, 1), (0, 3)}
    assert cache.counters.evictions == 1


def test_a_pinned_expert_is_never_evicted_mid_forward() -> None:
    cache = _cache(slots=2, policy="lru")
    cache.acquire(0, [1])
    cache.ensure_resident(0, [2])
    cache.ensure_resident(0, [3])  # 1 is older but pinned, so 2 goes
    assert cache.is_resident(0, 1) and not cache.is_resident(0, 2)
    cache.acquire(0, [3])
    with pytest.raises(ExpertCacheError, match="pinned"):
        cache.ensure_resident(0, [4])


def test_idle_experts_unload_after_the_idle_time_using_the_injected_clock() -> None:
    cache = _cache(slots=4, idle_unload_s=300.0)
    cache.tick(1000.0)
    cache.ensure_resident(0, [1, 2])
    cache.tick(1200.0)
    cache.ensure_resident(0, [2])
    assert cache.tick(1301.0) == 1  # expert 1 idle for 301 s, expert 2 for 101 s
    assert cache.resident_signature() == {(0, 2)}


def test_warm_up_loads_the_most_frequent_experts_from_routing_history() -> None:
    cache = _cache(slots=4, warmup_experts=3)
    for _ in range(5):
        cache.history.record(0, [6, 7], None)
    cache.history.record(1, [5], [6, 7])
    assert cache.warm_up() == 3
    assert cache.resident_signature() == {(0, 6), (0, 7), (1, 5)}


def test_prefetch_loads_the_next_layers_predicted_experts_and_counts_accuracy() -> None:
    budget = int(4 * EXPERT_BYTES * NUM_LAYERS / 0.85) + 1
    cache = ExpertCache(_host(), CacheConfig(budget_bytes=budget, prefetch_experts=1))
    for _ in range(3):  # layer 0 expert 2 is always followed by layer 1 expert 5
        cache.observe_routing(0, [2])
        cache.observe_routing(1, [5])
        cache.end_forward()
    cache.tick(0.0)
    for expert in range(NUM_EXPERTS):
        if cache.is_resident(1, expert):
            cache._evict(1, expert)  # start layer 1 cold
    cache.counters.prefetch_used = cache.counters.prefetch_wasted = 0
    cache.observe_routing(0, [2])
    assert cache.is_resident(1, 5)
    cache.ensure_resident(1, [5])
    assert cache.counters.prefetch_used == 1 and cache.counters.prefetch_accuracy == 1.0


def test_residency_fit_scores_the_share_of_expected_experts_resident() -> None:
    signature = frozenset({(0, 1), (1, 2)})
    assert residency_fit(signature, [(0, 1), (1, 2)]) == 1.0
    assert residency_fit(signature, {(0, 1): 3.0, (0, 5): 1.0}) == 0.75
    assert residency_fit(signature, []) == 1.0


def _zipf_trace(steps: int, experts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 1.2 for rank in range(experts)]
    return [rng.sample(range(experts), 1) + rng.choices(range(experts), weights)
            for _ in range(steps)]


def test_lfru_beats_lru_on_a_skewed_trace_and_belady_bounds_both() -> None:
    # given a Zipf-skewed trace mixed with uniform one-off experts
    trace = [sorted(set(step)) for step in _zipf_trace(3000, 32, seed=1)]
    # when each policy replays it with 8 slots
    lru = simulate_hits(trace, 8, LruPolicy())
    lfru = simulate_hits(trace, 8, LfruPolicy())
    best = belady_hits(trace, 8)
    # then frequency awareness helps and the offline optimum is an upper bound
    assert lfru > lru
    assert best >= lfru
