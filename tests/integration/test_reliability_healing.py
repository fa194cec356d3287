"""The healer's judgement on a real store, with chunk claims and commits made by hand: when a
running chunk is stuck, when it is merely slow, and when a QUEUED job lost its message."""

from __future__ import annotations

import json
import time

import pytest
import redis

from app.jobs import JobService
from app.runtime import current_settings
from app.schemas import JobSpec
from app.settings import Settings, load_settings
from app.store import JobStore
from scheduler.lifecycle import JobState, SloClass
from tasks.healing import heal, stuck_reason

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
        claim = store.claim_chunk(job_id, chunk, 0, "w-test", lease_s=100)
        assert not isinstance(claim, str), claim
        assert store.commit_chunk(job_id, chunk=chunk, epoch=0, seq=claim.seq, complete=True,
                                  checkpoint=b"{}", service_s=service_s, worker="w-test")
    assert not isinstance(store.claim_chunk(job_id, commits, 0, "w-test", lease_s=100), str)
    return job_id


def _at(store: JobStore, job_id: str) -> float:
    return float(store.fields(job_id)["chunk_started_at"])


def test_a_chunk_far_over_its_jobs_median_is_requeued_under_a_new_epoch(store: JobStore) -> None:
    job_id = _running_job(store, commits=3)
    started = _at(store, job_id)
    settings = _settings()

    assert heal(store, store.many_fields([job_id]), started + 0.45, settings) == []
    assert heal(store, store.many_fields([job_id]), started + 0.6, settings) == [job_id]

    fields = store.fields(job_id)
    assert (fields["state"], fields["epoch"], fields["stuck"]) == ("QUEUED", "1", "1")
    assert fields["last_task_id"].startswith(f"{job_id}.3.1.")  # chunk 3 republished, epoch 1
    late = store.commit_chunk(job_id, chunk=3, epoch=0, seq=3, complete=True, checkpoint=None,
                              service_s=9, worker="w-test")
    assert late is None  # the stuck attempt's commit is fenced


def test_a_job_with_too_few_commits_or_a_lapsed_lease_is_not_judged_stuck(
    store: JobStore,
) -> None:
    young = _running_job(store, commits=2)
    assert stuck_reason(store, store.fields(young), _at(store, young) + 1000, _settings()) is None

    lapsed = _running_job(store, commits=3)
    store.set_fields(lapsed, lease_until=repr(_at(store, lapsed) + 1))
    assert stuck_reason(store, store.fields(lapsed), _at(store, lapsed) + 50, _settings()) is None


def test_a_uniformly_slow_job_is_not_stuck_and_the_floor_protects_short_steps(
    store: JobStore,
) -> None:
    slow = _running_job(store, commits=3, service_s=2.0)  # every step takes 2 s
    assert stuck_reason(store, store.fields(slow), _at(store, slow) + 9.0, _settings()) is None

    tiny = _running_job(store, commits=3, service_s=0.001)  # 5 x 1 ms is far under the floor
    floor = _settings(min_s=0.5)
    assert stuck_reason(store, store.fields(tiny), _at(store, tiny) + 0.4, floor) is None
    assert stuck_reason(store, store.fields(tiny), _at(store, tiny) + 0.6, floor) is not None


def test_a_cost_model_estimate_outranks_the_jobs_own_median(store: JobStore) -> None:
    job_id = _running_job(store, commits=0)  # no history at all
    fields = store.fields(job_id)

    reason = stuck_reason(store, fields, _at(store, job_id) + 0.6, _settings(),
                          estimate_s=lambda f, chunk: 0.1)
    assert reason is not None and "cost model" in reason


def test_each_stuck_requeue_doubles_the_allowance(store: JobStore) -> None:
    job_id = _running_job(store, commits=3)
    settings = _settings()
    assert heal(store, store.many_fields([job_id]), _at(store, job_id) + 0.6, settings)
    assert not isinstance(store.claim_chunk(job_id, 3, 1, "w-other", lease_s=100), str)

    started = _at(store, job_id)
    assert heal(store, store.many_fields([job_id]), started + 0.9, settings) == []
    assert heal(store, store.many_fields([job_id]), started + 1.1, settings) == [job_id]
    assert store.fields(job_id)["stuck"] == "2"


def test_a_queued_job_whose_chunk_was_never_published_is_republished(store: JobStore) -> None:
    # given a job a worker moved to QUEUED for chunk 1 and then died before publishing it
    job_id = _running_job(store, commits=1)
    assert store.transition(job_id, JobState.QUEUED, by="w-test", reason="next chunk 1",
                            expect={"epoch": "0"}, updates={"queued_at": repr(time.time())})
    fields = store.fields(job_id)
    assert fields["last_task_id"].startswith(f"{job_id}.0.0.")
    settings = _settings()

    # then it is left alone while the publisher may still be at it, and republished after
    assert heal(store, [fields], float(fields["queued_at"]) + 0.5, settings) == []
    assert heal(store, [fields], float(fields["queued_at"]) + 2.0, settings) == [job_id]
    after = store.fields(job_id)
    assert after["epoch"] == "1" and after["last_task_id"].startswith(f"{job_id}.1.1.")
    assert heal(store, [after], float(after["queued_at"]) + 60, settings) == []


def test_the_cost_model_is_trusted_only_where_it_has_measured_the_cost_key(
    store: JobStore,
) -> None:
    from scheduler.cost import CostModel
    from tasks.healing import cost_model_estimate

    job_id = _running_job(store, commits=0)
    fields = store.fields(job_id)
    model = CostModel(priors_s_per_unit={"simulated": 0.01})
    assert cost_model_estimate(model)(fields, 0) is None  # a prior alone is not evidence
    units = json.loads(fields["cost_units"])
    for _ in range(10):  # chunks measured at their declared 100 ms
        model = model.observe(fields["cost_key"], "cpu", units[0], 0.1)
    assert cost_model_estimate(model)(fields, 0) == pytest.approx(0.1, rel=0.2)
