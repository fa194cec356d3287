"""One tick path: the snapshots the live tick planned from, recorded on a real stack (two worker
processes of the simulated device holding models under a byte budget, jobs of several models
with adapters, Stepline placement, the tick run by this process over the real store), replay
through a fresh planner of the kind the simulator holds (``scheduler.IncrementalPlanner``, as
``app.bench.simulate.ClusterSim`` does) and through the readable ``plan_tick`` into the very
plans the live tick made, tick by tick. The marks the live side put on the views (expected
loads, a model gone from its worker, an idle holder) are part of what is replayed."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler import ClusterSnapshot, IncrementalPlanner, PolicyConfig, TickPlan, plan_tick
from scheduler.lifecycle import JobState, SloClass
from tasks.adapter import run_tick
from tasks.artifacts import ArtifactStore
from tasks.context import WorkerContext
from tasks.load_estimates import ExpectedLoads
from tasks.runtime import current_settings
from tasks.snapshot import SnapshotCache
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL_BYTES = 1 << 20


class RecordingPlanner(IncrementalPlanner):
    """The live tick's planner, keeping every (snapshot, policy, now, plan) it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks: list[tuple[ClusterSnapshot, PolicyConfig, float, TickPlan]] = []

    def plan(self, snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
        plan = super().plan(snapshot, policy, now_s)
        self.ticks.append((snapshot, policy, now_s, plan))
        return plan


@pytest.fixture(params=["quiet", "busy"])
def machine(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run on a quiet machine, and with two processes burning the cores the workers, the
    redis-server and the tick run on (tick timing then shifts which snapshots are taken)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 if request.param == "busy" else 0)]
    try:
        yield request.param
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _params(model: str, adapters: int) -> dict[str, Any]:
    return {"steps": 4, "step_ms": 40.0, "model": model, "model_bytes": MODEL_BYTES,
            "load_ms": 120.0, "host_load_ms": 40.0,
            "adapters": [{"name": f"{model}.a{k}", "load_ms": 30.0} for k in range(adapters)]}


def test_the_live_tick_s_plans_replay_identically_through_the_simulator_s_planner(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    machine: str,
) -> None:
    # given two workers whose devices hold two models each, under Stepline placement
    env = {"STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(2 * MODEL_BYTES),
           "STEPLINE_AFFINITY__PLACEMENT": "stepline",
           "STEPLINE_AFFINITY__KINDS": '["text", "simulated"]',
           "STEPLINE_BROKER__CHUNK_LEASE": "0.6", "STEPLINE_WARM_START": "false"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    current_settings.cache_clear()
    processes.worker("w1", extra_env=env)
    processes.worker("w2", extra_env=env)
    wait_for_workers(redis_client, ["w1", "w2"])
    settings = current_settings()
    store = JobStore(redis_client)
    service = JobService(store, settings)
    # and fourteen jobs of four models, some with adapters, interactive and batch, at once
    ids = [service.submit(JobSpec(kind="simulated",
                                  slo=SloClass.INTERACTIVE if k % 3 else SloClass.BATCH,
                                  params=_params(f"trace-m{k % 4}", k % 3 == 1),
                                  deadline_s=60))[0]
           for k in range(14)]
    # when this process ticks the stack every 100 ms until they are done, recording each plan
    planner = RecordingPlanner()
    ctx = WorkerContext(settings=settings, store=store,
                        artifacts=ArtifactStore.from_settings(settings), name="scheduler@test")
    cache, loads = SnapshotCache(store), ExpectedLoads()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run_tick(ctx, time.time(), cache=cache, planner=planner, loads=loads)
        if all(store.state(j) is JobState.DONE for j in ids):
            break
        time.sleep(0.1)
    assert all(store.state(j) is JobState.DONE for j in ids), [store.state(j) for j in ids]
    # then the live tick moved work (requeues, retargets, recoveries) on views with expected
    # loads
    plans = [plan for *_, plan in planner.ticks]
    assert len(plans) >= 10
    assert any(p.requeues or p.retargets or p.standby or p.recoveries or p.releases
               for p in plans)
    assert any(v.load_s > 0 for snapshot, *_ in planner.ticks for v in snapshot.jobs)
    # and a fresh planner of the simulator's kind, fed the same snapshots in order, and the
    # readable pipeline, make every one of the live plans
    fresh = IncrementalPlanner()
    for snapshot, policy, now_s, plan in planner.ticks:
        assert fresh.plan(snapshot, policy, now_s) == plan
        assert plan_tick(snapshot, policy, now_s) == plan
