"""Celery's broker on a Redis of its own (``broker.url``), the job store on another: real worker
processes and two real servers. The queues live on the broker only, every hop is published
through Celery, and a worker that dies mid-job or between a commit and its publish still gets
its job finished exactly (the tick's lease and unpublished recoveries)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.celery import configure as configure_celery
from app.embedded_redis import EmbeddedRedis
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.dispatch import release
from tasks.routing import ALL_QUEUES
from tasks.runtime import current_settings, separate_broker
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tasks.submit import JobService
from tests.conftest import (
    Processes,
    done,
    job_audit,
    recover_once,
    use_stack_env,
    wait_for,
    wait_for_workers,
)
from tests.integration.test_model_jobs import IMAGE, uninterrupted_artifact
from tests.store_steps import claim_chunk, create_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture()
def apart_env(redis_server: EmbeddedRedis, redis_client: redis.Redis,
              broker_server: EmbeddedRedis, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The stack's environment with ``STEPLINE_BROKER__URL`` naming the second server; after
    the test, this process's Celery app points back at the store's server."""
    yield from use_stack_env({"REDIS_URL": redis_server.url,
                              "STEPLINE_BROKER__URL": broker_server.url}, tmp_path, monkeypatch)
    monkeypatch.delenv("STEPLINE_BROKER__URL")
    current_settings.cache_clear()
    configure_celery(current_settings())


@pytest.fixture()
def apart(apart_env: dict[str, str], tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(apart_env, tmp_path / "logs")
    yield procs
    procs.stop_all()


def _store(redis_client: redis.Redis, broker_redis: redis.Redis) -> JobStore:
    return JobStore(redis_client, broker=broker_redis)


def _submit(service: JobService, steps: int, step_ms: float) -> str:
    spec = JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                   params={"steps": steps, "step_ms": step_ms}, deadline_s=600)
    return service.submit(spec)[0]


def _kombu_keys(client: redis.Redis) -> list[bytes]:
    """What kombu keeps in a Redis: queue lists, bindings, the unacked messages."""
    found = [*client.keys("_kombu*"), *client.keys("unacked*")]
    return found + [name.encode() for name in ALL_QUEUES if client.exists(name)]


def _running_chunk(store: JobStore, job_id: str, min_chunk: int) -> str | None:
    """The worker running the job, once its chunk ``min_chunk`` or a later one runs."""
    fields = store.fields(job_id)
    if fields["state"] != JobState.RUNNING.value or int(fields["next_chunk"]) < min_chunk:
        return None
    return fields["running_on"].split("@")[0]


def test_jobs_run_exactly_with_every_queue_on_the_broker_and_none_in_the_store(
    apart: Processes, redis_client: redis.Redis, broker_redis: redis.Redis
) -> None:
    # given the tick, no chunk worker yet, and Celery's broker apart from the store
    assert separate_broker(current_settings())
    apart.scheduler()
    wait_for_workers(redis_client, ["scheduler"])
    service = JobService(_store(redis_client, broker_redis), current_settings())

    # when a job is submitted, its first chunk waits on the broker's queue, not the store's
    job_id = _submit(service, steps=12, step_ms=20)
    wait_for(lambda: broker_redis.llen("interactive") == 1, 30, "the chunk on the broker")
    assert not redis_client.exists("interactive")

    # and once two workers take the queues, the job hops chunk by chunk through Celery
    apart.worker("w1")
    apart.worker("w2")
    wait_for(lambda: done(service.store, job_id), 60, "the job to finish")

    # then every chunk ran once, in order, each its own task, and kombu kept nothing in the store
    audit = job_audit(service.store, job_id)
    assert audit.exact, audit.problem()
    commits = [e for e in service.store.events(job_id) if e["kind"] == "commit"]
    assert [int(c["chunk"]) for c in commits] == list(range(12))
    assert len({c["task"] for c in commits}) == 12
    assert _kombu_keys(redis_client) == []
    assert broker_redis.exists("_kombu.binding.interactive")


