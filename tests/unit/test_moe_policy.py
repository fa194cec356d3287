"""Expert eviction policies, Belady's bound, LRU hit curves and the skew-aware slot split."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence, Set
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.moe.allocation import ReuseTracker, allocate_slots, lru_hit_curve
from workers.moe.policy import (
    POLICY_NAMES,
    ArcPolicy,
    EvictionPolicy,
    LruPolicy,
    S3FifoPolicy,
    belady_hit_curve,
    belady_hits,
    make_policy,
    simulate_hits,
    simulate_hits_by_layer,
)

pytestmark = pytest.mark.timeout(30)
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
Steps = list[list[int]]


class _Layer:
    """One layer's residency driven through a policy in the live cache's call order."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy, self.capacity = policy, capacity
        self.resident: set[int] = set()
        self.victims: list[int] = []

    def serve(self, needed: Sequence[int], also_pinned: Set[int] = frozenset()) -> None:
        for expert in needed:
            if expert not in self.resident:
                if len(self.resident) >= self.capacity:
                    self.evict(set(needed) | also_pinned, set(needed))
                self.resident.add(expert)
            self.policy.record_access(expert)

    def evict(self, pinned: Set[int], must_keep: Set[int]) -> None:
        candidates = sorted(self.resident - pinned) or sorted(self.resident - must_keep)
        victim = self.policy.choose_victim(candidates)
        assert victim in candidates
        self.victims.append(victim)
        self.resident.discard(victim)
        self.policy.forget(victim)

    def resize(self, capacity: int) -> None:
        while len(self.resident) > capacity:
            self.evict(set(), set())
        self.capacity = capacity
        self.policy.resize(capacity)

    def unload(self, expert: int) -> None:
        self.resident.discard(expert)
        self.policy.forget(expert)


def _zipf_steps(tokens: int, experts: int, exponent: float, seed: int) -> Steps:
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(experts)]
    return [[rng.choices(range(experts), weights)[0]] for _ in range(tokens)]


# -- make_policy ------------------------------------------------------------------------------


def test_make_policy_rejects_an_unknown_name_and_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown expert eviction policy 'lfu'; choose one of "
                                         "lru, lfru, arc, s3fifo"):
        make_policy("lfu", 8)


def test_make_policy_builds_every_named_policy_for_a_layer_size() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name, 8).name == name
    assert make_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="needs the layer's slot count"):
        make_policy("arc")


# -- ARC --------------------------------------------------------------------------------------


def test_arc_keeps_a_frequently_used_set_through_a_scan_that_flushes_lru() -> None:
    # given two experts used twice each, then a scan of one-off experts, then the two again
    trace = [[0], [1], [0], [1], *([e] for e in range(10, 40)), [0], [1]]
    # when ARC and LRU replay it with four slots
    arc_hits = simulate_hits(trace, 4, ArcPolicy(4))
    lru_hits = simulate_hits(trace, 4, LruPolicy())
    # then ARC still holds the frequent pair at the end; LRU lost it to the scan
    assert arc_hits == lru_hits + 2


def test_arc_ghost_hits_move_the_t1_target_toward_the_list_that_would_have_kept_them() -> None:
    # given three slots with expert 1 in T2 and two one-off experts in T1
    arc = ArcPolicy(3)
    layer = _Layer(arc, 3)
    for expert in (1, 1, 2, 3, 4):  # 4 evicts 2 from T1 into B1
        layer.serve([expert])
    assert list(arc.b1) == [2] and arc.target_t1 == 0.0
    # when 2 comes back (evicting 3, a T1 member, into B1)
    layer.serve([2])
    # then a B1 ghost hit grows T1's target and 2 goes to T2
    assert arc.target_t1 == 1.0 and 2 in arc.t2
    # when T2's oldest, 1, is evicted and comes back after another one-off
    layer.serve([5])  # |T1| = 1 is not above the target: T2's LRU (1) goes to B2
    assert list(arc.b2) == [1]
    layer.serve([1])
    # then a B2 ghost hit shrinks T1's target again (by |B1| / |B2| = 2)
    assert arc.target_t1 == 0.0 and 1 in arc.t2


