"""The scheduler and beat crash: a standby scheduler takes the tick lease over, no job that
needs the tick is stranded, and ticks resume when beat is restarted.

How soon the standby takes over is printed here and measured by ``stepline reliability``
(its ``scheduler_kill`` fault), not asserted."""

from __future__ import annotations

import time

import pytest
import redis

from app.drills.faults import audit_job
from app.schemas import JobSpec
from app.stack import beat_command, worker_command
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _holder(client: redis.Redis) -> str | None:
    raw = client.get(keys.TICK_LEASE)
    return raw.decode().split("@")[0] if raw else None


def _ticks_since(client: redis.Redis, since_s: float) -> int:
    return sum(1 for _, f in client.xrange(keys.TICK_STATS) if float(f[b"ts"]) > since_s)


def _last_tick(client: redis.Redis) -> tuple[bytes, dict[bytes, bytes]]:
    (entry_id, fields), = client.xrevrange(keys.TICK_STATS, count=1)
    return entry_id, fields


def _running_on(store: JobStore, job_id: str, min_chunk: int) -> str | None:
    f = store.fields(job_id)
    if f["state"] == JobState.RUNNING.value and int(f["next_chunk"]) >= min_chunk:
        return f["running_on"].split("@")[0]
    return None


def test_a_killed_tick_holder_is_replaced_by_the_standby_and_no_job_is_stranded(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given two scheduler workers on the control queue, beat, and two workers
    for name in ("s1", "s2"):
        processes.start(name, worker_command(f"{name}@test", ("control",)))
    processes.start("beat", beat_command(processes.log_dir))
    for name in ("w1", "w2"):
        processes.worker(name)
    wait_for_workers(redis_client, ["s1", "s2", "w1", "w2"])
    holder = str(wait_for(lambda: _holder(redis_client), 30, "a scheduler to hold the lease"))
    standby = "s2" if holder == "s1" else "s1"
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH,
                                       params={"steps": 16, "step_ms": 150}, deadline_s=600))

    # when the lease holder and the job's worker are SIGKILLed together, so that only the
    # tick's watchdog can requeue the job
    worker = str(wait_for(lambda: _running_on(store, job_id, 3), 30, "the job to run"))
    processes.kill(holder)
    processes.kill(worker)
    killed_at = time.time()

    # then the standby takes the lease once its 1 s TTL lapses
    wait_for(lambda: _holder(redis_client) == standby, 30, "the standby to take the lease")
    print(f"the standby took the lease {time.time() - killed_at:.2f}s after the kill")
    # and the job, requeued by the new holder's watchdog, finishes exactly
    wait_for(lambda: store.state(job_id) is JobState.DONE, 60, "the job to finish")
    audit = audit_job(store, ArtifactStore(current_settings().artifacts_path), job_id)
    assert audit.exact, audit.problem()
    assert any(e.get("by") == "watchdog" for e in store.events(job_id))
    # and every tick's stats entry says what its time went to (the phases and what it read)
    _, last = _last_tick(redis_client)
    assert {b"read_ms", b"plan_ms", b"check_ms", b"apply_ms", b"jobs", b"reread"} <= set(last)
    assert sum(float(last[f"{phase}_ms".encode()]) for phase in ("read", "plan", "check",
                                                                 "apply")) \
        <= float(last[b"duration_ms"]) + 0.01

    # when beat dies, ticks stop; a job that only a tick can release waits
    processes.kill("beat")
    time.sleep(0.5)
    stopped_at = time.time()
    dependent, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                                          params={"steps": 2, "step_ms": 10},
                                          depends_on=[job_id], deadline_s=600))
    time.sleep(1.0)
    assert _ticks_since(redis_client, stopped_at) == 0
    assert store.state(dependent) is JobState.PENDING

    # then a restarted beat resumes the ticks and the waiting job runs
    processes.start("beat", beat_command(processes.log_dir))
    wait_for(lambda: _ticks_since(redis_client, stopped_at) >= 5, 30, "ticks to resume")
    wait_for(lambda: store.state(dependent) is JobState.DONE, 30, "the dependent job to run")