def test_a_worker_sigkilled_mid_job_with_the_broker_apart_gets_its_job_finished_exactly(
    apart: Processes, redis_client: redis.Redis, broker_redis: redis.Redis
) -> None:
    # given two workers and the tick, and a job of short steps (many hops, each two round trips)
    apart.worker("w1")
    apart.worker("w2")
    apart.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(_store(redis_client, broker_redis), current_settings())
    job_id = _submit(service, steps=16, step_ms=150)

    # when the worker running it is SIGKILLed mid-job
    victim = str(wait_for(lambda: _running_chunk(service.store, job_id, 3), 30,
                          "the job to run its fourth chunk"))
    apart.kill(victim)

    # then the tick requeues it and the other worker finishes it: every chunk once, in order
    wait_for(lambda: done(service.store, job_id), 90, "the job to finish")
    audit = job_audit(service.store, job_id)
    assert audit.exact, audit.problem()
    assert int(service.store.fields(job_id)["epoch"]) >= 1
    assert _kombu_keys(redis_client) == []


def test_an_image_job_preempted_and_resumed_on_another_worker_matches_the_uninterrupted_run(
    apart: Processes, redis_client: redis.Redis, broker_redis: redis.Redis
) -> None:
    # given an image job running on w1, the broker apart
    apart.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    service = JobService(_store(redis_client, broker_redis), current_settings())
    store = service.store
    job_id, _ = service.submit(JobSpec(kind="image", slo=SloClass.BATCH, params=IMAGE,
                                       deadline_s=600))
    wait_for(lambda: int(store.fields(job_id)["next_chunk"]) >= 3, 60, "three chunks on w1")

    # when it is preempted, w1 goes away and w2 resumes it from its checkpoint
    wait_for(lambda: store.request_preempt(job_id, state=(r := store.record(job_id)).state,
                                           epoch=r.epoch), 10, "the preempt flag to be set")
    wait_for(lambda: store.state(job_id) is JobState.PREEMPTED, 30, "the job to yield")
    apart.kill("w1")
    apart.worker("w2")
    wait_for_workers(redis_client, ["w2"])
    release(store, store.record(job_id), queue="batch", by="test", reason="resume elsewhere")

    # then both ran it, and its image is the uninterrupted run's, byte for byte
    wait_for(lambda: store.state(job_id) is JobState.DONE, 90, "the job to finish on w2")
    assert {e["by"] for e in store.events(job_id) if e["kind"] == "commit"} == {"w1@test",
                                                                                  "w2@test"}
    record = store.record(job_id)
    artifact = (current_settings().artifacts_path / str(record.artifact)).read_bytes()
    assert artifact == uninterrupted_artifact("image", IMAGE)
    assert _kombu_keys(redis_client) == []


def test_a_hop_committed_but_never_published_is_published_on_the_broker_by_the_tick(
    apart_env: dict[str, str], redis_client: redis.Redis, broker_redis: redis.Redis
) -> None:
    # given a released two-chunk job: its message is on the broker
    settings = current_settings()
    store = _store(redis_client, broker_redis)
    spec = JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="t", tier="standard", num_chunks=2, cost_key="sim",
                           cost_units=[1.0, 1.0], deadline_s=60, now_s=time.time(),
                           queue="interactive")
    assert release(store, store.record(job_id), queue="interactive", by="test", reason="test")
    assert broker_redis.llen("interactive") == 1

    # when a worker takes it, commits chunk 0 and dies before publishing chunk 1
    broker_redis.rpop("interactive")
    claimed = claim_chunk(store, job_id, 0, 0, "w1@test", settings.broker.chunk_lease)
    assert not isinstance(claimed, str), claimed
    commit = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=claimed.seq, complete=True,
                                        checkpoint=b"state", service_s=0.001, worker="w1@test",
                                        hop_queues={}, then_continue=False))
    assert commit.status is CommitStatus.HOP and commit.published is None
    assert broker_redis.llen("interactive") == 0

    # then a tick a lease later finds the chunk unpublished and publishes it, on the broker
    later_s = time.time() + settings.broker.chunk_lease + 1
    assert recover_once(store, settings, later_s) == [job_id]
    record = store.record(job_id)
    assert (record.state, record.next_chunk, record.epoch) == (JobState.QUEUED, 1, 1)
    assert record.published == 1 and record.last_task_id.startswith(f"{job_id}.1.1.")
    assert broker_redis.llen("interactive") == 1
    assert _kombu_keys(redis_client) == []
