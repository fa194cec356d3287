"""The Stepline policy on real workers: realtime work cuts in at the next step, and overload
convergence pauses batch admission above the threshold and resumes it below.

How soon the realtime job starts is printed here and measured by
``tests/bench/bench_probes.py`` (probe latency under a batch backlog), not asserted."""

from __future__ import annotations

import json

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def _sim(slo: SloClass, steps: int, step_ms: float, groups: int = 1) -> JobSpec:
    return JobSpec(kind="simulated", slo=slo, deadline_s=None if slo is SloClass.REALTIME else 300,
                   params={"steps": steps, "step_ms": step_ms, "block_groups": groups})


def _admission(client: redis.Redis) -> dict[str, object]:
    raw = client.get(keys.ADMISSION)
    return json.loads(raw) if raw else {}


def test_a_realtime_job_arriving_while_batch_holds_the_workers_starts_within_one_step(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    processes.worker("w2")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    batch = [service.submit(_sim(SloClass.BATCH, 40, 200, groups=4))[0] for _ in range(3)]
    wait_for(lambda: sum(store.state(j) is JobState.RUNNING for j in batch) >= 2, 60,
             "batch work to occupy the workers")

    realtime, _ = service.submit(_sim(SloClass.REALTIME, 4, 20))

    wait_for(lambda: store.state(realtime) is JobState.DONE, 60, "the realtime job")
    record = store.record(realtime)
    assert record.started_at_s is not None and record.finished_at_s is not None
    (worker,) = {e["by"] for e in store.events(realtime) if e["kind"] == "commit"}
    # then the worker that ran it finished at most the batch step it was inside, no further
    # one, before the realtime job started
    steps_between = [e for j in batch for e in store.events(j) if e["kind"] == "commit"
                     and e["by"] == worker and e.get("complete") == "1"
                     and record.submitted_at_s < float(e["ts"]) < record.started_at_s]
    print(f"realtime: started {record.started_at_s - record.submitted_at_s:.3f}s after its "
          f"submit, {len(steps_between)} batch step(s) of {worker} between; finished "
          f"{record.finished_at_s - record.submitted_at_s:.3f}s after it")
    assert len(steps_between) <= 1, steps_between
    # and it finished while every batch job was still running (none of them had to end first)
    assert all(store.record(j).finished_at_s is None
               or store.record(j).finished_at_s > record.finished_at_s  # type: ignore[operator]
               for j in batch)


def test_batch_admission_pauses_above_the_threshold_and_resumes_below(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 5 s load horizon: 2 workers x 5 s = 10 s of outstanding work due within 5 s is load
    # 1.0; eight 1.2 s interactive jobs due in 5 s are load ~1. Batch is refused only past
    # the shed load here (1.5), so a new batch job is parked, not refused
    for name, value in (("LOAD_HORIZON", "5"), ("BATCH_SHED_LOAD", "1.5")):
        monkeypatch.setenv(f"STEPLINE_SCHEDULER__{name}", value)
        processes.env[f"STEPLINE_SCHEDULER__{name}"] = value
    current_settings.cache_clear()
    processes.worker("w1")
    processes.worker("w2")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    due_soon = _sim(SloClass.INTERACTIVE, 12, 100).model_copy(update={"deadline_s": 5.0})
    load = [service.submit(due_soon)[0] for _ in range(8)]
    wait_for(lambda: _admission(redis_client).get("state") == "converging", 20,
             "the tick to see the overload")

    held, _ = service.submit(_sim(SloClass.BATCH, 2, 50))

    assert service.store.state(held) is JobState.SUSPENDED
    wait_for(lambda: service.store.state(held) is JobState.DONE, 60,
             "the held batch job to resume once the load fell")
    transitions = [(e["from"], e["to"]) for e in service.store.events(held) if e["kind"] == "state"]
    assert ("PENDING", "SUSPENDED") in transitions and ("SUSPENDED", "QUEUED") in transitions
    wait_for(lambda: all(service.store.state(j) is JobState.DONE for j in load), 60,
             "the load to finish too")
