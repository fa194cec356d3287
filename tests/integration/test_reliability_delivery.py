"""At-least-once delivery, forced: the same chunk message delivered twice at once to two
workers, and again after it committed. The job still advances exactly once per chunk."""

from __future__ import annotations

import pytest
import redis

from app.drills.faults import FENCED_LOG, audit_job
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.artifacts import ArtifactStore
from tasks.dispatch import publish_chunk
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _stale_claims(processes: Processes) -> int:
    return sum(processes.log(n).count(": stale (") for n in ("w1", "w2"))


def test_duplicated_and_redelivered_chunk_messages_never_advance_a_job_twice(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given two idle workers
    processes.worker("w1")
    processes.worker("w2")
    wait_for_workers(redis_client, ["w1", "w2"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store

    # when a job's first chunk is published a second time (same job, chunk, epoch; new task
    # id), so both idle workers take one copy at once
    spec = JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                   params={"steps": 8, "step_ms": 300}, deadline_s=600)
    job_id, _ = service.submit(spec)
    publish_chunk(store, store.record(job_id), chunk=0, epoch=0, queue="interactive")

    # and a later chunk is duplicated while a worker is running it (the idle one takes it)
    wait_for(lambda: store.fields(job_id)["next_chunk"] == "4"
             and store.state(job_id) is JobState.RUNNING, 30, "chunk 4 to be running")
    publish_chunk(store, store.record(job_id), chunk=4, epoch=0, queue="interactive")
    wait_for(lambda: store.state(job_id) is JobState.DONE, 60, "the job to finish")

    # and chunks that already committed are redelivered after the job finished
    stale_before = _stale_claims(processes)
    for chunk in (2, 7):
        publish_chunk(store, store.record(job_id), chunk=chunk, epoch=0, queue="interactive")
    wait_for(lambda: _stale_claims(processes) >= stale_before + 2, 20,
             "the redeliveries to be refused as stale")

    # then every chunk committed exactly once and was applied once, in order
    audit = audit_job(store, ArtifactStore(current_settings().artifacts_path), job_id)
    assert audit.exact, audit.problem()
    assert store.state(job_id) is JobState.DONE
    # and each duplicate ran into a fence: a lost commit race, or a stale claim
    fenced = sum(processes.log(n).count(FENCED_LOG) for n in ("w1", "w2"))
    assert fenced + stale_before >= 2, (fenced, stale_before)
