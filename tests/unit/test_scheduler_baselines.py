"""The step-preemptive baselines (EDF, SRPT, least slack): the ``cap`` best jobs by one key are
in flight, and a better waiting job takes a slot by preemption only when none is free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    ClusterSnapshot,
    JobState,
    JobView,
    PolicyConfig,
    PolicyKind,
    SloClass,
    TickPlan,
    check_plan_invariants,
    plan_tick,
)
from scheduler.baselines import (
    plan_edf,
    plan_least_slack,
    plan_srpt,
    remaining_work_estimator,
)
from scheduler.queues import STANDBY_QUEUE
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running, snapshots

pytestmark = pytest.mark.timeout(120)

TOP_CAP = (PolicyKind.EDF, PolicyKind.SRPT, PolicyKind.LEAST_SLACK)
PLANNERS: dict[PolicyKind, Callable[[ClusterSnapshot, PolicyConfig, float], TickPlan]] = {
    PolicyKind.EDF: plan_edf, PolicyKind.SRPT: plan_srpt,
    PolicyKind.LEAST_SLACK: plan_least_slack}


def _key(kind: PolicyKind, job: JobView, work_s: float, now_s: float) -> float:
    """Each policy's rank, written out again (smaller goes first)."""
    if kind is PolicyKind.EDF:
        return job.deadline_s
    if kind is PolicyKind.SRPT:
        return work_s
    return job.deadline_s - now_s - work_s


def _plan(kind: PolicyKind, jobs: list[JobView], workers: int,
          **policy: Any) -> tuple[TickPlan, ClusterSnapshot, PolicyConfig]:
    config = PolicyConfig(policy=kind, **policy)
    snapshot = make_snapshot(jobs, workers=workers)
    plan = plan_tick(snapshot, config, NOW_S)
    check_plan_invariants(plan, snapshot, config)
    return plan, snapshot, config


def _released(plan: TickPlan) -> list[str]:
    return [r.job_id for r in plan.releases]


# Three waiting jobs on which the three keys disagree (NOW_S = 1000):
#   "due"   deadline +3 s, 2.5 s of work: slack 0.5 s — earliest deadline
#   "short" deadline +9 s, 0.5 s of work: slack 8.5 s — least work
#   "tight" deadline +4 s, 3.8 s of work: slack 0.2 s — least slack
DISAGREE = [
    make_job("short", work_s=0.5, deadline_s=NOW_S + 9),
    make_job("due", work_s=2.5, deadline_s=NOW_S + 3),
    make_job("tight", work_s=3.8, deadline_s=NOW_S + 4),
]
BEST = {PolicyKind.EDF: "due", PolicyKind.SRPT: "short", PolicyKind.LEAST_SLACK: "tight"}
ORDER = {PolicyKind.EDF: ["due", "tight", "short"], PolicyKind.SRPT: ["short", "due", "tight"],
         PolicyKind.LEAST_SLACK: ["tight", "due", "short"]}


@pytest.mark.parametrize("kind", TOP_CAP)
def test_free_slots_go_to_the_best_waiting_jobs_by_the_policys_key(kind: PolicyKind) -> None:
    # given three waiting jobs on which deadline, work and slack disagree, and one free worker
    plan, _, _ = _plan(kind, DISAGREE, workers=1)
    # then only the best by the policy's own key is released, and nothing is preempted
    assert _released(plan) == [BEST[kind]]
    assert plan.preempt == ()
    assert plan.capacity_slots == 1


@pytest.mark.parametrize("kind", TOP_CAP)
def test_releases_come_in_rank_order_to_the_class_queue(kind: PolicyKind) -> None:
    # given the same jobs in three classes and enough workers for all of them
    classes = (SloClass.REALTIME, SloClass.INTERACTIVE, SloClass.BATCH)
    jobs = [make_job(j.job_id, slo_class=c, work_s=j.remaining_cost_units,
                     deadline_s=j.deadline_s) for j, c in zip(DISAGREE, classes, strict=True)]
    plan, _, _ = _plan(kind, jobs, workers=4)
    # then every job is released, best first, each to its class's queue (Flower shows classes)
    assert _released(plan) == ORDER[kind]
    assert {r.job_id: r.queue for r in plan.releases} == {
        "short": "realtime", "due": "interactive", "tight": "batch"}
    assert not plan.atomic_release and plan.origin_id is None
    assert plan.reserved_workers == frozenset()


