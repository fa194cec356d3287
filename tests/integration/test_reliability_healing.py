"""The tick's recovery on a real store, with chunk claims and commits made by hand: when a
running chunk is stuck, when it is merely slow, and when a QUEUED job lost its message."""

from __future__ import annotations

import time

import pytest
import redis

from scheduler.cost import CostModel
from scheduler.lifecycle import JobState, SloClass
from tasks.record import encode
from tasks.runtime import current_settings
from tasks.settings import Settings, load_settings
from tasks.spec import JobSpec
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tasks.submit import JobService
from tests.conftest import recover_once
from tests.store_steps import claim_chunk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@pytest.fixture()
def store(stack_env: dict[str, str], redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client)


def _settings(factor: float = 5, min_s: float = 0.2) -> Settings:
    return load_settings(broker={"stuck_factor": factor, "stuck_min_s": min_s,
                                 "chunk_lease": 1.5})


def _running_job(store: JobStore, commits: int, service_s: float = 0.1) -> str:
    """A job with ``commits`` chunks committed by hand, its next chunk claimed just now."""
    job_id, _ = JobService(store, current_settings()).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, params={"steps": 10, "step_ms": 100},
        deadline_s=600))
    for chunk in range(commits):
        claim = claim_chunk(store, job_id, chunk, 0, "w-test", lease_s=100)
        assert not isinstance(claim, str), claim
        commit = store.commit(CommitRequest(job_id, chunk=chunk, epoch=0, seq=claim.seq,
                                            complete=True, checkpoint=b"{}", service_s=service_s,
                                            worker="w-test"))
        assert commit.status is CommitStatus.HOP
    assert not isinstance(claim_chunk(store, job_id, commits, 0, "w-test", lease_s=100), str)
    return job_id


def _at(store: JobStore, job_id: str) -> float:
    started = store.record(job_id).chunk_started_at_s
    assert started is not None
    return started


def test_a_chunk_far_over_its_jobs_median_is_requeued_under_a_new_epoch(store: JobStore) -> None:
    job_id = _running_job(store, commits=3)
    started = _at(store, job_id)
    settings = _settings()

    assert recover_once(store, settings, started + 0.45) == []
    assert recover_once(store, settings, started + 0.6) == [job_id]

    record = store.record(job_id)
    assert (record.state, record.epoch, record.stuck) == (JobState.QUEUED, 1, 1)
    assert str(record.last_task_id).startswith(f"{job_id}.3.1.")  # chunk 3 republished, epoch 1
    late = store.commit(CommitRequest(job_id, chunk=3, epoch=0, seq=3, complete=True,
                                      checkpoint=None, service_s=9, worker="w-test"))
    assert late.status is CommitStatus.STALE  # the stuck attempt's commit is fenced


def test_a_job_with_too_few_commits_or_a_lapsed_lease_is_not_judged_stuck(
    store: JobStore,
) -> None:
    young = _running_job(store, commits=2)
    assert recover_once(store, _settings(), _at(store, young) + 50) == []  # lease: 100 s

    lapsed = _running_job(store, commits=3)
    store.set_fields(lapsed, lease_until_s=_at(store, lapsed) + 1)
    # a lapsed lease is the watchdog's case: requeued as lost, not as stuck
    assert recover_once(store, _settings(), _at(store, lapsed) + 50) == [lapsed]
    assert store.record(lapsed).stuck == 0
    assert any(e.get("by") == "watchdog" for e in store.events(lapsed))


def test_a_uniformly_slow_job_is_not_stuck_and_the_floor_protects_short_steps(
    store: JobStore,
) -> None:
    slow = _running_job(store, commits=3, service_s=2.0)  # every step takes 2 s
    assert recover_once(store, _settings(), _at(store, slow) + 9.0) == []

    tiny = _running_job(store, commits=3, service_s=0.001)  # 5 x 1 ms is far under the floor
    floor = _settings(min_s=0.5)
    assert recover_once(store, floor, _at(store, tiny) + 0.4) == []
    assert recover_once(store, floor, _at(store, tiny) + 0.6) == [tiny]


def test_a_cost_model_estimate_outranks_the_jobs_own_median(store: JobStore) -> None:
    job_id = _running_job(store, commits=0)  # no history at all
    cost_key = store.record(job_id).cost_key
    model = CostModel()
    for _ in range(3):  # the cost key measured at 0.1 s per unit elsewhere
        model = model.observe(cost_key, "cpu", 1.0, 0.1)

    assert recover_once(store, _settings(), _at(store, job_id) + 0.6, model) == [job_id]
    reasons = [e["reason"] for e in store.events(job_id) if e.get("by") == "healer"]
    assert len(reasons) == 1 and "cost model" in reasons[0]


def test_each_stuck_requeue_doubles_the_allowance(store: JobStore) -> None:
    job_id = _running_job(store, commits=3)
    settings = _settings()
    assert recover_once(store, settings, _at(store, job_id) + 0.6) == [job_id]
    assert not isinstance(claim_chunk(store, job_id, 3, 1, "w-other", lease_s=100), str)

    started = _at(store, job_id)
    assert recover_once(store, settings, started + 0.9) == []
    assert recover_once(store, settings, started + 1.1) == [job_id]
    assert store.record(job_id).stuck == 2


def test_a_queued_job_whose_chunk_was_never_published_is_republished(store: JobStore) -> None:
    # given a job a worker moved to QUEUED for chunk 1 and then died before publishing it
    job_id = _running_job(store, commits=1)
    assert store.transition(job_id, JobState.QUEUED, by="w-test", reason="next chunk 1",
                            expect=encode(epoch=0), updates=encode(queued_at_s=time.time()))
    record = store.record(job_id)
    assert str(record.last_task_id).startswith(f"{job_id}.0.0.")
    assert record.queued_at_s is not None
    settings = _settings()

    # then it is left alone while the publisher may still be at it, and republished after
    assert recover_once(store, settings, record.queued_at_s + 0.5) == []
    assert recover_once(store, settings, record.queued_at_s + 2.0) == [job_id]
    after = store.record(job_id)
    assert after.epoch == 1 and str(after.last_task_id).startswith(f"{job_id}.1.1.")
    assert after.queued_at_s is not None
    assert recover_once(store, settings, after.queued_at_s + 60) == []


def test_a_job_whose_dependency_failed_is_failed_with_the_reason(store: JobStore) -> None:
    # given a job that waits for a job that then failed
    service = JobService(store, current_settings())
    dep, _ = service.submit(JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1}))
    waiter, _ = service.submit(JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1},
                                       depends_on=[dep]))
    store.transition(dep, JobState.FAILED, by="test", reason="boom")
    # when the tick recovers
    recover_once(store, _settings(), time.time())
    # then the waiting job is FAILED and says why
    record = store.record(waiter)
    assert record.state is JobState.FAILED
    assert record.error == f"dependency {dep} ended FAILED"
