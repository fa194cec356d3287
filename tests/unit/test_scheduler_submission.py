"""The submit decision (``scheduler.submission``): what becomes of a job the moment it arrives,
for the live submit path and the simulator alike."""

from __future__ import annotations

import pytest

from app.bench.sim_workload import MIX, SimArrival, SimConfig
from app.bench.simulate import ClusterSim
from scheduler import (
    AdmissionState,
    AdmissionStatus,
    JobState,
    PolicyConfig,
    PolicyKind,
    SloClass,
    SubmitAction,
    Tier,
    decide_submit,
)
from scheduler.degradation import Degradation
from tests.unit.test_scheduler_support import NOW_S, make_job

pytestmark = pytest.mark.timeout(60)

OPEN = AdmissionStatus(AdmissionState.OPEN, 0.1, 0.0, NOW_S)
CONVERGING = AdmissionStatus(AdmissionState.CONVERGING, 1.0, 5.0, NOW_S)
SHEDDING = AdmissionStatus(AdmissionState.CONVERGING, 2.0, 9.0, NOW_S)


def _decide(policy: PolicyKind = PolicyKind.STEPLINE, status: AdmissionStatus | None = OPEN,
            now_s: float = NOW_S, **job: object) -> tuple[SubmitAction, str, bool]:
    decision = decide_submit(make_job("new", **job), PolicyConfig(policy=policy), status, now_s)
    return decision.action, decision.queue, decision.atomic


def test_admitted_work_is_released_to_its_class_queue_at_once() -> None:
    assert _decide(slo_class=SloClass.INTERACTIVE) == (SubmitAction.RELEASE, "interactive", False)


def test_fifo_releases_every_job_as_one_atomic_task_on_its_one_queue() -> None:
    assert _decide(PolicyKind.FIFO, slo_class=SloClass.REALTIME) == (
        SubmitAction.RELEASE, "batch", True)


@pytest.mark.parametrize("policy", [PolicyKind.EDF, PolicyKind.SRPT, PolicyKind.LEAST_SLACK])
def test_top_cap_baselines_leave_every_release_to_the_tick(policy: PolicyKind) -> None:
    assert _decide(policy, status=None, slo_class=SloClass.REALTIME)[0] is SubmitAction.WAIT


def test_a_job_with_dependencies_waits_for_the_tick() -> None:
    assert _decide(depends_on=("other",))[0] is SubmitAction.WAIT


def test_batchable_work_waits_for_a_running_tick_and_is_released_without_one() -> None:
    # given a batchable job; when a tick runs, it packs the job; when none does, nothing would
    assert _decide(batch_group="g")[0] is SubmitAction.WAIT
    assert _decide(batch_group="g", status=None)[0] is SubmitAction.RELEASE
    assert _decide(batch_group="g", now_s=NOW_S + 60.0)[0] is SubmitAction.RELEASE


def test_overload_suspends_batch_work_and_sheds_standard_work_past_the_shed_load() -> None:
    assert _decide(status=CONVERGING)[0] is SubmitAction.SUSPEND
    assert _decide(status=CONVERGING, slo_class=SloClass.INTERACTIVE)[0] is SubmitAction.RELEASE
    assert _decide(status=SHEDDING, slo_class=SloClass.INTERACTIVE)[0] is SubmitAction.SHED
    assert _decide(status=SHEDDING, slo_class=SloClass.INTERACTIVE,
                   tier=Tier.GOLD)[0] is SubmitAction.RELEASE


@pytest.mark.parametrize("slo_class", [SloClass.INTERACTIVE, SloClass.BATCH])
def test_a_job_degraded_to_a_level_that_makes_its_deadline_is_admitted_not_shed(
        slo_class: SloClass) -> None:
    # given work admission sheds at this load at full quality
    job, policy = make_job("new", slo_class=slo_class), PolicyConfig()
    assert decide_submit(job, policy, SHEDDING, NOW_S).action is SubmitAction.SHED
    # when admission degraded it to a level predicted on time, it runs, saying why
    saved = decide_submit(job, policy, SHEDDING, NOW_S, Degradation(4, 8, "to 4 of 8", True))
    assert saved.action is SubmitAction.RELEASE and "admitted" in saved.reason
    # and when even its floor is predicted late, shedding stays the last resort
    late = decide_submit(job, policy, SHEDDING, NOW_S, Degradation(4, 8, "to 4 of 8", False))
    assert late.action is SubmitAction.SHED and "overloaded" in late.reason


def test_a_top_cap_baseline_in_the_simulator_waits_for_the_tick_on_an_idle_cluster() -> None:
    # given an idle simulated cluster under EDF, ticking every 100 ms, and one job arriving
    # between two ticks (the simulator used to release it at once when a slot was free; the
    # live submit path never does, and the simulator now decides as it does)
    shape = MIX[0]
    chunk_s = shape.units_per_chunk * shape.s_per_unit
    arrival = SimArrival(0, 0.05, shape, Tier.STANDARD, (chunk_s,) * shape.chunks, 10.0)
    config = SimConfig(workers=2, rate_per_s=1.0, duration_s=0.1, drain_s=5.0, tick_s=0.1)
    sim = ClusterSim(config, [arrival], PolicyConfig(policy=PolicyKind.EDF))
    # when it arrives, it stays PENDING
    sim.now = arrival.arrival_s
    assert sim.arrive(sim.jobs[0]).action is SubmitAction.WAIT
    assert sim.jobs[0].state is JobState.PENDING
    # then, run from the start, its first chunk is claimed only after the next tick
    result = ClusterSim(config, [arrival], PolicyConfig(policy=PolicyKind.EDF)).run()
    finished_s = result.finished_s[0]
    work_s = shape.chunks * (chunk_s + config.dispatch_overhead_s)
    assert finished_s == pytest.approx(0.1 + work_s)
