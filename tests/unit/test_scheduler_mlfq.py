"""MLFQ: skip-join, demotion after a quantum, aging."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from scheduler import ClusterSnapshot, JobState, PolicyConfig, SloClass, plan_tick
from scheduler.mlfq import aged_level, current_mark, join_level, mark_level
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running, snapshots

pytestmark = pytest.mark.timeout(30)
POLICY = PolicyConfig(level_quanta_s=(1.0, 5.0), aging_bound_s=10.0)


def test_short_realtime_job_joins_level_zero_and_long_one_skips_down() -> None:
    assert join_level(SloClass.REALTIME, 0.5, POLICY) == 0
    assert join_level(SloClass.REALTIME, 3.0, POLICY) == 1
    assert join_level(SloClass.REALTIME, 30.0, POLICY) == 2


def test_a_tiny_batch_job_never_joins_above_its_class() -> None:
    assert join_level(SloClass.BATCH, 0.01, POLICY) == 2


def test_job_is_demoted_after_consuming_its_level_quantum() -> None:
    # given a job at level 0 that has used 1.2 s of service since it joined
    job = make_job("a", level=0, level_service_s=0.3, service_s=1.5)
    # when its mark is computed, then it moves to level 1 with a fresh quantum
    mark = current_mark(job, 2.0, POLICY)
    assert (mark.level, mark.service_mark_s) == (1, 1.5)


def test_job_within_its_quantum_keeps_its_level() -> None:
    job = make_job("a", level=1, level_service_s=0.0, service_s=2.0)
    assert current_mark(job, 2.0, POLICY).level == 1


def test_waiting_past_the_aging_bound_promotes_one_level_per_bound() -> None:
    assert aged_level(2, 9.9, SloClass.BATCH, POLICY) == 2
    assert aged_level(2, 10.0, SloClass.BATCH, POLICY) == 1
    assert aged_level(2, 25.0, SloClass.REALTIME, POLICY) == 0


def test_only_realtime_class_work_ages_into_the_realtime_level() -> None:
    assert aged_level(2, 100.0, SloClass.BATCH, POLICY) == 1


def test_queued_job_whose_level_changed_is_requeued() -> None:
    # given a queued interactive job that has waited past the aging bound in the batch queue
    job = make_job("q", slo_class=SloClass.INTERACTIVE, state=JobState.QUEUED, queue="batch",
                   level=2, waiting_since_s=NOW_S - 11)
    # when the tick runs
    plan = plan_tick(make_snapshot([job]), POLICY, NOW_S)
    # then it is requeued from batch to interactive
    assert [(r.job_id, r.from_queue, r.to_queue) for r in plan.requeues] == [
        ("q", "batch", "interactive")]


def test_running_job_demoted_mid_run_sends_its_next_chunk_to_the_lower_queue() -> None:
    job = running("r", "w0", slo_class=SloClass.REALTIME, queue="realtime", level=0,
                  service_s=1.5, level_service_s=0.0, work_s=3.0)
    plan = plan_tick(make_snapshot([job]), POLICY, NOW_S)
    assert [(r.job_id, r.to_queue) for r in plan.retargets] == [("r", "interactive")]
    assert plan.levels["r"].level == 1


def test_released_job_gets_its_level_recorded() -> None:
    plan = plan_tick(make_snapshot([make_job("a", slo_class=SloClass.REALTIME, work_s=0.2)]),
                     POLICY, NOW_S)
    assert plan.releases[0].queue == "realtime"
    assert plan.levels["a"].level == 0


def test_a_cold_load_ahead_does_not_push_a_short_job_down_a_level() -> None:
    from scheduler.incremental import IncrementalPlanner

    # given a short interactive job that expects an 8 s model load before it runs
    job = make_job("a", slo_class=SloClass.INTERACTIVE, work_s=0.2, deadline_s=NOW_S + 60,
                   load_s=8.0)
    snapshot = make_snapshot([job])
    # when the tick releases it, by the pure plan and by the live tick's planner alike
    for plan in (plan_tick(snapshot, POLICY, NOW_S),
                 IncrementalPlanner().plan(snapshot, POLICY, NOW_S)):
        # then its level is that of its own work: a load is where it runs, not its size
        assert plan.levels["a"].level == 1
        assert plan.releases[0].queue == "interactive"


def test_fast_level_paths_agree_with_the_full_level_computation() -> None:
    # given new jobs of every class and size, some aged, planned while converging
    from scheduler.ordering import order_jobs

    jobs = [make_job(f"{cls.value}-{work}-{wait}", slo_class=cls, work_s=work,
                     waiting_since_s=NOW_S - wait)
            for cls in SloClass for work in (0.5, 3.0, 30.0) for wait in (0.0, 11.0)]
    order = order_jobs(make_snapshot(jobs, 2), POLICY, NOW_S)
    levels = order.levels
    # then the fast checks match level() for each job
    for i, job in enumerate(order.survey.live):
        assert levels.at_lowest(i) == (levels.level(i) == 2), job.job_id
        if job.slo_class is SloClass.REALTIME and order.survey.remaining_s[i] <= 1.0:
            assert levels.level(i) == 0, job.job_id


@settings(max_examples=100, deadline=None)
@given(snapshot=snapshots())
def test_mark_level_is_the_level_of_the_current_mark(snapshot: ClusterSnapshot) -> None:
    # given any job and remaining work; then the tick's allocation-free level agrees
    for job in snapshot.jobs:
        for remaining_s in (0.5, 3.0, 30.0):
            assert mark_level(job, remaining_s, POLICY) == current_mark(job, remaining_s,
                                                                        POLICY).level
