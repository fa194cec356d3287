"""Workers that die, freeze or hang mid-chunk: the job resumes from its checkpoint on another
worker, and its result is exactly the uninterrupted one (each chunk applied once, in order)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import redis

from app.drills.faults import FENCED_LOG
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, done, job_audit, recover_once, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _service(client: redis.Redis) -> JobService:
    return JobService(JobStore(client), current_settings())


def _submit(service: JobService, steps: int, step_ms: float, block_groups: int = 1) -> str:
    params = {"steps": steps, "step_ms": step_ms, "block_groups": block_groups}
    spec = JobSpec(kind="simulated", slo=SloClass.BATCH, params=params, deadline_s=600)
    return service.submit(spec)[0]


def _inside_chunk(store: JobStore, job_id: str, min_chunk: int, lo_s: float, hi_s: float) -> (
    str | None
):
    """The worker running the job, if its chunk (index >= min_chunk) started lo_s..hi_s ago."""
    f = store.fields(job_id)
    if f["state"] != JobState.RUNNING.value or int(f["next_chunk"]) < min_chunk:
        return None
    elapsed_s = time.time() - float(f["chunk_started_at"])
    return f["running_on"].split("@")[0] if lo_s <= elapsed_s <= hi_s else None


def test_a_worker_sigkilled_between_block_groups_is_survived_with_the_exact_result(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given two workers and the tick, and a job whose 300 ms steps split into 3 block groups
    for name in ("w1", "w2"):
        processes.worker(name)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = _service(redis_client)
    job_id = _submit(service, steps=10, step_ms=300, block_groups=3)

    # when the worker running it is SIGKILLed inside a step, after its first block group
    victim = wait_for(lambda: _inside_chunk(service.store, job_id, 3, 0.13, 0.25), 30,
                      "the job to be inside a step's second block group")
    killed_chunk = int(service.store.fields(job_id)["next_chunk"])
    processes.kill(str(victim))

    # then the other worker resumes it from the checkpoint: every chunk once, in order
    wait_for(lambda: done(service.store, job_id), 60, "the job to finish")
    audit = job_audit(service.store, job_id)
    assert audit.exact, audit.problem()
    fields = service.store.fields(job_id)
    assert int(fields["epoch"]) >= 1  # the watchdog requeued it under a new epoch
    resumed_by = {e["by"] for e in service.store.events(job_id)
                  if e["kind"] == "commit" and e["chunk"] == str(killed_chunk)}
    assert resumed_by and f"{victim}@test" not in resumed_by


def test_a_frozen_worker_loses_its_chunk_to_the_watchdog_and_its_late_commit_is_fenced(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given two workers, the tick, and a job of 400 ms steps
    for name in ("w1", "w2"):
        processes.worker(name)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = _service(redis_client)
    job_id = _submit(service, steps=8, step_ms=400)

    # when the worker running it is frozen (SIGSTOP: its heartbeat thread stops too) mid-chunk
    victim = str(wait_for(lambda: _inside_chunk(service.store, job_id, 2, 0.0, 0.15), 30,
                          "the job to be early in a chunk"))
    os.kill(processes.procs[victim].pid, signal.SIGSTOP)
    try:
        # then its lease lapses, the watchdog requeues the chunk, and the other worker finishes
        wait_for(lambda: done(service.store, job_id), 60, "the job to finish elsewhere")
    finally:
        os.kill(processes.procs[victim].pid, signal.SIGCONT)

    # and the thawed worker's commit of the old attempt lands nowhere
    wait_for(lambda: FENCED_LOG in processes.log(victim), 20, "the late commit to be fenced")
    audit = job_audit(service.store, job_id)
    assert audit.exact, audit.problem()
    assert processes.procs[victim].poll() is None  # and it keeps serving


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _release_breakpoint(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"c\n")
        time.sleep(0.2)


def test_a_hung_chunk_with_a_live_heartbeat_is_requeued_and_its_peers_are_not(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given two workers whose main thread can be parked in a breakpoint while the heartbeat
    # thread keeps beating (the shape of a hung device call)
    ports = {name: _free_port() for name in ("w1", "w2")}
    for name, port in ports.items():
        processes.start(name, _worker_command(name), {"CELERY_RDBSIG": "1",
                                                      "CELERY_RDB_PORT": str(port)})
    wait_for_workers(redis_client, ["w1", "w2"])
    monkeypatch.setenv("STEPLINE_BROKER__STUCK_FACTOR", "5")
    monkeypatch.setenv("STEPLINE_BROKER__STUCK_MIN_S", "1")
    current_settings.cache_clear()
    settings = current_settings()
    service = _service(redis_client)
    store = service.store
    job_id = _submit(service, steps=12, step_ms=250)
    peer_id = _submit(service, steps=12, step_ms=250)

    # when the worker running the job hangs inside a chunk (3 commits taught its step time)
    victim = str(wait_for(lambda: _inside_chunk(store, job_id, 3, 0.0, 0.1), 30,
                          "the job to start a chunk"))
    os.kill(processes.procs[victim].pid, signal.SIGUSR2)
    hung_at = time.time()
    healed: list[str] = []
    lease_left_s: list[float] = []
    try:
        # then the healer (run here as the tick runs it) requeues only the hung job
        def heal_once() -> bool:
            now_s = time.time()
            leases = {j: store.record(j).lease_until_s for j in (job_id, peer_id)}
            found = recover_once(store, settings, now_s)
            healed.extend(found)
            lease_left_s.extend(float(leases[j] or 0.0) - now_s for j in found if j in leases)
            return job_id in healed

        wait_for(heal_once, 20, "the healer to requeue the hung chunk")
        waited_s = time.time() - hung_at
        wait_for(lambda: all(done(store, j) for j in (job_id, peer_id)), 60,
                 "both jobs to finish on the other worker")
    finally:
        _release_breakpoint(ports[victim])

    assert healed == [job_id]
    # not before the stuck threshold (5 x its 250 ms step, and the 1 s floor); how long after
    # it is printed, not asserted: a loaded machine stretches it
    print(f"healed {waited_s:.2f}s after the hang")
    assert waited_s >= 1.0
    assert lease_left_s[0] > 0  # its heartbeat was alive: the lease watchdog could not act
    wait_for(lambda: FENCED_LOG in processes.log(victim), 20, "the late commit to be fenced")
    for job in (job_id, peer_id):
        audit = job_audit(store, job)
        assert audit.exact, audit.problem()
    reasons = [e["reason"] for e in store.events(job_id) if e.get("by") == "healer"]
    assert len(reasons) == 1 and "live heartbeat" in reasons[0]


def _worker_command(name: str) -> list[str]:
    from app.stack import worker_command

    return worker_command(f"{name}@test", ("realtime", "interactive", "batch", "standby"))
