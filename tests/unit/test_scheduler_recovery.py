"""Recovery inside the plan, pure: lost, stuck, unpublished and parked chunks, jobs that can never
run and unreadable records become actions of the TickPlan, and the jobs they move get no other
action that tick."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings

from scheduler import JobState, PolicyConfig, SloClass, check_plan_invariants, plan_tick
from scheduler.cost import CostModel
from scheduler.recovery import RecoveryCause, RecoveryConfig, plan_recoveries
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running, snapshots

pytestmark = pytest.mark.timeout(60)

CONFIG = RecoveryConfig(stuck_min_s=0.2, stuck_factor=5, unpublished_after_s=1.5,
                        affinity_max_wait_s=0.3)
POLICY = PolicyConfig(recovery=CONFIG)
ALIVE = frozenset({"w0", "w1"})


def _causes(jobs: list, cost: CostModel | None = None) -> dict[str, RecoveryCause]:  # type: ignore[type-arg]
    recoveries, _ = plan_recoveries(jobs, ALIVE, cost or CostModel(), CONFIG, NOW_S)
    return {r.job_id: r.cause for r in recoveries}


def test_a_running_job_whose_lease_lapsed_is_requeued_as_lost() -> None:
    job = running("a", "w0", lease_until_s=NOW_S - 0.01, chunk_running_since_s=NOW_S - 3)
    assert _causes([job]) == {"a": RecoveryCause.LOST}


def test_a_chunk_far_over_the_jobs_own_median_is_stuck_and_a_slow_one_is_not() -> None:
    # own median 0.1 s per unit, 1 unit per chunk: stuck past max(5 x 0.1 s, 0.2 s floor)
    stuck = running("s", "w0", lease_until_s=NOW_S + 5, chunk_running_since_s=NOW_S - 0.6,
                    own_s_per_unit=0.1, next_chunk_cost_units=1.0)
    slow = replace(stuck, job_id="t", chunk_running_since_s=NOW_S - 0.45)
    assert _causes([stuck, slow]) == {"s": RecoveryCause.STUCK}


def test_a_chunk_with_no_trusted_estimate_is_never_judged_stuck() -> None:
    job = running("a", "w0", lease_until_s=NOW_S + 500, chunk_running_since_s=NOW_S - 400,
                  own_s_per_unit=None, next_chunk_cost_units=1.0)
    assert _causes([job]) == {}


def test_a_measured_cost_key_outranks_the_jobs_own_median() -> None:
    job = running("a", "w0", lease_until_s=NOW_S + 5, chunk_running_since_s=NOW_S - 0.6,
                  own_s_per_unit=None, next_chunk_cost_units=1.0)
    cost = CostModel()
    for _ in range(3):
        cost = cost.observe("simulated", "cpu", 1.0, 0.1)
    assert _causes([job], cost) == {"a": RecoveryCause.STUCK}


def test_each_stuck_requeue_doubles_the_allowance() -> None:
    job = running("a", "w0", lease_until_s=NOW_S + 5, chunk_running_since_s=NOW_S - 0.9,
                  own_s_per_unit=0.1, next_chunk_cost_units=1.0, stuck_requeues=1)
    assert _causes([job]) == {}
    assert _causes([replace(job, chunk_running_since_s=NOW_S - 1.1)]) == {
        "a": RecoveryCause.STUCK}


def test_a_queued_job_whose_message_was_never_published_is_republished_after_a_lease() -> None:
    fresh = make_job("a", state=JobState.QUEUED, queue="batch", waiting_since_s=NOW_S - 0.5,
                     next_chunk=1, epoch=0, published=(0, 0))
    old = replace(fresh, job_id="b", waiting_since_s=NOW_S - 2.0)
    sent = replace(old, job_id="c", published=(1, 0))
    unknown = replace(old, job_id="d", published=None)
    assert _causes([fresh, old, sent, unknown]) == {"b": RecoveryCause.UNPUBLISHED}


def test_a_job_released_into_a_running_batch_waits_for_its_step_however_long() -> None:
    # given a job joined into batch b1 long ago, whose lead runs a long first step (a load)
    joiner = make_job("j", state=JobState.QUEUED, queue="interactive", batch_id="b1",
                      waiting_since_s=NOW_S - 8.0, next_chunk=0, epoch=0, published=(-1, -1))
    lead = running("l", "w0", lease_until_s=NOW_S + 5, chunk_running_since_s=NOW_S - 8.0,
                   batch_id="b1")
    # then it is not unpublished while its batch runs; once the batch stopped, it is
    assert _causes([joiner, lead]) == {}
    assert _causes([joiner, replace(lead, batch_id="b2")]) == {"j": RecoveryCause.UNPUBLISHED}
    assert _causes([joiner]) == {"j": RecoveryCause.UNPUBLISHED}


def test_a_parked_chunk_moves_after_the_wait_or_when_its_worker_is_gone() -> None:
    waiting = make_job("a", state=JobState.QUEUED, queue="batch", parked_on="w0",
                       waiting_since_s=NOW_S - 0.1, published=(0, 0))
    waited = replace(waiting, job_id="b", waiting_since_s=NOW_S - 0.4)
    orphaned = replace(waiting, job_id="c", parked_on="w9")
    assert _causes([waiting, waited, orphaned]) == {
        "b": RecoveryCause.PARKED, "c": RecoveryCause.PARKED}


def test_a_chunk_parked_where_its_model_was_evicted_is_placed_anew_at_once() -> None:
    # given chunks parked on w0 a moment ago, one of whose model w0 has since evicted
    kept = make_job("a", state=JobState.QUEUED, queue="batch", parked_on="w0",
                    waiting_since_s=NOW_S - 0.01, published=(1, 0), service_s=2.0)
    left = replace(kept, job_id="b", model_left=True)
    # one parked on a dead worker is moved for that, whatever it holds
    orphaned = replace(left, job_id="c", parked_on="w9")
    # then only the one whose model left moves, without waiting out the affinity wait
    assert _causes([kept, left, orphaned]) == {
        "b": RecoveryCause.MODEL_LEFT, "c": RecoveryCause.PARKED}
    # with affinity off nothing is parked for a model
    off = replace(CONFIG, affinity_max_wait_s=None)
    recoveries, _ = plan_recoveries([left], ALIVE, CostModel(), off, NOW_S)
    assert recoveries == ()


def test_a_chunk_parked_on_a_busy_worker_moves_at_once_when_an_idle_one_holds_its_model() -> None:
    # given chunks parked on w0 a moment ago, one marked: an idle worker holds its model
    kept = make_job("a", state=JobState.QUEUED, queue="batch", parked_on="w0",
                    waiting_since_s=NOW_S - 0.01, published=(1, 0), service_s=2.0)
    idle = replace(kept, job_id="b", idle_holder=True)
    # an evicted model is the first reason given; a dead worker the only one
    both = replace(idle, job_id="c", model_left=True)
    orphaned = replace(idle, job_id="d", parked_on="w9")
    assert _causes([kept, idle, both, orphaned]) == {
        "b": RecoveryCause.IDLE_HOLDER, "c": RecoveryCause.MODEL_LEFT,
        "d": RecoveryCause.PARKED}
    # with affinity off nothing is parked for a model
    off = replace(CONFIG, affinity_max_wait_s=None)
    recoveries, _ = plan_recoveries([idle], ALIVE, CostModel(), off, NOW_S)
    assert recoveries == ()


def test_a_waiting_job_whose_dependency_failed_is_failed_and_never_released() -> None:
    # given a pending job whose dependency failed, and idle workers that could run it
    job = make_job("a", depends_on=("gone",), failed_dependency="dependency gone ended FAILED")
    # when the tick plans
    plan = plan_tick(make_snapshot([job], workers=2), POLICY, NOW_S)
    # then the job fails with the reason and is not released
    assert [(f.job_id, f.reason) for f in plan.failures] == [
        ("a", "dependency gone ended FAILED")]
    assert plan.releases == ()


def test_an_unreadable_record_is_failed_with_its_problem() -> None:
    snapshot = replace(make_snapshot([]), unreadable=(("x", "next_chunk 2 outside 0..1"),))
    plan = plan_tick(snapshot, POLICY, NOW_S)
    assert [(f.job_id, f.reason) for f in plan.failures] == [
        ("x", "unreadable record: next_chunk 2 outside 0..1")]


def test_a_recovered_job_gets_no_other_action_in_the_same_plan() -> None:
    # given a realtime job waiting and a batch job running whose worker died
    lost = running("lost", "w0", lease_until_s=NOW_S - 1, chunk_running_since_s=NOW_S - 2,
                   waiting_since_s=NOW_S - 30)
    urgent = make_job("rt", slo_class=SloClass.REALTIME, submitted_at_s=NOW_S - 0.5)
    snapshot = make_snapshot([lost, urgent], workers=1)
    # when the tick plans
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then the lost job is only recovered, and the plan keeps its invariants
    assert [r.job_id for r in plan.recoveries] == ["lost"]
    assert "lost" not in {*plan.preempt, *plan.standby, *(r.job_id for r in plan.requeues)}
    check_plan_invariants(plan, snapshot, POLICY)


@settings(max_examples=25, deadline=None)
@given(snapshots())
def test_plans_with_recoveries_keep_every_invariant(snapshot) -> None:  # type: ignore[no-untyped-def]
    # every running job's lease lapses: the whole running set is recovered at once
    jobs = tuple(replace(j, lease_until_s=NOW_S - 1) if j.state is JobState.RUNNING else j
                 for j in snapshot.jobs)
    snapshot = replace(snapshot, jobs=jobs)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    check_plan_invariants(plan, snapshot, POLICY)
    running_ids = {j.job_id for j in jobs if j.state is JobState.RUNNING}
    recovered = {r.job_id for r in plan.recoveries}
    assert running_ids <= recovered
    # the others: chunks parked on a worker that is gone, that evicted their model, or
    # busy while an idle worker holds it
    by_id = {j.job_id: j for j in jobs}
    for r in plan.recoveries:
        if r.job_id not in running_ids:
            job = by_id[r.job_id]
            assert job.state is JobState.QUEUED and job.parked_on is not None
            alive = job.parked_on in {w.name for w in snapshot.workers if w.alive}
            assert r.cause in (RecoveryCause.PARKED, RecoveryCause.MODEL_LEFT,
                               RecoveryCause.IDLE_HOLDER)
            assert (r.cause is RecoveryCause.MODEL_LEFT) == (job.model_left and alive)
            assert (r.cause is RecoveryCause.IDLE_HOLDER) == (
                job.idle_holder and not job.model_left and alive)
