"""The fair order as the tick plans it (hypothesis): tenants of either tier, every one
backlogged in the interactive band, run through the simulator (the live tick's planner and
apply loop on a virtual clock, each chunk's measured seconds charged as it ends). While all
stay backlogged, no tenant waits long between chunks (no starvation), and no two tenants'
weighted service drifts apart by more than one round of placements can hand one of them
(bounded service gap); the shares come out within 10 % of the weights'.

``tests/unit/test_fairness.py`` checks the same properties of ``scheduler.fairness`` picked
one job at a time; here it is the whole tick: slots filled many at a time, chunks batched,
estimates charged at placement and corrected at commit, the join rule."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.bench.sim_workload import MIX, SimArrival, SimConfig, sim_policy
from app.bench.simulate import ClusterSim
from scheduler import PolicyConfig
from scheduler.fairness import FairShareConfig
from scheduler.model import Tier

pytestmark = pytest.mark.timeout(240)

SHAPE = MIX[1]
"""Interactive 512² images: 20 chunks of about 30 ms."""
HORIZON_S = 12.0
FAIR = FairShareConfig(enabled=True)
RUNS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Charge:
    at_s: float
    tenant: str
    seconds: float


class RecordingSim(ClusterSim):
    """The simulator, keeping every charge the commits make (when, whose, how much)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.charges: list[Charge] = []

    def _charge(self, job: Any, seconds: float) -> None:
        super()._charge(job, seconds)
        self.charges.append(Charge(self.now, job.job_view().tenant, seconds))


def backlog(tiers: dict[str, Tier], workers: int, seed: int,
            offsets_s: tuple[float, ...] = ()) -> list[SimArrival]:
    """Jobs enough that every tenant stays backlogged past the horizon, all due far later
    (no deadline reorders the band), each tenant's submitted at once at its offset (none:
    0, they join the band together; a few ms apart, later ones join a busy band)."""
    rng = random.Random(seed)
    base_s = SHAPE.units_per_chunk * SHAPE.s_per_unit
    per_tenant = int(2 * HORIZON_S * workers / (SHAPE.chunks * base_s * 0.9)) + 2
    trace: list[SimArrival] = []
    offset = dict(zip(tiers, offsets_s, strict=False))
    for _ in range(per_tenant):
        for tenant, tier in tiers.items():
            chunks = tuple(base_s * (1.0 + 0.1 * (2.0 * rng.random() - 1.0))
                           for _ in range(SHAPE.chunks))
            at_s = offset.get(tenant, 0.0)
            trace.append(SimArrival(len(trace), at_s, SHAPE, tier, chunks, at_s + 1e4,
                                    tenant=tenant))
    return trace


def run(tiers: dict[str, Tier], workers: int, seed: int,
        offsets_s: tuple[float, ...] = ()) -> tuple[RecordingSim, PolicyConfig]:
    config = SimConfig(workers=workers, duration_s=HORIZON_S, drain_s=0.0)
    policy = replace(sim_policy(config, "stepline"), fair_share=FAIR)
    sim = RecordingSim(config, backlog(tiers, workers, seed, offsets_s), policy)
    sim.run()
    return sim, policy


def weights(tiers: dict[str, Tier]) -> dict[str, float]:
    return {t: FAIR.weight(tier.value) for t, tier in tiers.items()}


def round_bound(tiers: dict[str, Tier], workers: int, policy: PolicyConfig) -> float:
    """What one round of placements can hand one tenant, in weighted seconds: every slot of
    the pool a full batch of its (longest) chunks, at the least weight; plus a chunk."""
    chunk_s = SHAPE.units_per_chunk * SHAPE.s_per_unit * 1.1
    slots = workers * policy.slots_per_worker * policy.batching.max_batch
    return (slots + 1) * chunk_s / min(weights(tiers).values())


tenant_tiers = st.dictionaries(st.sampled_from("abcdef"), st.sampled_from(list(Tier)),
                               min_size=2, max_size=5)
staggers = st.lists(st.floats(0.0, 0.005), max_size=5).map(tuple)
"""Each tenant's submission offset, in order (missing: 0): a few ms apart, so those after the
first tick (at 0) join a band where the earlier ones' backlog is queued already."""


@RUNS
@given(tiers=tenant_tiers, workers=st.integers(1, 4), seed=st.integers(0, 1 << 16))
def test_no_backlogged_tenant_waits_longer_than_the_others_take_to_catch_up(
        tiers: dict[str, Tier], workers: int, seed: int) -> None:
    # given tenants of either tier, every one backlogged, sharing a small pool
    sim, policy = run(tiers, workers, seed)
    # when the tick orders the band fairly until the horizon
    last = dict.fromkeys(tiers, 0.0)
    longest = dict.fromkeys(tiers, 0.0)
    for charge in sim.charges:
        if charge.at_s > HORIZON_S:
            break
        longest[charge.tenant] = max(longest[charge.tenant], charge.at_s - last[charge.tenant])
        last[charge.tenant] = charge.at_s
    for tenant in tiers:
        longest[tenant] = max(longest[tenant], HORIZON_S - last[tenant])
    # then no tenant goes without a chunk for longer than the others need to climb twice the
    # gap bound above its counter, at the pool's rate, plus two ticks to place and start
    bound_s = (2 * round_bound(tiers, workers, policy) * sum(weights(tiers).values()) / workers
               + 2 * policy.tick_interval_s)
    assert max(longest.values()) <= bound_s, (longest, bound_s)


@RUNS
@given(tiers=tenant_tiers, workers=st.integers(1, 4), seed=st.integers(0, 1 << 16),
       offsets_s=staggers)
def test_backlogged_tenants_weighted_service_stays_within_one_round_of_placements(
        tiers: dict[str, Tier], workers: int, seed: int, offsets_s: tuple[float, ...]) -> None:
    # given tenants of either tier, every one backlogged from a few ms apart, sharing a pool
    sim, policy = run(tiers, workers, seed, offsets_s)
    weight = weights(tiers)
    bound = round_bound(tiers, workers, policy)
    served = dict.fromkeys(tiers, 0.0)
    # when each chunk's measured seconds are charged, in order, until the horizon
    for charge in sim.charges:
        if charge.at_s > HORIZON_S:
            break
        served[charge.tenant] += charge.seconds / weight[charge.tenant]
        # then no two tenants' weighted service is ever further apart than one round of
        # placements
        assert max(served.values()) - min(served.values()) <= bound, (served, bound)
    # and at the horizon each tenant's share of the pool is within 10 % of its weight's
    total, weights_total = sum(sim.result.served_s.values()), sum(weight.values())
    for tenant in tiers:
        share = sim.result.served_s.get(tenant, 0.0) / total
        assert abs(share - weight[tenant] / weights_total) <= 0.1 * weight[tenant] / weights_total
