"""The live submit path and the simulator decide a new job alike: the same arrivals under the same
policy and admission status end in the same state, on the same queue (a real redis-server)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import redis

from app.bench.sim_workload import MIX, SimArrival, SimConfig
from app.bench.simulate import ClusterSim
from app.schemas import JobSpec
from scheduler import (
    AdmissionState,
    AdmissionStatus,
    ClusterSnapshot,
    JobState,
    PolicyConfig,
    PolicyState,
    SloClass,
    SubmitAction,
    Tier,
    plan_tick,
)
from tasks.adapter import LiveTarget, policy_config
from tasks.errors import Overloaded
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

POLICIES = ("fifo", "priority", "edf", "srpt", "least_slack", "stepline")
SHAPES = {SloClass.REALTIME: MIX[0], SloClass.INTERACTIVE: MIX[1], SloClass.BATCH: MIX[3]}

Outcome = tuple[str, str | None, bool]
"""(state, queue once published, atomic); ("shed", None, False) when refused."""


STATUSES = ("no tick yet", "open", "converging", "shedding", "stale")


def _status(label: str, policy: PolicyConfig, now_s: float) -> AdmissionStatus | None:
    """The last tick's admission status as ``label`` says, measured just now (or long ago)."""
    converging, shedding = AdmissionState.CONVERGING, policy.shed_load + 1.0
    return {
        "no tick yet": None,
        "open": AdmissionStatus(AdmissionState.OPEN, 0.2, 0.0, now_s),
        "converging": AdmissionStatus(
            converging, (policy.convergence_threshold + policy.shed_load) / 2, 5.0, now_s),
        "shedding": AdmissionStatus(converging, shedding, 9.0, now_s),
        "stale": AdmissionStatus(converging, shedding, 9.0,
                                 now_s - 10 * policy.admission_status_ttl_s - 1.0),
    }[label]


def _publish_status(target: LiveTarget, policy: PolicyConfig,
                    status: AdmissionStatus | None) -> None:
    """The admission status as the tick publishes it (its own writer), or none at all."""
    if status is None:
        target.store.redis.flushdb()
        return
    empty = ClusterSnapshot((), (), policy.new_cost_model(), PolicyState())
    target.publish_decisions(replace(plan_tick(empty, policy, status.measured_at_s),
                                     admission=status))


def _live(service: JobService, cls: SloClass, tier: Tier) -> Outcome:
    shape = SHAPES[cls]
    spec = JobSpec(kind="simulated", slo=cls, params={
        "steps": shape.chunks, "step_ms": shape.units_per_chunk * shape.s_per_unit * 1e3})
    try:
        job_id, _ = service.submit(spec, tier=tier.value)
    except Overloaded:
        return ("shed", None, False)
    record = service.store.record(job_id)
    queue = record.queue if record.state is JobState.QUEUED else None
    return (record.state.value, queue, record.atomic)


def _simulated(policy: PolicyConfig, status: AdmissionStatus | None, now_s: float,
               cls: SloClass, tier: Tier) -> tuple[Outcome, SubmitAction]:
    shape = SHAPES[cls]
    chunk_s = (shape.units_per_chunk * shape.s_per_unit,) * shape.chunks
    arrival = SimArrival(0, now_s, shape, tier, chunk_s, now_s + 60.0)
    sim = ClusterSim(SimConfig(workers=2), [arrival], policy)
    sim.now, sim.admission = now_s, status
    job = sim.jobs[0]
    decision = sim.arrive(job)
    if job.state is JobState.EXPIRED:
        return ("shed", None, False), decision.action
    if job.state is JobState.RUNNING:  # published, and an idle simulated worker claimed it
        return (JobState.QUEUED.value, job.queue, job.atomic), decision.action
    queue = job.queue if job.state is JobState.QUEUED else None
    return (job.state.value, queue, job.atomic), decision.action


@pytest.mark.parametrize("policy_name", POLICIES)
def test_the_simulator_decides_every_arrival_as_the_live_submit_path_does(
    stack_env: dict[str, str], redis_client: redis.Redis, policy_name: str
) -> None:
    # given the live submit path on a real Redis under one policy, and the simulator under the
    # same policy config, each told the same admission status
    settings = current_settings()
    store = JobStore(redis_client)
    service, target = JobService(store, settings), LiveTarget(store, {}, settings)
    seen: set[SubmitAction] = set()
    for label in STATUSES:
        now_s = time.time()
        store.set_policy(policy_name)
        policy = policy_config(settings, store)
        status = _status(label, policy, now_s)
        _publish_status(target, policy, status)
        store.set_policy(policy_name)  # a fresh database forgets the switch
        for cls in SloClass:
            for tier in Tier:
                # when a job of each class and tier arrives at both
                live = _live(service, cls, tier)
                simulated, action = _simulated(policy, status, now_s, cls, tier)
                seen.add(action)
                # then both end the same way
                assert live == simulated, (policy_name, label, cls, tier)
    expected = {"fifo": {SubmitAction.RELEASE}, "priority": {SubmitAction.RELEASE},
                "edf": {SubmitAction.WAIT}, "srpt": {SubmitAction.WAIT},
                "least_slack": {SubmitAction.WAIT},
                "stepline": {SubmitAction.RELEASE, SubmitAction.SUSPEND, SubmitAction.SHED}}
    assert seen == expected[policy_name]
