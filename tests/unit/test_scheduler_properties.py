"""Properties of the policy over random snapshots and simulated runs (hypothesis)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    ClusterSnapshot,
    JobState,
    PolicyConfig,
    PolicyKind,
    SloClass,
    check_plan_invariants,
    plan_tick,
)
from scheduler.scoring import select_origin
from scheduler.survey import survey_jobs
from tests.unit.test_scheduler_support import NOW_S, VirtualCluster, sim_job, snapshots

pytestmark = pytest.mark.timeout(240)  # hypothesis runs slow on a loaded 2-core machine

FAST = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIMS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = [PolicyConfig(policy=kind) for kind in PolicyKind]


@FAST
@given(snapshot=snapshots(), policy=st.sampled_from(POLICIES),
       now_offset_s=st.floats(-1, 60))
def test_every_plan_keeps_its_invariants_for_random_snapshots(
        snapshot: ClusterSnapshot, policy: PolicyConfig, now_offset_s: float) -> None:
    # given a random snapshot, when it is planned under any policy
    plan = plan_tick(snapshot, policy, NOW_S + now_offset_s)
    # then every invariant holds (disjoint actions, legal moves, capacity, workers, origin)
    check_plan_invariants(plan, snapshot, policy)


@FAST
@given(snapshot=snapshots(), policy=st.sampled_from(POLICIES))
def test_no_job_is_released_twice_in_one_plan(snapshot: ClusterSnapshot,
                                              policy: PolicyConfig) -> None:
    plan = plan_tick(snapshot, policy, NOW_S)
    counts = Counter(r.job_id for r in plan.releases)
    assert all(n == 1 for n in counts.values())


@FAST
@given(snapshot=snapshots())
def test_stepline_never_fills_more_slots_than_its_capacity(snapshot: ClusterSnapshot) -> None:
    # given any snapshot; when stepline plans it
    policy = PolicyConfig()
    plan = plan_tick(snapshot, policy, NOW_S)
    alive = [w for w in snapshot.workers if w.alive]
    survey = survey_jobs(snapshot, alive, policy, NOW_S)
    leaving = {*plan.preempt, *plan.standby, *(e.job_id for e in plan.expire)}
    # then capacity = alive workers × slots per worker, and releases only fill free ones (a
    # batch, in flight or released, fills one slot however many jobs it carries)
    assert plan.capacity_slots == len(alive) * policy.slots_per_worker
    if plan.releases:
        slots = {job.batch_id or job.job_id for i in survey.inflight
                 if (job := survey.live[i]).job_id not in leaving}
        slots.update(r.batch or r.job_id for r in plan.releases)
        assert len(slots) <= plan.capacity_slots


@FAST
@given(scores=st.lists(st.floats(0, 1), min_size=1, max_size=30),
       noise=st.lists(st.floats(-0.999, 0.999), min_size=30, max_size=30),
       margin=st.floats(0.01, 0.2), threshold=st.floats(0, 0.9))
def test_origin_is_unchanged_by_score_noise_below_the_margin(
        scores: list[float], noise: list[float], margin: float, threshold: float) -> None:
    # given an incumbent origin that is the top score and above the threshold
    best = max(range(len(scores)), key=scores.__getitem__)
    if scores[best] < threshold:
        scores[best] = threshold
    incumbent_id = f"j{best}"
    # when every score moves by less than half the margin
    noisy = [s + n * margin / 2 for s, n in zip(scores, noise, strict=False)]
    candidates = [(f"j{k}", s) for k, s in enumerate(noisy)]
    picked = select_origin(candidates, (incumbent_id, noisy[best]), threshold, margin)
    # then the origin stays
    assert picked is not None and picked[0] == incumbent_id


def _run(cluster: VirtualCluster, arrivals: list[list[tuple[str, SloClass, int]]],
         extra_ticks: int) -> None:
    for batch in arrivals:
        for job_id, slo_class, chunks in batch:
            cluster.submit(sim_job(job_id, slo_class, chunks, deadline_s=NOW_S - 0.1 + 1e4))
        cluster.step()
    for _ in range(extra_ticks):
        cluster.step()


@st.composite
def _arrivals(draw: st.DrawFn) -> tuple[int, list[list[tuple[str, SloClass, int]]]]:
    """Realtime and interactive jobs of 1-10 chunks at up to 70 % of the unreserved workers'
    capacity (one worker is reserved), plus a trickle of batch jobs of up to 20 chunks."""
    workers = draw(st.integers(3, 6))
    load = draw(st.floats(0.3, 0.7))
    rng = random.Random(draw(st.integers(0, 2**32)))
    arrivals: list[list[tuple[str, SloClass, int]]] = []
    per_tick = load * (workers - 1) / 5.5
    for tick in range(draw(st.integers(100, 250))):
        batch: list[tuple[str, SloClass, int]] = []
        while rng.random() < per_tick / (1 + len(batch)):
            cls = rng.choice((SloClass.REALTIME, SloClass.INTERACTIVE))
            batch.append((f"j{tick}-{len(batch)}", cls, rng.randint(1, 10)))
        if rng.random() < 0.02:
            batch.append((f"b{tick}", SloClass.BATCH, rng.randint(1, 20)))
        arrivals.append(batch)
    return workers, arrivals


@SIMS
@given(setup=_arrivals())
def test_every_job_runs_within_the_aging_bound_plus_one_job(
        setup: tuple[int, list[list[tuple[str, SloClass, int]]]]) -> None:
    # given a stepline cluster below capacity, an aging bound of 3 s and jobs of 2 s at most
    workers, arrivals = setup
    policy = PolicyConfig(aging_bound_s=3.0)
    cluster = VirtualCluster(policy, workers)
    # when the arrivals are played on the virtual clock
    _run(cluster, arrivals, extra_ticks=400)
    # then every wait for a release (first or after preemption) is within the aging bound,
    # plus one job's length (a slot has to free up), plus one tick
    worst = max((wait for _, wait in cluster.waits_s), default=0.0)
    assert worst <= policy.aging_bound_s + 2.0 + 0.1 + 1e-6, worst
    assert not cluster.jobs, "everything finished"


def test_batch_job_is_not_starved_by_a_saturating_interactive_stream() -> None:
    # given three workers and interactive work arriving faster than they serve it
    outcomes = {}
    for kind in (PolicyKind.PRIORITY, PolicyKind.STEPLINE):
        cluster = VirtualCluster(PolicyConfig(policy=kind, aging_bound_s=3.0), workers=3)
        # when one batch job arrives early in the stream
        for tick in range(200):
            for k in range(2):
                cluster.submit(sim_job(f"i{tick}-{k}", SloClass.INTERACTIVE, 2,
                                       deadline_s=NOW_S + 1e4))
            if tick == 10:
                cluster.submit(sim_job("batch", SloClass.BATCH, 3, deadline_s=NOW_S + 1e4))
            cluster.step()
        outcomes[kind] = "batch" in cluster.done or cluster.jobs["batch"].next_chunk > 0
    # then static priority starves it, while aging lets it run within the stream
    assert outcomes == {PolicyKind.PRIORITY: False, PolicyKind.STEPLINE: True}


def test_realtime_gets_at_least_sixty_percent_of_worker_time_under_contention() -> None:
    # given 5 workers, a standing backlog of batch work and of realtime work
    policy = PolicyConfig(convergence_threshold=10.0, shed_load=10.0)
    cluster = VirtualCluster(policy, workers=5)
    for k in range(40):
        cluster.submit(sim_job(f"b{k}", SloClass.BATCH, 30, deadline_s=NOW_S + 1e4))
    for _ in range(20):
        cluster.step()
    serial = 0
    # when realtime jobs keep arriving faster than the fleet can serve them
    for _ in range(300):
        for _ in range(6):
            cluster.submit(sim_job(f"r{serial}", SloClass.REALTIME, 3, deadline_s=NOW_S + 1e4))
            serial += 1
        cluster.step()
    # then realtime work got >= 60 % of the worker time of that period, and once the flood
    # ends every batch job still finishes (none is starved for good)
    realtime_s = cluster.busy_s[SloClass.REALTIME]
    batch_s = cluster.busy_s[SloClass.BATCH] - 20 * 0.1 * 5
    assert realtime_s / (realtime_s + batch_s) >= 0.6
    for _ in range(3000):
        if not cluster.jobs:
            break
        cluster.step()
    assert all(f"b{k}" in cluster.done for k in range(40))


def test_a_long_simulation_under_every_policy_keeps_the_invariants() -> None:
    rng = random.Random(3)
    for policy in POLICIES:
        cluster = VirtualCluster(policy, workers=3)
        for t in range(150):
            if rng.random() < 0.4:
                cls = rng.choice(tuple(SloClass))
                cluster.submit(sim_job(f"j{t}", cls, rng.randint(1, 12)))
            snapshot = ClusterSnapshot(tuple(cluster.jobs.values()), cluster._worker_views(),
                                       policy.new_cost_model(), cluster.state)
            check_plan_invariants(plan_tick(snapshot, policy, cluster.now_s), snapshot, policy)
            cluster.step()
        assert all(j.state is not JobState.RUNNING or j.running_on for j in cluster.jobs.values())
