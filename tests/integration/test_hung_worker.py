"""A hung worker (SIGSTOP: the process alive, its Redis connections open, its heartbeat lapsed)
loses its work to the others while it hangs — the chunk it was running, the jobs submitted
while it hangs, and a message it took off the queue but never claimed — and its late result,
once it wakes (SIGCONT), is fenced off: every chunk committed once, in order.

How long the takeover took (about the heartbeat timeout) is printed here and measured by
``stepline reliability`` (its ``worker_sigstop_mid_step`` fault), not asserted."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import cast

import pytest
import redis

from app.drills.faults import FENCED_LOG, CpuHogs
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, done, job_audit, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

STEPS, STEP_S = 4, 0.06
"""The interactive jobs: 4 steps of 60 ms (the drill's ``s4x60i``)."""
LIVENESS = 10
"""How many times the expected recovery (the heartbeat timeout and a job's work) a wait allows
before it calls the recovery lost: an upper bound against a hang, not a speed claim."""


@pytest.fixture(params=[0, 2], ids=["quiet", "busy"])
def hogs(request: pytest.FixtureRequest) -> Iterator[int]:
    """Quiet, or a busy machine: two busy processes compete with the stack for the cores."""
    with CpuHogs(int(request.param)):
        yield int(request.param)


def _spec() -> JobSpec:
    return JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                   params={"steps": STEPS, "step_ms": STEP_S * 1000, "block_groups": 1})


def _bound_s() -> float:
    """``LIVENESS`` times the heartbeat timeout (the chunk lease, within which a hung worker's
    heartbeat and its chunk's lease lapse, and a held message is judged unclaimed) and a
    job's own work."""
    return LIVENESS * (current_settings().broker.chunk_lease + STEPS * STEP_S)


def _running_on(store: JobStore, job_id: str, worker: str) -> bool:
    f = store.fields(job_id)
    return (f["state"] == JobState.RUNNING.value and f.get("running_on") == f"{worker}@test"
            and int(f["next_chunk"]) + 1 < int(f["num_chunks"]))


def _assert_exact(store: JobStore, job_id: str, hung: str) -> None:
    audit = job_audit(store, job_id)
    assert audit.exact, audit.problem()
    assert f"{hung}@test" not in {e.get("by") for e in store.events(job_id)
                                  if e.get("kind") == "commit" and e.get("complete") == "1"
                                  and int(e["chunk"]) == STEPS - 1}


def test_a_worker_hung_mid_chunk_loses_it_and_the_new_jobs_and_its_late_commit_is_fenced(
    processes: Processes, redis_client: redis.Redis, hogs: int
) -> None:
    # given two workers and the tick, and a job running a chunk on w1
    for name in ("w1", "w2"):
        processes.worker(name)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    wait_for(lambda: _try_on(service, "w1"), 60, "a job to run a chunk on w1")
    victim = str(_try_on.found)

    # when w1 hangs (SIGSTOP) inside that chunk, and 8 interactive jobs arrive meanwhile
    w1 = processes.procs["w1"]
    os.kill(w1.pid, signal.SIGSTOP)
    hung = time.monotonic()
    try:
        burst = [service.submit(_spec())[0] for _ in range(8)]
        # then the hung chunk and every new job finish on w2 while w1 still hangs
        wait_for(lambda: all(done(store, j) for j in [victim, *burst]), _bound_s(),
                 "the hung worker's job and the new ones to finish on w2")
        took_s = time.monotonic() - hung
    finally:
        os.kill(w1.pid, signal.SIGCONT)
    print(f"taken over {took_s:.1f}s after the hang")

    # and w1, thawed, finds its chunk taken: its commit is refused, the job is unchanged
    wait_for(lambda: FENCED_LOG in processes.log("w1"), 20, "the late commit to be fenced")
    for job_id in [victim, *burst]:
        _assert_exact(store, job_id, "w1")
    assert w1.poll() is None  # and it keeps serving
    after = service.submit(_spec())[0]
    wait_for(lambda: done(store, after), 30, "a job after the thaw")


