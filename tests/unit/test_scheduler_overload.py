"""Overload convergence, admission and gradual recovery."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import (
    Admission,
    AdmissionState,
    AdmissionStatus,
    JobState,
    PolicyConfig,
    PolicyState,
    SloClass,
    Tier,
    admit,
    check_plan_invariants,
    plan_tick,
)
from scheduler.admission import measure_load, next_admission_state
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running

pytestmark = pytest.mark.timeout(30)
POLICY = PolicyConfig(load_horizon_s=10.0)


def _heavy(job_id: str, **overrides: Any):  # type: ignore[no-untyped-def]
    # due in 20 s: with the 10 s horizon, half its work counts as load now
    return make_job(job_id, work_s=20.0, deadline_s=NOW_S + 20.0, **overrides)


def test_load_is_outstanding_work_over_what_the_workers_do_in_the_horizon() -> None:
    assert measure_load(outstanding_s=16.0, alive_workers=2, policy=POLICY) == 0.8


def test_convergence_starts_above_the_threshold_and_ends_below_threshold_minus_hysteresis() -> None:
    converging, open_ = AdmissionState.CONVERGING, AdmissionState.OPEN
    assert next_admission_state(open_, 0.81, POLICY) is converging
    assert next_admission_state(converging, 0.75, POLICY) is converging
    assert next_admission_state(converging, 0.69, POLICY) is open_


def test_overload_suspends_waiting_batch_work_and_keeps_interactive_work() -> None:
    # given two workers and 60 s of waiting work (load 3)
    jobs = [_heavy(f"b{k}") for k in range(3)] + [
        make_job("ia", slo_class=SloClass.INTERACTIVE, work_s=0.5, deadline_s=NOW_S + 60)]
    snapshot = make_snapshot(jobs, 2, policy=POLICY)
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then convergence is on, batch is suspended, interactive work is released
    assert plan.admission.state is AdmissionState.CONVERGING
    assert set(plan.suspend) == {"b0", "b1", "b2"}
    assert [r.job_id for r in plan.releases] == ["ia"]
    check_plan_invariants(plan, snapshot, POLICY)


def test_overload_moves_running_batch_work_to_standby() -> None:
    jobs = [running("r", "w0", work_s=30.0, deadline_s=NOW_S + 20.0)]
    plan = plan_tick(make_snapshot(jobs, 1, policy=POLICY), POLICY, NOW_S)
    assert plan.standby == ("r",)


def test_overload_expires_late_work_that_asked_to_be_shed_with_a_reason() -> None:
    jobs = [_heavy("b"), make_job("late", slo_class=SloClass.INTERACTIVE, work_s=4.0,
                                  deadline_s=NOW_S + 1.0, shed_if_late=True)]
    plan = plan_tick(make_snapshot(jobs, 1, policy=POLICY, measured=3), POLICY, NOW_S)
    (expiry,) = plan.expire
    assert expiry.job_id == "late"
    assert "cannot meet its deadline" in expiry.reason


def test_overload_demotes_late_work_behind_work_that_can_still_meet_its_deadline() -> None:
    # given overload, a job that can no longer meet its deadline and one that still can
    jobs = [_heavy("b"), make_job("late", slo_class=SloClass.INTERACTIVE, work_s=4.0,
                                  deadline_s=NOW_S + 1.0),
            make_job("ok", slo_class=SloClass.INTERACTIVE, work_s=0.5,
                     deadline_s=NOW_S + 5.0)]
    # when the tick plans
    plan = plan_tick(make_snapshot(jobs, 1, policy=POLICY, measured=3), POLICY, NOW_S)
    # then the late job is not shed: it drops to the lowest level and is held back, and the
    # job that can still make it is released
    assert plan.expire == ()
    assert plan.levels["late"].level == 2 and "late" in plan.suspend
    assert [r.job_id for r in plan.releases] == ["ok"]
    assert plan.origin_id != "late"


def test_a_late_job_judged_on_too_few_measurements_is_neither_shed_nor_demoted() -> None:
    # given overload and a job the prior says cannot make it, with only two chunks measured
    jobs = [_heavy("b"), make_job("late", slo_class=SloClass.INTERACTIVE, work_s=4.0,
                                  deadline_s=NOW_S + 1.0, shed_if_late=True)]
    plan = plan_tick(make_snapshot(jobs, 1, policy=POLICY, measured=2), POLICY, NOW_S)
    # then it is not judged: not shed, not marked down to the lowest level
    assert plan.expire == ()
    assert "late" not in plan.levels or plan.levels["late"].level < 2


def test_without_overload_a_late_job_is_not_expired() -> None:
    job = make_job("late", work_s=4.0, deadline_s=NOW_S + 1.0)
    plan = plan_tick(make_snapshot([job], 4, policy=POLICY), POLICY, NOW_S)
    assert plan.expire == ()


def test_recovery_resumes_a_bounded_number_of_suspended_jobs_per_tick() -> None:
    # given ten small suspended jobs, low load, and convergence just ended
    policy = PolicyConfig(resume_per_tick=3)
    jobs = [make_job(f"s{k}", state=JobState.SUSPENDED, work_s=0.1, submitted_at_s=NOW_S - k)
            for k in range(10)]
    snapshot = make_snapshot(jobs, 8, state=PolicyState(admission=AdmissionState.CONVERGING))
    # when the tick runs
    plan = plan_tick(snapshot, policy, NOW_S)
    # then the three oldest are released, the rest wait for later ticks
    assert plan.admission.state is AdmissionState.OPEN
    assert [r.job_id for r in plan.releases] == ["s9", "s8", "s7"]


def test_admission_suspends_batch_while_converging_and_admits_interactive() -> None:
    status = AdmissionStatus(AdmissionState.CONVERGING, 1.0, 5.0, measured_at_s=NOW_S)
    batch = make_job("b")
    interactive = make_job("i", slo_class=SloClass.INTERACTIVE)
    assert admit(batch, status, POLICY, NOW_S).verdict is Admission.SUSPEND
    assert admit(interactive, status, POLICY, NOW_S).verdict is Admission.ADMIT


def test_admission_sheds_standard_work_above_the_shed_load_with_a_retry_after() -> None:
    status = AdmissionStatus(AdmissionState.CONVERGING, 3.0, 20.0, measured_at_s=NOW_S)
    decision = admit(make_job("s", slo_class=SloClass.INTERACTIVE), status, POLICY, NOW_S)
    assert decision.verdict is Admission.SHED_OVERLOAD
    assert decision.retry_after_s > 0
    realtime = admit(make_job("r", slo_class=SloClass.REALTIME), status, POLICY, NOW_S)
    assert realtime.verdict is Admission.ADMIT  # it preempts: the backlog is not in its way
    gold = admit(make_job("g", tier=Tier.GOLD, slo_class=SloClass.INTERACTIVE), status,
                 POLICY, NOW_S)
    assert gold.verdict is Admission.ADMIT


def test_admission_ignores_a_stale_status() -> None:
    status = AdmissionStatus(AdmissionState.CONVERGING, 3.0, 20.0, measured_at_s=NOW_S - 60)
    assert admit(make_job("b"), status, POLICY, NOW_S).verdict is Admission.ADMIT


def test_plan_publishes_the_admission_status_for_the_submit_path() -> None:
    plan = plan_tick(make_snapshot([_heavy("b")], 1, policy=POLICY), POLICY, NOW_S)
    # 20 s of work and 10 hops, due in 20 s: half of it counts within the 10 s horizon
    assert plan.admission.load == pytest.approx((20.0 + 10 * POLICY.hop_overhead_s) / 2 / 10)
    assert plan.admission.retry_after_s > 0
    assert plan.admission.measured_at_s == NOW_S
