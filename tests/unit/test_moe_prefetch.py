"""Expert prefetch: protection until the layer runs, ranking among non-resident experts,
smoothed and decaying history, lookahead from the next router, the copy lane, and the counters
that say whether a prefetch arrived in time."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from workers.moe.copy import SimulatedCopier, ThreadCopier, VirtualClock
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts
from workers.moe.prefetch import Lookahead, LookaheadPredictor, RoutingHistory
from workers.moe.recipes import build_model, load_recipe
from workers.moe.session import open_session

pytestmark = pytest.mark.timeout(60)

LAYERS, EXPERTS = 3, 8


def _host() -> HostExperts:
    gen = torch.Generator().manual_seed(0)
    return HostExperts(
        gate_up={i: torch.randn(EXPERTS, 2, 2, generator=gen) for i in range(LAYERS)},
        down={i: torch.randn(EXPERTS, 2, 1, generator=gen) for i in range(LAYERS)},
    )


def _cache(slots: int, clock: VirtualClock | None = None, copy_cost: float = 0.5,
           **knobs: object) -> ExpertCache:
    host = _host()
    budget = int((slots + 0.5) * host.expert_bytes * LAYERS / 0.85) + 1
    settings = {"policy": "lru", "allocation": "uniform", "warmup_experts": 0, **knobs}
    config = CacheConfig(budget_bytes=budget, **settings)  # type: ignore[arg-type]
    copier = SimulatedCopier(clock or VirtualClock(), copy_cost)
    return ExpertCache(host, config, copier=copier)


def _use(cache: ExpertCache, layer: int, experts: list[int]) -> None:
    cache.acquire(layer, experts)
    cache.release(layer, experts)


def test_a_prefetched_expert_is_protected_until_its_layer_has_run() -> None:
    # given layer 1 full with two used experts, and two prefetches issued for it in one call
    cache = _cache(slots=2, prefetch_experts=0)
    _use(cache, 1, [0])
    _use(cache, 1, [1])
    assert cache.prefetch(1, 5) and cache.prefetch(1, 6)
    # then the second prefetch took a slot of a used expert, not the first prefetch's
    assert cache.is_resident(1, 5) and cache.is_resident(1, 6)
    # and a demand miss in that layer before it is routed does not evict them either
    # (it falls back to a prefetched one only when nothing else can go)
    assert cache.counters.prefetch_wasted == 0


def test_a_demand_miss_evicts_an_ordinary_resident_before_a_pending_prefetch() -> None:
    cache = _cache(slots=3, prefetch_experts=0)
    for expert in (0, 1, 2):
        _use(cache, 1, [expert])
    assert cache.prefetch(1, 5)  # evicts 0 (least recently used)
    _use(cache, 1, [3])  # a demand miss of another job's token before layer 1 is routed
    assert cache.is_resident(1, 5), "the pending prefetch was evicted by a demand miss"
    assert not cache.is_resident(1, 1)


def test_a_prefetch_counts_as_an_access_for_the_eviction_policy() -> None:
    cache = _cache(slots=2, prefetch_experts=0)
    _use(cache, 1, [0])
    _use(cache, 1, [1])
    cache.prefetch(1, 5)  # evicts 0; 5 is now more recent than 1
    cache.observe_routing(1, [2])  # layer 1 routed elsewhere: 5 is no longer protected
    _use(cache, 1, [2])
    assert cache.is_resident(1, 5) and not cache.is_resident(1, 1)


def test_predictions_rank_only_experts_that_are_not_resident() -> None:
    # given layer 0 expert 2 always followed by layer 1 experts 5 and 6, with 5 resident
    cache = _cache(slots=4, prefetch_experts=0)
    for _ in range(5):
        cache.observe_routing(0, [2])
        cache.observe_routing(1, [5, 6])
        cache.end_forward()
    _use(cache, 1, [5])
    # then the prediction names 6 first: prefetching 5 would move no byte
    predicted = cache.predict_next(0, [2])
    assert predicted[0][0] == 6
    assert 5 not in [expert for expert, _ in predicted]


def test_one_observation_is_not_certainty_and_old_patterns_decay() -> None:
    history = RoutingHistory([0, 1], EXPERTS, decay=0.9)
    history.record(0, [1], None)
    history.record(1, [3], [1])
    once = history.inclusion(0, [1])[3]
    assert 0.0 < once < 1.0
    # a new successor seen a few times overtakes an old one seen many times long ago
    for _ in range(20):
        history.record(0, [1], [3])
        history.record(1, [3], [1])
    for _ in range(12):
        history.record(0, [1], [3])
        history.record(1, [4], [1])
    inclusion = history.inclusion(0, [1])
    assert inclusion[4] > inclusion[3]


def test_the_next_tokens_first_layer_is_prefetched_from_the_last() -> None:
    cache = _cache(slots=2, prefetch_experts=1)
    for _ in range(4):  # last layer expert 7 always followed by first layer expert 3
        cache.observe_routing(0, [3])
        cache.observe_routing(1, [0])
        cache.observe_routing(2, [7])
        cache.end_forward()
    cache._evict(0, 3)
    cache.observe_routing(2, [7])
    assert cache.is_resident(0, 3)


def test_counters_say_whether_a_prefetch_arrived_in_time_late_or_never_used() -> None:
    clock = VirtualClock()
    cache = _cache(slots=2, clock=clock, copy_cost=1.0, prefetch_experts=0)
    # in time: issued, a full copy of compute passes, then used
    cache.prefetch(1, 4)
    clock.advance(1.0)
    _use(cache, 1, [4])
    # late: issued, half a copy passes, then used: the consumer waits the other half
    cache.prefetch(1, 5)
    clock.advance(0.5)
    before = clock.t
    _use(cache, 1, [5])
    assert clock.t - before == pytest.approx(0.5)
    # wasted: issued for layer 2, never used, evicted by a demand miss after layer 2 ran
    cache.prefetch(2, 6)
    clock.advance(1.0)  # the copy completes during layer 1's compute
    cache.observe_routing(2, [0])
    _use(cache, 2, [0])
    _use(cache, 2, [1])
    c = cache.counters
    assert (c.prefetch_issued, c.prefetch_used, c.prefetch_late, c.prefetch_wasted) == (3, 2, 1, 1)
    assert (c.hits, c.late, c.misses) == (1, 1, 2)
    assert c.late_wait_s == pytest.approx(0.5)
    assert c.stall_s == pytest.approx(0.5 + 2 * 1.0)  # the late wait and two demand loads
    assert c.bytes_prefetched == 3 * cache.host.expert_bytes


def test_a_demand_copy_jumps_the_queue_of_prefetches_that_have_not_started() -> None:
    clock = VirtualClock()
    cache = _cache(slots=4, clock=clock, copy_cost=1.0, prefetch_experts=0)
    cache.prefetch(1, 4)  # copies during [0, 1)
    cache.prefetch(1, 5)  # queued for [1, 2)
    _use(cache, 0, [0])  # demand: after the copy in progress, before the queued prefetch
    assert clock.t == pytest.approx(2.0)
    _use(cache, 1, [5])  # pushed back to [2, 3): one more unit of waiting
    assert clock.t == pytest.approx(3.0)
    assert cache.counters.prefetch_late == 1


def test_prefetches_copy_on_a_separate_thread_on_the_cpu() -> None:
    copier = ThreadCopier(torch.device("cpu"))
    src = (torch.randn(64, 64), torch.randn(64, 64))
    seen: list[str] = []
    original = src[0].to

    handle = copier.copy(src, prefetch=True)
    weights, _ = handle.wait()
    seen.extend(t.name for t in threading.enumerate())
    copier.close()
    assert any(name.startswith("expert-copy") for name in seen)
    assert torch.equal(weights[0], src[0]) and weights[0].data_ptr() != src[0].data_ptr()
    assert original is not None
    # a demand copy stays on the caller and is ready at once
    assert copier.copy(src, prefetch=False).ready()


def test_lookahead_applies_the_next_layers_router_to_this_layers_hidden_state() -> None:
    gen = torch.Generator().manual_seed(0)
    gates = {0: torch.randn(EXPERTS, 4, generator=gen), 1: torch.randn(EXPERTS, 4, generator=gen)}
    predictor = LookaheadPredictor(gates, rank=3)
    hidden = torch.randn(2, 4, generator=gen)
    prediction = predictor.predict(0, hidden)
    probs = torch.softmax(hidden @ gates[1].T, dim=-1).mean(dim=0)
    assert prediction.layer == 1
    assert list(prediction.ranked) == torch.topk(probs, 3).indices.tolist()
    assert predictor.predict(1, hidden).layer == 0  # the last layer predicts the next token's first


def test_a_confident_lookahead_prefetches_what_history_has_never_seen() -> None:
    cache = _cache(slots=2, prefetch_experts=1)
    for _ in range(30):  # lookahead for layer 1 has been right every time
        cache.observe_routing(0, [0], Lookahead(1, (3, 4), (0.9, 0.05)))
        cache.observe_routing(1, [3])
        cache.end_forward()
    cache.observe_routing(0, [0], Lookahead(1, (7, 4), (0.9, 0.05)))
    assert cache.is_resident(1, 7)
    assert cache.counters.lookahead_accuracy == pytest.approx(1.0)


def test_a_session_routes_through_the_hook_and_scores_its_lookahead() -> None:
    loaded = build_model(load_recipe("qwen3-moe-tiny"))
    session = open_session(loaded, CacheConfig(prefetch_experts=2, overlap=True))
    session.new_context(session.context.config)
    with torch.inference_mode():
        for _ in range(3):
            loaded.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
            session.cache.end_forward()
    counters = session.cache.counters
    assert counters.lookahead_scored > 0
    accuracy = counters.lookahead_accuracy
    assert accuracy is not None and 0.0 <= accuracy <= 1.0
    assert counters.accesses > 0
    session.cache.close()


def test_rebalancing_moves_slots_to_the_layer_that_reuses_them() -> None:
    # layer 0 cycles through 6 experts (reuse at 6 slots), layer 1 always uses one expert
    cache = _cache(slots=4, prefetch_experts=0, allocation="reuse", rebalance_every=10**9)
    for step in range(600):
        for layer, expert in ((0, step % 6), (1, 0), (2, 0)):
            cache.observe_routing(layer, [expert])
            _use(cache, layer, [expert])
        cache.end_forward()
    plan = cache.rebalance()
    assert sum(plan.values()) == 12
    assert plan[0] >= 6 and plan[1] < 4
    for step in range(66):
        if step == 6:  # one cycle to load the experts the old split had no room for
            hits = cache.counters.hits
        cache.observe_routing(0, [step % 6])
        _use(cache, 0, [step % 6])
    assert cache.counters.hits - hits == 60  # then every access hits: layer 0 holds 6


def test_history_arrays_stay_finite_over_a_long_run() -> None:
    history = RoutingHistory([0, 1], EXPERTS, decay=0.5)
    for i in range(3000):
        history.record(0, [i % EXPERTS], [1])
        history.record(1, [1], [i % EXPERTS])
    assert np.isfinite(history.transitions).all() and np.isfinite(history.frequency).all()
    assert history.inclusion(0, [0]).max() <= 1.0


def test_the_process_cache_totals_count_every_access_of_a_text_job() -> None:
    from workers import moe

    runner = moe.get_runner(cache=CacheConfig(budget_bytes=400_000, overlap=False))
    before = moe.cache_totals()
    params = {"prompt": "hi", "max_new_tokens": 3, "chunk_tokens": 3, "model": "qwen3-moe-tiny"}
    state = None
    for index in range(runner.plan(params).num_chunks):
        state = runner.run_chunk(params, index, state, lambda: False).state
    after = moe.cache_totals()
    accesses = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    assert accesses > 0 and after["bytes_moved"] >= before["bytes_moved"]
