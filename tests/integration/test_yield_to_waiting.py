"""A job in flight needs no scheduler tick between its chunks, on real workers: with the tick
lease held by another (a live scheduler that cannot tick), an interactive job submitted while
long batch chunks hold both workers runs every chunk to DONE — the running batch chunk yields
at its next block group to the waiting work (worker side, no preempt flag), and every hop of
the interactive job is taken by a worker. The batch job resumes from that block group and its
output is the uninterrupted one."""

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

BATCH_STEPS = 2


def _states(store: JobStore, job_id: str) -> list[dict[str, str]]:
    return [e for e in store.events(job_id) if e["kind"] == "state"]


def test_an_interactive_job_runs_through_while_the_tick_is_paused(
    processes: Processes, redis_client: redis.Redis
) -> None:
    redis_client.set(keys.TICK_LEASE, "a scheduler that never ticks", px=600_000)
    processes.worker("w1")
    processes.worker("w2")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    # 2 s steps of 20 block groups: a yield point every 100 ms, a step's end far behind it
    batch = [service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=600, params={
        "steps": BATCH_STEPS, "step_ms": 2000, "block_groups": 20}))[0] for _ in range(2)]
    wait_for(lambda: all(store.state(j) is JobState.RUNNING for j in batch), 30,
             "both workers to run a batch chunk")

    probe, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                                      params={"steps": 6, "step_ms": 20}))

    wait_for(lambda: store.state(probe) is JobState.DONE, 60, "the interactive job")
    assert not redis_client.exists(keys.TICK_STATS), "the tick ran: the test proves nothing"
    moves = _states(store, probe)
    assert all(e["by"] in ("submit", "w1@test", "w2@test") for e in moves), moves
    claims = [e for e in moves if e["to"] == JobState.RUNNING.value]
    assert [e["reason"] for e in claims] == [f"chunk {n}" for n in range(6)]

    wait_for(lambda: all(store.state(j) is JobState.DONE for j in batch), 60, "the batch jobs")
    yields = [(job_id, e) for job_id in batch for e in _states(store, job_id)
              if e["reason"].startswith("yielded inside chunk")]
    assert yields, "no batch chunk yielded to the waiting interactive job"
    first_claim_s = float(claims[0]["ts"])
    assert any(float(e["ts"]) <= first_claim_s for _, e in yields), \
        "the interactive job started only after the batch chunks ended"
    for job_id in batch:
        states = {e["to"] for e in _states(store, job_id)}
        assert JobState.PREEMPTED.value not in states  # a yield keeps the job in flight
        record = store.record(job_id)
        assert record.artifact is not None
        body = json.loads((current_settings().artifacts_path / record.artifact).read_bytes())
        assert body["applied"] == list(range(BATCH_STEPS))  # each step applied once