def test_arc_passes_over_pinned_experts_at_the_lru_end() -> None:
    arc = ArcPolicy(3)
    for expert in (1, 2, 3):
        arc.record_access(expert)
    assert arc.choose_victim([2, 3]) == 2


# -- S3-FIFO ----------------------------------------------------------------------------------


def test_s3fifo_evicts_one_hit_wonders_before_reused_experts() -> None:
    # given five experts used twice each in a ten-slot layer
    policy = S3FifoPolicy(10)
    layer = _Layer(policy, 10)
    for expert in [*range(5), *range(5)]:
        layer.serve([expert])
    # when fifty one-off experts stream through
    for expert in range(100, 150):
        layer.serve([expert])
    # then every victim was a one-off and the reused five are still resident
    assert all(victim >= 100 for victim in layer.victims)
    assert set(range(5)) <= layer.resident
    assert set(range(5)) <= policy.main.keys()


def test_s3fifo_sends_an_expert_back_from_the_ghost_queue_straight_to_main() -> None:
    policy = S3FifoPolicy(4)
    layer = _Layer(policy, 4)
    for expert in range(6):  # 0 and 1 leave the small queue unused: into the ghost queue
        layer.serve([expert])
    assert 0 in policy.ghost
    layer.serve([0])
    assert 0 in policy.main and 0 not in policy.ghost


# -- every policy -----------------------------------------------------------------------------

Op = tuple[str, object, Set[int]]
_ops: st.SearchStrategy[list[Op]] = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.lists(st.integers(0, 11), min_size=1, max_size=3),
                  st.sets(st.integers(0, 11), max_size=3)),
        st.tuples(st.just("unload"), st.integers(0, 11), st.just(frozenset())),
        st.tuples(st.just("resize"), st.integers(3, 7), st.just(frozenset())),
    ),
    max_size=80,
)


@PROPERTY
@given(name=st.sampled_from(POLICY_NAMES), capacity=st.integers(3, 7), ops=_ops)
def test_every_policy_evicts_only_a_candidate_whatever_the_pins_and_resizes(
    name: str, capacity: int, ops: list[Op]
) -> None:
    policy = make_policy(name, capacity)
    layer = _Layer(policy, capacity)
    for kind, arg, pinned in ops:
        if kind == "serve":
            assert isinstance(arg, list)
            layer.serve(arg, pinned & layer.resident)  # _Layer asserts the victim
        elif kind == "unload":
            assert isinstance(arg, int)
            if arg in layer.resident:
                layer.unload(arg)
        else:
            assert isinstance(arg, int)
            layer.resize(arg)
        _check_lists_match_residency(policy, layer)


def _check_lists_match_residency(policy: EvictionPolicy, layer: _Layer) -> None:
    if isinstance(policy, ArcPolicy):
        assert policy.t1.keys() | policy.t2.keys() == layer.resident
        assert len(policy.t1) + len(policy.b1) <= policy.capacity
        lists = (policy.t1, policy.t2, policy.b1, policy.b2)
        assert sum(map(len, lists)) <= 2 * policy.capacity
        assert 0.0 <= policy.target_t1 <= policy.capacity
    if isinstance(policy, S3FifoPolicy):
        assert policy.small.keys() | policy.main.keys() == layer.resident
        assert len(policy.ghost) <= policy.capacity


def test_an_expert_loaded_without_an_access_is_adopted_as_new_not_evicted_first() -> None:
    for name in ("lru", "arc", "s3fifo"):
        # given a full layer where 1 left and came back by a load the policy did not see
        policy = make_policy(name, 3)
        for expert in (1, 2, 3):
            policy.record_access(expert)
        policy.forget(1)
        # when a slot is needed, then the older experts go first
        assert policy.choose_victim([1, 2, 3]) != 1, name
        if isinstance(policy, ArcPolicy):
            assert 1 in policy.t1 and 1 not in policy.b1
        if isinstance(policy, S3FifoPolicy):
            assert 1 in policy.small and 1 not in policy.ghost


# -- simulator and Belady ---------------------------------------------------------------------


