"""plan_tick, feature by feature: release, reserve, preemption, inheritance, baselines."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    ClusterSnapshot,
    JobState,
    PolicyConfig,
    PolicyKind,
    PolicyState,
    Release,
    SloClass,
    Tier,
    check_plan_invariants,
    plan_tick,
)
from scheduler.errors import PlanInvariantViolated
from scheduler.queues import STANDBY_QUEUE
from tests.unit.test_scheduler_support import (
    NOW_S,
    make_job,
    make_snapshot,
    running,
    snapshots,
)

pytestmark = pytest.mark.timeout(30)
POLICY = PolicyConfig()
UNCONVERGED = PolicyConfig(convergence_threshold=10.0, shed_load=10.0)


def _busy_with_batch(workers: int, **overrides: Any) -> list:  # type: ignore[type-arg]
    return [running(f"b{k}", f"w{k}", submitted_at_s=NOW_S - 50 + k, deadline_s=NOW_S + 500,
                    **overrides) for k in range(workers)]


def test_waiting_jobs_fill_free_slots_in_score_order() -> None:
    # given two free workers and three waiting batch jobs, one of them gold
    jobs = [make_job("a"), make_job("b", tier=Tier.GOLD), make_job("c")]
    # when the tick runs
    plan = plan_tick(make_snapshot(jobs, workers=2), POLICY, NOW_S)
    # then two are released, the gold one first, and the plan keeps its invariants
    assert plan.releases[0].job_id == "b"
    assert len(plan.releases) == 2
    check_plan_invariants(plan, make_snapshot(jobs, workers=2), POLICY)


def test_realtime_job_preempts_the_lowest_ranked_batch_job_when_no_worker_frees_in_time() -> None:
    # given four workers busy with long batch jobs, one of them gold, and a realtime job
    # waiting that would miss its deadline waiting for one of them to finish
    busy = _busy_with_batch(4, work_s=30.0)
    busy[0] = replace(busy[0], tier=Tier.GOLD)
    rt = make_job("rt", slo_class=SloClass.REALTIME, work_s=0.3, deadline_s=NOW_S + 2)
    snapshot = make_snapshot([*busy, rt], workers=4)
    # when the tick runs (below the overload threshold)
    plan = plan_tick(snapshot, UNCONVERGED, NOW_S)
    # then the realtime job is released to the realtime queue and one standard batch job yields
    assert Release("rt", "realtime") in plan.releases
    assert len(plan.preempt) == 1 and plan.preempt[0] != "b0"
    check_plan_invariants(plan, snapshot, UNCONVERGED)


def test_a_job_preempted_max_times_is_never_preempted_again() -> None:
    busy = _busy_with_batch(4, preemptions=POLICY.max_preemptions, work_s=30.0)
    rt = make_job("rt", slo_class=SloClass.REALTIME, work_s=0.3)
    plan = plan_tick(make_snapshot([*busy, rt], workers=4), UNCONVERGED, NOW_S)
    # the realtime job cannot wait for a 3 s chunk, but no batch job may be preempted again:
    # it is queued for the first worker to free, and one batch job's next chunk goes to standby
    assert plan.preempt == ()
    assert [r.job_id for r in plan.releases] == ["rt"] and len(plan.standby) == 1


def test_origin_preempts_even_realtime_work_when_the_fleet_is_full() -> None:
    # given two workers running realtime jobs and a gold realtime job about to miss its deadline
    busy = [running(f"r{k}", f"w{k}", slo_class=SloClass.REALTIME, queue="realtime", level=0,
                    deadline_s=NOW_S + 30) for k in range(2)]
    vip = make_job("vip", slo_class=SloClass.REALTIME, tier=Tier.GOLD, kind="text",
                   deadline_s=NOW_S + 0.2, work_s=0.3)
    snapshot = make_snapshot([*busy, vip], workers=2)
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then it is the origin, it is released first, and one running job yields to it
    assert plan.origin_id == "vip"
    assert plan.releases[0] == Release("vip", "realtime")
    assert len(plan.preempt) == 1
    check_plan_invariants(plan, snapshot, POLICY)


def test_preempted_job_keeps_its_place_ahead_of_later_arrivals() -> None:
    # given a preempted batch job that arrived first, and a pending twin that arrived later
    old = make_job("old", state=JobState.PREEMPTED, preemptions=1, submitted_at_s=NOW_S - 5,
                   waiting_since_s=NOW_S - 0.1, next_chunk=3)
    new = make_job("new", submitted_at_s=NOW_S - 1)
    # when one slot is free, then the preempted job gets it
    plan = plan_tick(make_snapshot([new, old], workers=1), POLICY, NOW_S)
    assert [r.job_id for r in plan.releases] == ["old"]


def test_reserve_is_lent_out_while_preemption_can_reclaim_it_in_time() -> None:
    # given five workers, realtime work live and plenty of batch work whose block groups
    # are far shorter than the realtime job's slack
    jobs = [make_job("rt", slo_class=SloClass.REALTIME, work_s=0.2)]
    jobs += [make_job(f"b{k}") for k in range(10)]
    plan = plan_tick(make_snapshot(jobs, 5), POLICY, NOW_S)
    # then no worker is held: every slot is filled, the realtime job first
    assert plan.reserved_workers == frozenset() and plan.reserve_reason is None
    assert len(plan.releases) == 5 and plan.releases[0] == Release("rt", "realtime")


def test_reserve_is_held_when_a_block_group_outlasts_the_realtime_slack() -> None:
    # given ten workers, eight busy with batch chunks of 2 s in one block group, and a
    # realtime job that has only 0.3 s to spare
    busy = [running(f"b{k}", f"w{k}", work_s=20.0, next_chunk_cost_units=2.0 / 0.01 / 10,
                    deadline_s=NOW_S + 500) for k in range(8)]
    rt = make_job("rt", slo_class=SloClass.REALTIME, work_s=0.2, deadline_s=NOW_S + 0.5,
                  submitted_at_s=NOW_S)
    plan = plan_tick(make_snapshot([*busy, rt], 10), POLICY, NOW_S)
    # then ceil(0.2 × 10) = 2 workers (the idle ones) consume the realtime queue only, and
    # the plan says why
    assert plan.reserved_workers == {"w8", "w9"}
    assert plan.reserve_reason is not None and "too late" in plan.reserve_reason
    for name, queues in plan.worker_queues.items():
        expected = ("realtime",) if name in plan.reserved_workers else (
            "realtime", "interactive", "batch", "standby")
        assert queues == expected


def test_reserve_is_released_after_the_hold_once_realtime_pressure_ends() -> None:
    state = PolicyState(reserve_until_s=NOW_S + 1, reserved_workers=("w0", "w1"))
    snapshot = make_snapshot([make_job("batch")], 10, state=state)
    held = plan_tick(snapshot, POLICY, NOW_S)
    released = plan_tick(snapshot, POLICY, NOW_S + 1.5)
    assert held.reserved_workers == {"w0", "w1"}
    assert released.reserved_workers == frozenset()


def test_batch_work_does_not_grow_onto_a_held_reserve() -> None:
    # given 5 workers, a realtime job with 0.3 s to spare, and batch work whose chunks run
    # 2 s in one block group
    slow = {"next_chunk_cost_units": 2.0 / 0.01 / 10}
    jobs = [make_job("rt", slo_class=SloClass.REALTIME, work_s=0.2, deadline_s=NOW_S + 0.5,
                     submitted_at_s=NOW_S)]
    jobs += [running("b0", "w0", work_s=20.0, deadline_s=NOW_S + 500, **slow)]
    jobs += [make_job(f"b{k}", work_s=20.0, **slow) for k in range(1, 10)]
    plan = plan_tick(make_snapshot(jobs, 5), UNCONVERGED, NOW_S)
    # then one worker is held for realtime work, and batch work holds only the other four
    # (the running batch job, with the most slack, makes way for three fresher ones)
    assert len(plan.reserved_workers) == 1
    assert sum(r.queue == "batch" for r in plan.releases) == 4 and plan.standby == ("b0",)
    assert plan.releases[0] == Release("rt", "realtime")


def test_job_that_an_urgent_job_waits_on_inherits_its_level() -> None:
    # given a realtime job waiting on a batch job
    blocker = make_job("blocker", slo_class=SloClass.BATCH, work_s=0.2)
    waiter = make_job("waiter", slo_class=SloClass.REALTIME, work_s=0.2,
                      depends_on=("blocker",))
    plan = plan_tick(make_snapshot([blocker, waiter], 4), POLICY, NOW_S)
    # then the blocker runs in the realtime queue and the waiter is not released yet
    assert plan.releases == (Release("blocker", "realtime"),)


def test_dependency_absent_from_the_snapshot_counts_as_finished() -> None:
    waiter = make_job("waiter", depends_on=("long-gone",))
    plan = plan_tick(make_snapshot([waiter], 2), POLICY, NOW_S)
    assert [r.job_id for r in plan.releases] == ["waiter"]


def test_fifo_releases_everything_at_once_to_batch_in_arrival_order_as_atomic_tasks() -> None:
    jobs = [make_job("late", slo_class=SloClass.REALTIME, submitted_at_s=NOW_S - 1),
            make_job("early", submitted_at_s=NOW_S - 9)]
    plan = plan_tick(make_snapshot(jobs, 1), PolicyConfig(policy=PolicyKind.FIFO), NOW_S)
    assert plan.releases == (Release("early", "batch"), Release("late", "batch"))
    assert plan.atomic_release and plan.capacity_slots is None
    assert plan.preempt == () and plan.origin_id is None and not plan.reserved_workers


def test_priority_policy_releases_each_class_to_its_queue_without_preemption() -> None:
    jobs = [*_busy_with_batch(1), make_job("rt", slo_class=SloClass.REALTIME),
            make_job("ia", slo_class=SloClass.INTERACTIVE)]
    plan = plan_tick(make_snapshot(jobs, 1), PolicyConfig(policy=PolicyKind.PRIORITY), NOW_S)
    assert plan.releases == (Release("rt", "realtime"), Release("ia", "interactive"))
    assert plan.preempt == () and not plan.atomic_release


def test_no_workers_means_nothing_is_released() -> None:
    plan = plan_tick(make_snapshot([make_job("a")], 0), POLICY, NOW_S)
    assert plan.releases == () and plan.capacity_slots == 0


def test_invariant_check_rejects_a_job_released_twice() -> None:
    snapshot = make_snapshot([make_job("a")], 2)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    doubled = replace(plan, releases=(Release("a", "batch"), Release("a", "batch")))
    with pytest.raises(PlanInvariantViolated, match="twice"):
        check_plan_invariants(doubled, snapshot)


def test_invariant_check_rejects_releases_beyond_capacity() -> None:
    snapshot = make_snapshot([make_job("a"), make_job("b")], 1)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    over = replace(plan, releases=(Release("a", "batch"), Release("b", "batch")))
    with pytest.raises(PlanInvariantViolated, match="capacity"):
        check_plan_invariants(over, snapshot)


def test_invariant_check_rejects_preempting_the_origin() -> None:
    job = running("r", "w0")
    snapshot = make_snapshot([job], 1)
    plan = replace(plan_tick(snapshot, POLICY, NOW_S), origin_id="r", preempt=("r",))
    with pytest.raises(PlanInvariantViolated, match="origin"):
        check_plan_invariants(plan, snapshot)


@settings(max_examples=100, deadline=None)
@given(snapshot=snapshots(), extra=st.integers(0, 6))
def test_invariant_check_counts_capacity_as_the_set_of_jobs_in_flight_after_the_plan(
        snapshot: ClusterSnapshot, extra: int) -> None:
    # given a plan with up to `extra` more releases of pending jobs it left alone
    plan = plan_tick(snapshot, POLICY, NOW_S)
    acted = {*(r.job_id for r in plan.releases), *plan.suspend, *(e.job_id for e in plan.expire)}
    more = [Release(j.job_id, "batch") for j in snapshot.jobs
            if j.state is JobState.PENDING and j.job_id not in acted][:extra]
    grown = replace(plan, releases=(*plan.releases, *more))
    # when it is checked, then it fails on capacity exactly when the set definition says so
    # (a slot: a job, or a batch however many jobs it carries)
    jobs = {j.job_id: j for j in snapshot.jobs}
    removed = {*grown.preempt, *grown.standby, *(e.job_id for e in grown.expire)}
    before = {j.batch_id or i for i, j in jobs.items()
              if j.state in (JobState.QUEUED, JobState.RUNNING) and not j.preempt_requested
              and j.queue != STANDBY_QUEUE and i not in removed}
    batch_of = {r.job_id: r.batch for r in grown.releases}
    added = {r.job_id for r in grown.releases} | {
        r.job_id for r in (*grown.requeues, *grown.retargets) if r.from_queue == STANDBY_QUEUE}
    slots = before | {batch_of.get(i) or i for i in added}
    over = bool(added) and len(slots) > (grown.capacity_slots or 0)
    try:
        check_plan_invariants(grown, snapshot)
        failed = ""
    except PlanInvariantViolated as exc:
        failed = str(exc)
    assert ("capacity" in failed) == over, failed
