"""Chunked execution on real Celery worker processes and a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, done, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _service(client: redis.Redis) -> JobService:
    return JobService(JobStore(client), current_settings())


def _simulated(slo: SloClass, steps: int, step_ms: float) -> JobSpec:
    return JobSpec(kind="simulated", slo=slo, params={"steps": steps, "step_ms": step_ms},
                   deadline_s=600)


def _commits(store: JobStore, job_id: str) -> list[dict[str, str]]:
    return [e for e in store.events(job_id) if e["kind"] == "commit"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct-publish", "celery-publish"])
def test_a_20_chunk_job_runs_as_20_distinct_chunk_tasks(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    direct: bool,
) -> None:
    # given workers that publish each hop from the commit script, or with Celery's send_task
    env = {"STEPLINE_BROKER__DIRECT_PUBLISH": str(direct).lower()}
    monkeypatch.setenv("STEPLINE_BROKER__DIRECT_PUBLISH", env["STEPLINE_BROKER__DIRECT_PUBLISH"])
    current_settings.cache_clear()
    processes.worker("w1", extra_env=env)
    processes.worker("w2", extra_env=env)
    wait_for_workers(redis_client, ["w1", "w2"])
    service = _service(redis_client)

    job_id, _ = service.submit(_simulated(SloClass.INTERACTIVE, steps=20, step_ms=10))

    wait_for(lambda: done(service.store, job_id), 60, "the job to finish")
    commits = _commits(service.store, job_id)
    assert [int(c["chunk"]) for c in commits] == list(range(20))
    assert len({c["task"] for c in commits}) == 20
    assert all(c["task"].startswith(job_id) for c in commits)
    # each task id is the one the record said was published for that chunk
    assert [c["task"].split(".")[1] for c in commits] == [str(i) for i in range(20)]
    record = service.store.record(job_id)
    assert record.published == 19 and record.last_task_id == commits[-1]["task"]


def test_realtime_chunk_runs_before_interactive_and_batch_behind_a_busy_worker(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    service = _service(redis_client)
    blocker, _ = service.submit(_simulated(SloClass.BATCH, steps=1, step_ms=1500))
    wait_for(lambda: service.store.state(blocker) is JobState.RUNNING, 30, "the blocker to run")

    batch, _ = service.submit(_simulated(SloClass.BATCH, steps=1, step_ms=10))
    interactive, _ = service.submit(_simulated(SloClass.INTERACTIVE, steps=1, step_ms=10))
    realtime, _ = service.submit(_simulated(SloClass.REALTIME, steps=1, step_ms=10))

    wait_for(lambda: all(done(service.store, j) for j in (batch, interactive, realtime)), 60,
             "all three jobs to finish")
    started = {j: float(service.store.fields(j)["started_at"]) for j in (batch, interactive,
                                                                        realtime)}
    assert started[realtime] < started[interactive] < started[batch]


def test_a_job_survives_a_sigkilled_worker_with_no_chunk_lost_or_applied_twice(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    processes.scheduler()  # the tick's watchdog requeues the dead worker's chunk
    wait_for_workers(redis_client, ["w1", "scheduler"])
    service = _service(redis_client)
    job_id, _ = service.submit(_simulated(SloClass.BATCH, steps=30, step_ms=100))
    wait_for(lambda: int(service.store.fields(job_id)["next_chunk"]) >= 8, 30, "8 chunks to run")

    processes.kill("w1")
    killed_at = time.time()
    processes.worker("w2")

    wait_for(lambda: done(service.store, job_id), 90, "the job to finish on w2")
    commits = _commits(service.store, job_id)
    assert sorted(int(c["chunk"]) for c in commits) == list(range(30))
    assert {c["by"] for c in commits} == {"w1@test", "w2@test"}
    record = service.store.record(job_id)
    artifact = json.loads((current_settings().artifacts_path / str(record.artifact)).read_bytes())
    assert artifact["applied"] == list(range(30))
    assert record.finished_at_s is not None and record.finished_at_s > killed_at