def test_simulation_refuses_a_token_that_needs_more_experts_than_slots() -> None:
    with pytest.raises(ValueError, match="token 1 needs 3 experts at once but the layer holds 2"):
        simulate_hits([[0], [1, 2, 3]], 2, LruPolicy())
    with pytest.raises(ValueError, match="routing top-k"):
        belady_hits([[1, 2, 3]], 2)


def test_simulate_hits_by_layer_sizes_a_fresh_policy_per_layer() -> None:
    trace = {0: [[1], [2], [1]], 3: [[5], [5], [6], [5]]}
    assert simulate_hits_by_layer(trace, {0: 2, 3: 1}, "arc") == {0: 1, 3: 1}


def _optimal_hits(steps: Steps, slots: int) -> int:
    """Exhaustive search over every demand-paging eviction choice (tiny traces only)."""
    flat = tuple((index, expert) for index, needed in enumerate(steps) for expert in needed)

    @cache
    def best(position: int, resident: frozenset[int]) -> int:
        if position == len(flat):
            return 0
        index, expert = flat[position]
        if expert in resident:
            return 1 + best(position + 1, resident)
        if len(resident) < slots:
            return best(position + 1, resident | {expert})
        victims = resident - set(steps[index])
        return max(best(position + 1, resident - {v} | {expert}) for v in victims)

    return best(0, frozenset())


_small_traces = st.integers(1, 3).flatmap(lambda slots: st.tuples(
    st.just(slots),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=slots, unique=True), max_size=10),
))


@PROPERTY
@given(case=_small_traces)
def test_belady_with_pinned_groups_equals_an_exhaustive_search(case: tuple[int, Steps]) -> None:
    slots, steps = case
    assert belady_hits(steps, slots) == _optimal_hits(steps, slots)


@PROPERTY
@given(case=_small_traces, name=st.sampled_from(POLICY_NAMES))
def test_no_policy_beats_belady(case: tuple[int, Steps], name: str) -> None:
    slots, steps = case
    assert simulate_hits(steps, slots, make_policy(name, slots)) <= belady_hits(steps, slots)


def test_belady_hit_curve_is_belady_at_each_feasible_size() -> None:
    steps = [[1, 2], [3], [1], [2, 4], [3, 1]]
    assert belady_hit_curve(steps, 4) == [0, 0, *(belady_hits(steps, s) for s in (2, 3, 4))]


# -- LRU hit curves ---------------------------------------------------------------------------


@PROPERTY
@given(seed=st.integers(0, 10_000), group=st.integers(1, 3))
def test_the_stack_curve_equals_lru_replay_at_every_size(seed: int, group: int) -> None:
    # given a random trace whose tokens need up to ``group`` experts, repeats included
    rng = random.Random(seed)
    steps = [[rng.randrange(12) for _ in range(rng.randint(1, group))] for _ in range(150)]
    largest = max(len(set(needed)) for needed in steps)
    # when the curve is taken in one pass
    curve = lru_hit_curve(steps, 14)
    # then it matches a replay through LruPolicy at every size a token fits in
    assert curve[:largest] == [0] * largest
    for slots in range(largest, 15):
        assert curve[slots] == simulate_hits(steps, slots, LruPolicy())


# -- slot allocation --------------------------------------------------------------------------


def test_the_split_uses_the_whole_total_within_each_layers_bounds() -> None:
    curves = {0: [0, 5, 9, 12, 14, 15, 15], 1: [0, 1, 2, 3, 4, 5, 6], 2: [0, 8, 8, 8, 8, 8, 8]}
    plan = allocate_slots(curves, 12, minimum=1, maximum={0: 6, 1: 4, 2: 6})
    assert sum(plan.values()) == 12
    assert all(slots >= 1 for slots in plan.values()) and plan[1] <= 4


def test_the_split_stops_at_every_maximum_when_the_total_is_larger() -> None:
    assert allocate_slots({0: [0, 1], 1: [0, 1, 2]}, 10, 1, 3) == {0: 3, 1: 3}


def test_minimums_above_the_total_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="minimum slots add up to 6 but only 5 are available"):
        allocate_slots({0: [0], 1: [0], 2: [0]}, 5, 2, 8)


