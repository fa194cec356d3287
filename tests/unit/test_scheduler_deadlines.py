"""Deadline-aware order, deferral of work the fleet cannot fit, victims among the whole live set,
and estimates per chunk kind."""

from __future__ import annotations

import pytest

from scheduler import JobState, PolicyConfig, SloClass, check_plan_invariants, plan_tick
from scheduler.cost import chunk_cost_key
from scheduler.survey import survey_jobs
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running

pytestmark = pytest.mark.timeout(30)
POLICY = PolicyConfig(convergence_threshold=10.0, shed_load=10.0)


def test_jobs_of_one_class_are_released_shortest_first_and_hopeless_work_as_if_longer() -> None:
    # given three free workers and four interactive jobs: the first to arrive is the longest,
    # one is already past saving (its deadline is nearer than its work)
    jobs = [make_job("long", slo_class=SloClass.INTERACTIVE, submitted_at_s=NOW_S - 3,
                     deadline_s=NOW_S + 30, work_s=3.0),
            make_job("hopeless", slo_class=SloClass.INTERACTIVE, submitted_at_s=NOW_S - 4,
                     deadline_s=NOW_S + 0.1, work_s=0.5),
            make_job("short", slo_class=SloClass.INTERACTIVE, submitted_at_s=NOW_S - 1,
                     deadline_s=NOW_S + 3, work_s=0.5),
            make_job("middle", slo_class=SloClass.INTERACTIVE, submitted_at_s=NOW_S - 2,
                     deadline_s=NOW_S + 10, work_s=1.0)]
    # when the tick runs, then the order is the policy's, not arrival order: the hopeless job
    # ranks as one four times its size (ahead of the long job, which has slack to spare)
    plan = plan_tick(make_snapshot(jobs, 3), POLICY, NOW_S)
    assert [r.job_id for r in plan.releases] == ["short", "middle", "hopeless"]
    assert plan.standby == () and "long" not in [r.job_id for r in plan.releases]


def test_work_the_fleet_cannot_fit_by_its_deadline_is_deferred_behind_work_that_can() -> None:
    # given one worker and, by deadline, two 1.5 s jobs due at +2 s and +2.5 s and a short one
    # due at +3 s: all three cannot make it, but the short one and one long one can
    jobs = [make_job("a", slo_class=SloClass.INTERACTIVE, work_s=1.5, deadline_s=NOW_S + 2.0),
            make_job("b", slo_class=SloClass.INTERACTIVE, work_s=1.5, deadline_s=NOW_S + 2.5),
            make_job("c", slo_class=SloClass.INTERACTIVE, work_s=0.5, deadline_s=NOW_S + 3.0)]
    snapshot = make_snapshot(jobs, 1)
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then exactly one long job is deferred, and the slot goes to a job that stays on time
    assert len(plan.deferred) == 1 and plan.deferred[0] in {"a", "b"}
    assert plan.releases[0].job_id not in plan.deferred
    check_plan_invariants(plan, snapshot, POLICY)


def test_the_slot_of_a_queued_job_is_taken_before_a_running_job_is_interrupted() -> None:
    # given two workers: one runs an interactive job due soon, the other's slot is held by a
    # batch job queued between chunks with a day of slack; a realtime job cannot wait
    inflight = [running("ia", "w0", slo_class=SloClass.INTERACTIVE, queue="interactive",
                        level=1, work_s=10.0, deadline_s=NOW_S + 12),
                make_job("idle-batch", state=JobState.QUEUED, queue="batch", level=2,
                         work_s=10.0, deadline_s=NOW_S + 86400)]
    rt = make_job("rt", slo_class=SloClass.REALTIME, work_s=0.3, deadline_s=NOW_S + 0.9)
    snapshot = make_snapshot([*inflight, rt], 2)
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then the queued batch job yields its slot (to standby, where it still runs on any
    # worker nothing else wants); the running interactive job is not interrupted
    assert plan.standby == ("idle-batch",) and plan.preempt == ()
    assert [r.job_id for r in plan.releases] == ["rt"]
    check_plan_invariants(plan, snapshot, POLICY)


def test_over_full_flight_is_put_back_in_order_and_a_running_job_yields_to_one_that_cannot_wait(
) -> None:
    # given one worker running a long batch job, and a realtime job the submit path already
    # queued (in flight: two jobs for one slot) that cannot wait for the batch job to end
    busy = running("batch", "w0", work_s=30.0, deadline_s=NOW_S + 500)
    rt = make_job("rt", slo_class=SloClass.REALTIME, state=JobState.QUEUED, queue="realtime",
                  level=0, work_s=0.3, deadline_s=NOW_S + 0.9)
    snapshot = make_snapshot([busy, rt], 1)
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then the batch job is preempted (its worker goes to the realtime job's queued chunk)
    assert plan.preempt == ("batch",) and plan.releases == ()
    check_plan_invariants(plan, snapshot, POLICY)


def test_a_job_that_can_wait_for_a_slot_to_free_preempts_nobody() -> None:
    # given one worker busy with a job that ends in 0.5 s, and a realtime job with 0.7 s spare
    busy = running("short", "w0", work_s=0.5, deadline_s=NOW_S + 100)
    rt = make_job("rt", slo_class=SloClass.REALTIME, work_s=0.2, deadline_s=NOW_S + 0.9)
    plan = plan_tick(make_snapshot([busy, rt], 1), POLICY, NOW_S)
    # then nothing is preempted: the realtime job is queued for the worker, which the short
    # job's next chunk (sent to standby) no longer holds
    assert plan.preempt == () and [r.job_id for r in plan.releases] == ["rt"]
    assert plan.standby == ("short",)


def test_an_encode_chunk_does_not_teach_the_estimate_of_the_denoise_chunks() -> None:
    # given a model whose encode chunk was measured slow (one chunk of 0.1 units took 7 s) and
    # whose denoise chunks were measured at 0.05 s per unit
    key = "dit-tiny:256x256"
    policy = PolicyConfig()
    cost = policy.new_cost_model().observe(chunk_cost_key(key, "encode"), "cpu", 1.0, 70.0)
    for _ in range(3):
        cost = cost.observe(chunk_cost_key(key, "denoise[0]"), "cpu", 1.0, 0.05)
    # when a job with only 50 denoise steps and a decode left is estimated
    job = make_job("img", cost_key=key, remaining_cost_units=51.0, next_chunk=1,
                   num_chunks=52, remaining_units_by_key=(
                       (chunk_cost_key(key, "denoise[1]"), 50.0),
                       (chunk_cost_key(key, "decode"), 1.0)))
    snapshot = make_snapshot([job], 2)
    snapshot = type(snapshot)(snapshot.jobs, snapshot.workers, cost, snapshot.state)
    survey = survey_jobs(snapshot, snapshot.workers, policy, NOW_S)
    # then its remaining work is 50 denoise steps at the denoise rate plus the decode's prior,
    # not 51 units at a rate the encode chunk dragged up
    denoise_s = cost.seconds_per_unit(chunk_cost_key(key, "denoise"), "cpu")
    assert 0.03 < denoise_s <= 0.05
    assert survey.remaining_s[0] == pytest.approx(
        50 * denoise_s + policy.cost_priors_s_per_unit["dit-tiny"] + 51 * policy.hop_overhead_s)