@pytest.mark.parametrize("kind", TOP_CAP)
def test_a_better_waiting_job_preempts_the_worst_ranked_in_flight_job(kind: PolicyKind) -> None:
    # given two busy workers, one running a job worse by every key than the other, and a job
    # waiting that is better than both
    busy = [running("good", "w0", work_s=1.0, deadline_s=NOW_S + 5),
            running("worst", "w1", work_s=8.0, deadline_s=NOW_S + 60)]
    waiting = make_job("new", work_s=0.5, deadline_s=NOW_S + 2)
    plan, _, _ = _plan(kind, [*busy, waiting], workers=2)
    # then the worst is flagged and the new job takes its slot
    assert plan.preempt == ("worst",)
    assert _released(plan) == ["new"]


@pytest.mark.parametrize("kind", TOP_CAP)
def test_a_better_waiting_job_takes_a_free_slot_without_preempting(kind: PolicyKind) -> None:
    # given the same jobs but a third, idle worker
    busy = [running("good", "w0", work_s=1.0, deadline_s=NOW_S + 5),
            running("worst", "w1", work_s=8.0, deadline_s=NOW_S + 60)]
    waiting = make_job("new", work_s=0.5, deadline_s=NOW_S + 2)
    plan, _, _ = _plan(kind, [*busy, waiting], workers=3)
    # then nothing is preempted
    assert plan.preempt == ()
    assert _released(plan) == ["new"]


@pytest.mark.parametrize("kind", TOP_CAP)
def test_a_waiting_job_worse_than_every_in_flight_job_waits(kind: PolicyKind) -> None:
    # given two busy workers and a waiting job worse by every key
    busy = [running("a", "w0", work_s=1.0, deadline_s=NOW_S + 5),
            running("b", "w1", work_s=2.0, deadline_s=NOW_S + 8)]
    waiting = make_job("late", work_s=9.0, deadline_s=NOW_S + 90)
    plan, _, _ = _plan(kind, [*busy, waiting], workers=2)
    # then it is neither released nor the cause of a preemption
    assert plan.releases == () and plan.preempt == ()


@pytest.mark.parametrize("kind", TOP_CAP)
def test_a_queued_job_is_a_victim_before_a_running_one_on_a_tie(kind: PolicyKind) -> None:
    # given two in-flight jobs equal by every key (same arrival too), one queued, one running
    twin: dict[str, Any] = {"work_s": 8.0, "deadline_s": NOW_S + 60}
    jobs = [running("run", "w0", **twin),
            make_job("queued", state=JobState.QUEUED, queue="batch", **twin),
            make_job("new", work_s=0.5, deadline_s=NOW_S + 2)]
    plan, _, _ = _plan(kind, jobs, workers=2)
    # then the queued one is flagged: it yields at its claim, having run nothing
    assert plan.preempt == ("queued",)
    assert _released(plan) == ["new"]


@pytest.mark.parametrize("kind", TOP_CAP)
def test_a_job_at_the_preemption_bound_is_never_a_victim(kind: PolicyKind) -> None:
    # given three busy workers, the worst job already preempted max_preemptions times, and
    # two waiting jobs better than every one in flight
    busy = [running("good", "w0", work_s=1.0, deadline_s=NOW_S + 5),
            running("mid", "w1", work_s=4.0, deadline_s=NOW_S + 30),
            running("worst", "w2", work_s=8.0, deadline_s=NOW_S + 60, preemptions=2)]
    waiting = [make_job("new1", work_s=0.3, deadline_s=NOW_S + 1.5),
               make_job("new2", work_s=0.5, deadline_s=NOW_S + 2)]
    plan, _, _ = _plan(kind, [*busy, *waiting], workers=3, max_preemptions=2)
    # then only the other undesired job yields, and only the best waiting job takes its slot
    assert plan.preempt == ("mid",)
    assert _released(plan) == ["new1"]
    # and a desired job is never preempted in the protected one's place
    plan, _, _ = _plan(kind, [busy[0], busy[2], waiting[0]], workers=2, max_preemptions=2)
    assert plan.preempt == () and plan.releases == ()


@pytest.mark.parametrize("kind", TOP_CAP)
def test_with_more_jobs_in_flight_than_slots_nothing_is_released_into_a_full_cluster(
        kind: PolicyKind) -> None:
    # given one alive worker (another died) and three jobs in flight, and a better job waiting
    jobs = [running("r", "w0", work_s=5.0, deadline_s=NOW_S + 50),
            make_job("q1", state=JobState.QUEUED, queue="batch", work_s=6.0,
                     deadline_s=NOW_S + 60),
            make_job("q2", state=JobState.QUEUED, queue="batch", work_s=7.0,
                     deadline_s=NOW_S + 70),
            make_job("new", work_s=0.5, deadline_s=NOW_S + 2)]
    plan, _, _ = _plan(kind, jobs, workers=1)
    # then one victim yields for it, the worst, and the release waits for in flight to drop
    # below the capacity (the plan's invariants hold: see _plan)
    assert plan.preempt == ("q2",)
    assert plan.releases == ()