def test_flat_curves_split_evenly() -> None:
    assert allocate_slots({0: [0], 1: [0], 2: [0]}, 10, 1, 8) == {0: 4, 1: 3, 2: 3}


def test_a_non_concave_curve_that_fools_a_greedy_split_still_gets_the_optimum() -> None:
    # greedy on the best average gain takes layer 1's first slot (1.0 > 0.95) and is then stuck
    curves = {0: [0.0, 0.0, 0.0, 1.9], 1: [0.0, 1.0, 1.0, 1.0]}
    assert allocate_slots(curves, 4, minimum=1, maximum=3) == {0: 3, 1: 1}


_curve = st.lists(st.integers(0, 20), min_size=1, max_size=7)


@PROPERTY
@given(curves=st.lists(_curve, min_size=3, max_size=3), total=st.integers(0, 18),
       low=st.lists(st.integers(0, 2), min_size=3, max_size=3),
       room=st.lists(st.integers(0, 5), min_size=3, max_size=3))
def test_the_split_matches_an_exhaustive_search_over_three_layers(
    curves: list[list[int]], total: int, low: list[int], room: list[int]
) -> None:
    high = [lo + r for lo, r in zip(low, room, strict=True)]
    if sum(low) > total:
        with pytest.raises(ValueError):
            allocate_slots(dict(enumerate(curves)), total, dict(enumerate(low)),
                           dict(enumerate(high)))
        return

    def value(layer: int, slots: int) -> int:
        return curves[layer][min(slots, len(curves[layer]) - 1)]

    used = min(total, sum(high))
    options = [split for split in itertools.product(*(range(lo, hi + 1)
                                                      for lo, hi in zip(low, high, strict=True)))
               if sum(split) == used]
    best = max(sum(value(layer, s) for layer, s in enumerate(split)) for split in options)
    plan = allocate_slots(dict(enumerate(curves)), total, dict(enumerate(low)),
                          dict(enumerate(high)))
    assert sum(plan.values()) == used
    assert all(low[layer] <= plan[layer] <= high[layer] for layer in plan)
    assert sum(value(layer, s) for layer, s in plan.items()) == best


def test_the_layer_with_flatter_reuse_gets_more_slots() -> None:
    # given one layer routed with a steep Zipf skew and one with a flat one
    tracker = ReuseTracker(window=2000)
    for steep, flat in zip(_zipf_steps(2000, 64, 1.4, seed=1), _zipf_steps(2000, 64, 0.6, seed=2),
                           strict=True):
        tracker.record(0, steep)
        tracker.record(1, flat)
    # when 24 slots are split between them
    plan = tracker.plan(24, minimum=1, maximum=64)
    # then the flat layer, which gains more per extra slot, gets more, and hits improve
    assert plan[1] > plan[0]
    curves = tracker.curves(64)
    assert curves[0][plan[0]] + curves[1][plan[1]] > curves[0][12] + curves[1][12]


# -- reuse tracker ----------------------------------------------------------------------------


def test_the_tracker_curve_is_the_stack_curve_of_its_window() -> None:
    steps = _zipf_steps(300, 16, 1.0, seed=3)
    whole = ReuseTracker(window=1000)
    for needed in steps:
        whole.record(2, needed)
    assert whole.curves(16) == {2: lru_hit_curve(steps, 16)}
    # a short window forgets old tokens, but keeps their effect on the recency stack
    short = ReuseTracker(window=3)
    for needed in ([1], [2], [1], [3], [3]):
        short.record(0, needed)
    assert short.curves(3) == {0: [0, 1, 2, 2]}  # [1] at depth 2, [3] a miss, [3] at depth 1


def test_the_plan_covers_layers_not_routed_yet_and_merge_carries_reuse_over() -> None:
    live = ReuseTracker()
    for needed in _zipf_steps(200, 16, 1.0, seed=4):
        live.record(0, needed)
    fresh = ReuseTracker()
    assert fresh.plan(8, 1, 16, layers=[0, 1]) == {0: 4, 1: 4}
    fresh.merge(live)
    assert fresh.curves(16) == live.curves(16)
    plan = fresh.plan(8, 1, 16, layers=[0, 1])
    assert plan[0] == 7 and plan[1] == 1