def test_a_message_a_hung_worker_took_but_never_claimed_is_published_again(
    processes: Processes, redis_client: redis.Redis, hogs: int
) -> None:
    # given two idle workers (each with a BRPOP waiting at Redis) and the tick
    for name in ("w1", "w2"):
        processes.worker(name)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    w1 = processes.procs["w1"]

    # when w1 hangs (SIGSTOP) and the next job's message goes to its waiting BRPOP: off the
    # queue, into the hung process's socket, never claimed, nowhere kombu could restore it
    # from (retried until the message goes to w1 rather than w2)
    swallowed = wait_for(lambda: _swallowed(service, redis_client, w1.pid), 60,
                         "a message to go to the hung worker")
    job_id, hung = swallowed  # type: ignore[misc]
    try:
        # then the tick sees w2 idle on the job's queue while the job waits, and publishes it
        # again under a new epoch: w2 runs it while w1 still hangs
        wait_for(lambda: done(store, job_id), _bound_s(), "the job to run on w2")
        took_s = time.monotonic() - hung
    finally:
        os.kill(w1.pid, signal.SIGCONT)
    print(f"taken over {took_s:.1f}s after the hang")
    reasons = [e.get("reason", "") for e in store.events(job_id) if e.get("by") == "watchdog"]
    assert len(reasons) == 1 and "unclaimed" in reasons[0], reasons

    # and w1, thawed, reads the old message: its epoch is refused at the claim
    refused = re.compile(rf"job {job_id} chunk \d+ epoch 0 .*: stale")
    wait_for(lambda: refused.search(processes.log("w1")), 20, "the old message to be refused")
    audit = job_audit(store, job_id)
    assert audit.exact, audit.problem()
    assert audit.workers == frozenset({"w2@test"})
    after = service.submit(_spec())[0]
    wait_for(lambda: done(store, after), 30, "a job after the thaw")


def _try_on(service: JobService, worker: str) -> bool:
    """Submit a job; whether it (or an earlier one) runs a chunk on ``worker`` now."""
    store = service.store
    if not getattr(_try_on, "ids", None):
        _try_on.ids = []  # type: ignore[attr-defined]
    if len(_try_on.ids) < 6:  # type: ignore[attr-defined]
        _try_on.ids.append(service.submit(_spec())[0])  # type: ignore[attr-defined]
    for job_id in _try_on.ids:  # type: ignore[attr-defined]
        if _running_on(store, job_id, worker):
            _try_on.found = job_id  # type: ignore[attr-defined]
            _try_on.ids = []  # type: ignore[attr-defined]
            return True
    return False


def _swallowed(service: JobService, client: redis.Redis, pid: int
               ) -> tuple[str, float] | None:
    """Stop ``pid`` and submit a job: (its id, when stopped) if its message left the queue for
    the stopped worker's waiting BRPOP (not on the queue, not delivered to any worker that
    read it: kombu's unacked hash, nor claimed); else wake the worker and say None."""
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    job_id = service.submit(_spec())[0]
    time.sleep(0.3)
    unacked = b"".join(cast(dict[bytes, bytes], client.hgetall("unacked")).values())
    if (client.llen("interactive") == 0 and job_id.encode() not in unacked
            and service.store.state(job_id) is JobState.QUEUED):
        return job_id, stopped
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: done(service.store, job_id), 30, "the job on a live worker")
    time.sleep(0.3)  # the woken worker's next BRPOP waits at Redis again
    return None


def test_a_scheduler_that_woke_after_losing_the_tick_lease_applies_nothing_of_its_plan(
    stack_env: dict[str, str], redis_client: redis.Redis
) -> None:
    from tasks import keys
    from tasks.adapter import run_tick
    from tasks.artifacts import ArtifactStore
    from tasks.context import WorkerContext
    from tasks.tick import _take_lease, still_holds

    # given a scheduler that took the tick lease, and a job waiting for the tick
    settings = current_settings()
    store = JobStore(redis_client)
    JobService(store, settings).submit(_spec())
    ctx = WorkerContext(settings=settings, store=store,
                        artifacts=ArtifactStore.from_settings(settings), name="s1@test")
    ttl_s = 1.0
    _take_lease(redis_client, "s1@test", ttl_s)
    taken_at = time.monotonic()
    assert still_holds(redis_client, "s1@test", ttl_s, taken_at)  # no round trip yet

    # when it hangs past its lease, another scheduler takes the tick over, and it wakes
    redis_client.delete(keys.TICK_LEASE)
    assert _take_lease(redis_client, "s2@test", ttl_s).name == "TAKEN"
    hung_at = taken_at - ttl_s  # as if it had been stopped a whole lease
    assert not still_holds(redis_client, "s1@test", ttl_s, hung_at)

    # then its tick plans but applies nothing (no decision published, no job moved)
    redis_client.delete(keys.ADMISSION)
    before = {j: store.fields(j)["rev"] for j in store.active_ids()}
    run_tick(ctx, time.time(),
             holds=lambda: still_holds(redis_client, "s1@test", ttl_s, hung_at))
    assert not redis_client.exists(keys.ADMISSION)
    assert {j: store.fields(j)["rev"] for j in store.active_ids()} == before
    # while the holder's tick applies its plan
    run_tick(ctx, time.time(), holds=lambda: still_holds(redis_client, "s2@test", ttl_s,
                                                         hung_at))
    assert redis_client.exists(keys.ADMISSION)
