"""Loads count as work in overload: the compute and effective load figures, the load time the
fleet paid, and what convergence and admission make of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import (
    Admission,
    AdmissionState,
    AdmissionStatus,
    PolicyConfig,
    SloClass,
    Tier,
    WorkerView,
    admit,
    check_plan_invariants,
    plan_tick,
)
from scheduler.admission import measure_load, measure_loads, paid_load_share
from scheduler.incremental import IncrementalPlanner
from scheduler.policy import OverloadMeasure
from scheduler.queues import NORMAL_WORKER_QUEUES
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot

pytestmark = pytest.mark.timeout(60)
POLICY = PolicyConfig(load_horizon_s=10.0)
COMPUTE_ONLY = replace(POLICY, overload_measure=OverloadMeasure.COMPUTE)

seconds = st.floats(0.0, 1e5, allow_nan=False)
shares = st.floats(0.0, 1.0, allow_nan=False)


@given(compute_s=seconds, cold_s=seconds, paid=shares, workers=st.integers(0, 64))
def test_the_effective_load_is_never_below_the_compute_load(
        compute_s: float, cold_s: float, paid: float, workers: int) -> None:
    figures = measure_loads(compute_s + cold_s, cold_s, paid, workers, POLICY)
    assert figures.effective >= figures.compute >= 0.0
    assert figures.effective >= figures.cold * (1 - 1e-12)


@given(compute_s=seconds, cold_s=seconds, more_s=seconds, paid=shares, more=shares,
       workers=st.integers(1, 64))
def test_more_loads_never_lower_the_effective_load(
        compute_s: float, cold_s: float, more_s: float, paid: float, more: float,
        workers: int) -> None:
    base = measure_loads(compute_s + cold_s, cold_s, paid, workers, POLICY)
    colder = measure_loads(compute_s + cold_s + more_s, cold_s + more_s, paid, workers, POLICY)
    paying = measure_loads(compute_s + cold_s, cold_s, min(paid + more, 1.0), workers, POLICY)
    ulp = 1e-12 * base.effective  # the sums round: equal up to their last bits
    assert colder.effective >= base.effective - ulp
    assert paying.effective >= base.effective - ulp
    assert paying.compute == base.compute  # the paid share is no compute work


@given(demand_s=seconds, cold_s=seconds, workers=st.integers(0, 64))
def test_with_nothing_paid_the_effective_load_is_the_demand_over_capacity(
        demand_s: float, cold_s: float, workers: int) -> None:
    figures = measure_loads(demand_s + cold_s, cold_s, 0.0, workers, POLICY)
    assert figures.effective == measure_load(demand_s + cold_s, workers, POLICY)


def test_known_cold_loads_and_the_paid_rate_count_the_larger_not_their_sum() -> None:
    # capacity 2 workers x 10 s = 20 s: 6 s of compute, 4 s of cold loads known, 30 % paid
    figures = measure_loads(10.0, 4.0, 0.3, 2, POLICY)
    assert figures.compute == pytest.approx(0.3)
    assert figures.cold == pytest.approx(0.2)
    assert figures.effective == pytest.approx(0.3 + 0.3)  # max(0.2, 0.3), not 0.5


def _worker(name: str, *loads: tuple[float, float], alive: bool = True) -> WorkerView:
    return WorkerView(name, alive, None, NORMAL_WORKER_QUEUES, "cuda", loads=loads)


def test_the_paid_share_counts_only_the_part_of_each_load_inside_the_window() -> None:
    window_s = 60.0
    w1 = _worker("w1", (NOW_S - 100.0, 10.0),  # ended before the window: nothing
                 (NOW_S - 50.0, 20.0),  # began 10 s before the window: 10 s of it
                 (NOW_S + 5.0, 10.0))  # under way, 5 s of it so far
    w2 = _worker("w2")
    dead = _worker("w3", (NOW_S, 60.0), alive=False)
    assert paid_load_share((w1, w2, dead), window_s, NOW_S) == pytest.approx(15.0 / 120.0)
    assert paid_load_share((), window_s, NOW_S) == 0.0


loads = st.lists(st.tuples(st.floats(NOW_S - 200, NOW_S + 50), st.floats(0.0, 100.0)),
                 max_size=6)


@given(per_worker=st.lists(loads, max_size=5), extra=st.tuples(
    st.floats(NOW_S - 200, NOW_S + 50), st.floats(0.0, 100.0)))
def test_the_paid_share_is_a_share_and_grows_with_loads(
        per_worker: list[list[tuple[float, float]]], extra: tuple[float, float]) -> None:
    workers = [_worker(f"w{k}", *ls) for k, ls in enumerate(per_worker)]
    share = paid_load_share(workers, 60.0, NOW_S)
    assert 0.0 <= share <= 1.0
    if workers:
        more = [replace(workers[0], loads=(*workers[0].loads, extra)), *workers[1:]]
        assert paid_load_share(more, 60.0, NOW_S) >= share


def _loaded_fleet() -> tuple[WorkerView, ...]:
    # each of two workers spent 45 s of the last 60 s loading models
    return tuple(_worker(f"w{k}", (NOW_S - 5.0, 45.0)) for k in range(2))


def _mixed_jobs() -> list:  # type: ignore[type-arg]
    return [make_job("ia", slo_class=SloClass.INTERACTIVE, work_s=2.0, deadline_s=NOW_S + 5.0),
            make_job("b0", work_s=4.0, deadline_s=NOW_S + 10.0),
            make_job("b1", work_s=4.0, deadline_s=NOW_S + 10.0)]


def test_loads_the_fleet_pays_make_a_light_compute_load_an_overload_that_parks_batch() -> None:
    # given 10 s of compute work on two workers (compute load 0.51) that spend 75 % loading
    snapshot = make_snapshot(_mixed_jobs(), _loaded_fleet(), policy=POLICY)
    # when the tick plans
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then convergence is on at the effective load, batch is parked with the figures in its
    # reason, and the interactive job is released
    status = plan.admission
    assert status.compute_load == pytest.approx(10.15 / 20)
    assert status.effective_load == pytest.approx((10.15 + 0.75 * 20) / 20)
    assert status.load == status.effective_load > POLICY.convergence_threshold
    assert status.state is AdmissionState.CONVERGING
    assert set(plan.suspend) == {"b0", "b1"}
    assert [r.job_id for r in plan.releases] == ["ia"]
    assert f"effective load {status.effective_load:.2f}" in plan.suspend_reason
    assert f"compute {status.compute_load:.2f}" in plan.suspend_reason
    check_plan_invariants(plan, snapshot, POLICY)
    # and the planner held across ticks plans the same
    assert IncrementalPlanner().plan(snapshot, POLICY, NOW_S) == plan


def test_counting_compute_alone_the_same_fleet_is_not_overloaded() -> None:
    snapshot = make_snapshot(_mixed_jobs(), _loaded_fleet(), policy=COMPUTE_ONLY)
    plan = plan_tick(snapshot, COMPUTE_ONLY, NOW_S)
    assert plan.admission.state is AdmissionState.OPEN
    assert plan.admission.load == plan.admission.compute_load
    assert plan.suspend == ()


def test_a_waiting_jobs_cold_load_counts_in_the_effective_load_not_the_compute_load() -> None:
    cold = make_job("cold", work_s=2.0, deadline_s=NOW_S + 10.0, load_s=8.0)
    plan = plan_tick(make_snapshot([cold], 1, policy=POLICY), POLICY, NOW_S)
    hops_s = 10 * POLICY.hop_overhead_s
    assert plan.admission.compute_load == pytest.approx((2.0 + hops_s) / 10.0)
    assert plan.admission.effective_load == pytest.approx((10.0 + hops_s) / 10.0)


def _status(load: float) -> AdmissionStatus:
    return AdmissionStatus(AdmissionState.CONVERGING, load, 5.0, measured_at_s=NOW_S,
                           compute_load=0.6, effective_load=load)


def test_past_the_batch_shed_load_batch_is_refused_naming_the_effective_load() -> None:
    decision = admit(make_job("b"), _status(1.2), POLICY, NOW_S)
    assert decision.verdict is Admission.SHED_OVERLOAD
    assert decision.retry_after_s > 0
    assert "effective load 1.20 (compute 0.60)" in decision.reason
    # interactive and realtime work keep their place; gold batch is parked, not refused
    for job in (make_job("i", slo_class=SloClass.INTERACTIVE),
                make_job("r", slo_class=SloClass.REALTIME)):
        assert admit(job, _status(1.2), POLICY, NOW_S).verdict is Admission.ADMIT
    gold = admit(make_job("g", tier=Tier.GOLD), _status(1.2), POLICY, NOW_S)
    assert gold.verdict is Admission.SUSPEND


def test_up_to_the_batch_shed_load_batch_is_parked_with_the_figures() -> None:
    decision = admit(make_job("b"), _status(1.0), POLICY, NOW_S)
    assert decision.verdict is Admission.SUSPEND
    assert "effective load 1.00" in decision.reason


def test_the_batch_shed_load_never_undercuts_convergence_nor_exceeds_the_shed_load() -> None:
    lenient = PolicyConfig(convergence_threshold=2.0, shed_load=3.0)
    assert admit(make_job("b"), _status(1.5), lenient, NOW_S).verdict is Admission.SUSPEND
    strict = PolicyConfig(batch_shed_load=5.0, shed_load=1.5)
    assert admit(make_job("b"), _status(1.6), strict, NOW_S).verdict is Admission.SHED_OVERLOAD