@pytest.mark.parametrize("kind", TOP_CAP)
def test_jobs_being_preempted_on_standby_or_waiting_for_a_dependency_hold_no_place(
        kind: PolicyKind) -> None:
    # given a flagged running job, a job on standby, and a waiting job whose dependency lives
    jobs = [running("flagged", "w0", work_s=0.1, deadline_s=NOW_S + 1,
                    preempt_requested=True),
            make_job("parked", state=JobState.QUEUED, queue=STANDBY_QUEUE, work_s=0.1,
                     deadline_s=NOW_S + 1),
            make_job("child", work_s=0.1, deadline_s=NOW_S + 1, depends_on=("parked",)),
            make_job("free", work_s=5.0, deadline_s=NOW_S + 50)]
    plan, _, _ = _plan(kind, jobs, workers=1)
    # then the one free slot goes to the only job that may take it
    assert _released(plan) == ["free"]
    assert plan.preempt == ()


@pytest.mark.parametrize("kind", TOP_CAP)
def test_preempted_and_suspended_jobs_are_released_like_pending_ones(kind: PolicyKind) -> None:
    # given a preempted and a suspended job, each better than a pending one, and two workers
    jobs = [make_job("pending", work_s=9.0, deadline_s=NOW_S + 90),
            make_job("preempted", state=JobState.PREEMPTED, work_s=1.0, deadline_s=NOW_S + 5,
                     preemptions=1),
            make_job("suspended", state=JobState.SUSPENDED, work_s=2.0,
                     deadline_s=NOW_S + 8)]
    plan, _, _ = _plan(kind, jobs, workers=2)
    # then the two better ones take the slots
    assert sorted(_released(plan)) == ["preempted", "suspended"]


def test_remaining_work_is_units_times_the_alive_fleets_seconds_per_unit() -> None:
    # given a job of 40 units of image-256 (prior 0.010 s per unit on every device)
    job = make_job("img", cost_key="image-256", remaining_cost_units=40.0)
    estimate = remaining_work_estimator(make_snapshot([job], workers=2))
    # then its remaining work is 0.4 s
    assert estimate(job) == pytest.approx(0.4)


# -- properties over random snapshots ---------------------------------------------------------

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _in_flight(job: JobView) -> bool:
    return (job.state in (JobState.QUEUED, JobState.RUNNING) and not job.preempt_requested
            and job.queue != STANDBY_QUEUE)


@FAST
@given(snapshot=snapshots(), kind=st.sampled_from(TOP_CAP), now_offset_s=st.floats(-1, 60),
       max_preemptions=st.integers(0, 4))
def test_top_cap_plans_keep_their_invariants_and_preempt_only_for_a_better_job(
        snapshot: ClusterSnapshot, kind: PolicyKind, now_offset_s: float,
        max_preemptions: int) -> None:
    # given a random snapshot, planned by a top-cap baseline
    now_s = NOW_S + now_offset_s
    policy = PolicyConfig(policy=kind, max_preemptions=max_preemptions)
    plan = PLANNERS[kind](snapshot, policy, now_s)
    # then every invariant holds (capacity, legal moves, the preemption bound, ...)
    check_plan_invariants(plan, snapshot, policy)
    check_plan_invariants(plan_tick(snapshot, policy, now_s), snapshot, policy)
    # and the capacity is the alive workers' slots
    alive = sum(1 for w in snapshot.workers if w.alive)
    assert plan.capacity_slots == alive * policy.slots_per_worker
    # and every victim is an in-flight job worse by the key than every job released
    jobs = {j.job_id: j for j in snapshot.jobs}
    work_s = remaining_work_estimator(snapshot)

    def key(job_id: str) -> float:
        return _key(kind, jobs[job_id], work_s(jobs[job_id]), now_s)

    assert all(_in_flight(jobs[v]) for v in plan.preempt)
    for victim in plan.preempt:
        assert all(key(victim) >= key(r.job_id) for r in plan.releases)
    # and no more are preempted than the released jobs that found no free slot
    free = (plan.capacity_slots or 0) - sum(1 for j in snapshot.jobs if _in_flight(j))
    if free >= 0 and plan.preempt:
        assert len(plan.releases) == free + len(plan.preempt)
    # and releases come best first
    keys = [key(r.job_id) for r in plan.releases]
    assert keys == sorted(keys)
