"""Checkpoints above the offload threshold in a real S3 store (SeaweedFS on loopback), Redis
holding only their reference: a job resumed elsewhere gives the uninterrupted output, a missing
object fails the job saying so, and no object outlives the checkpoint or the job it belongs to."""

from __future__ import annotations

import uuid

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.checkpoint_objects import (
    CheckpointObjects,
    CheckpointReference,
    CheckpointSweeper,
    is_reference,
    sweep_ended_jobs,
)
from tasks.context import WorkerContext
from tasks.dispatch import release
from tasks.protocol import _tidy_objects
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tasks.submit import JobService
from tests.conftest import Processes, preempt_after, wait_for, wait_for_workers
from tests.integration.test_model_jobs import IMAGE, uninterrupted_artifact
from tests.object_store import SeaweedS3
from tests.store_steps import claim_chunk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

THRESHOLD_BYTES = 512


@pytest.fixture()
def offloading_env(s3_server: SeaweedS3, stack_env: dict[str, str],
                   monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process and its workers on one S3 store under a fresh prefix, offloading every
    checkpoint above :data:`THRESHOLD_BYTES`."""
    env = {**s3_server.storage_env(uuid.uuid4().hex[:8]),
           "STEPLINE_ARTIFACTS__CHECKPOINT_OFFLOAD_BYTES": str(THRESHOLD_BYTES)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    current_settings.cache_clear()
    return env


def _objects() -> CheckpointObjects:
    settings = current_settings()
    return CheckpointObjects.from_settings(settings, ArtifactStore.from_settings(settings))


def _object_names(objects: CheckpointObjects, job_id: str) -> list[str]:
    folder = f"{objects.artifacts.root}/checkpoints/{job_id}"
    objects.artifacts.fs.invalidate_cache()
    return sorted(str(name) for name in objects.artifacts.fs.find(folder))


def test_a_preempted_job_with_offloaded_checkpoints_resumed_on_another_worker_matches_the_uninterrupted_run(  # noqa: E501
    offloading_env: dict[str, str], processes: Processes, redis_client: redis.Redis,
) -> None:
    # given an image job running on w1, its checkpoints above the threshold
    processes.worker("w1", extra_env=offloading_env)
    wait_for_workers(redis_client, ["w1"])
    service = JobService(JobStore(redis_client), current_settings())
    store, objects = service.store, _objects()
    job_id, _ = service.submit(JobSpec(kind="image", slo=SloClass.BATCH, params=IMAGE,
                                       deadline_s=600))

    # when it is preempted there after three chunks and w1 goes away
    preempt_after(store, job_id, 3, timeout_s=90)
    processes.kill("w1")

    # then Redis holds a small reference to the one object that holds its checkpoint
    stored = store.load_checkpoint(job_id)
    assert stored is not None and is_reference(stored)
    assert redis_client.strlen(keys.job_checkpoint(job_id)) == len(stored) < 300
    reference = CheckpointReference.decode(stored)
    assert reference.size_bytes > THRESHOLD_BYTES
    assert _object_names(objects, job_id) == [f"{objects.artifacts.root}/{reference.name}"]
    print(f"reference {len(stored)} B for a checkpoint of {reference.size_bytes} B")

    # when w2 resumes it to the end
    processes.worker("w2", extra_env=offloading_env)
    wait_for_workers(redis_client, ["w2"])
    release(store, store.record(job_id), queue="batch", by="test", reason="resume elsewhere")
    wait_for(lambda: store.state(job_id) is JobState.DONE, 120, "the job to finish on w2")

    # then its output is the uninterrupted run's, and none of its objects is left
    runs_on = {e["by"] for e in store.events(job_id) if e["kind"] == "commit"}
    assert runs_on == {"w1@test", "w2@test"}
    record = store.record(job_id)
    assert objects.artifacts.read(str(record.artifact)) == uninterrupted_artifact("image", IMAGE)
    assert _object_names(objects, job_id) == []


def _worker(store: JobStore, name: str) -> WorkerContext:
    settings = current_settings()
    return WorkerContext(settings=settings, store=store,
                         artifacts=ArtifactStore.from_settings(settings), name=name)


def test_a_job_whose_checkpoint_object_is_missing_fails_naming_it(
    offloading_env: dict[str, str], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tasks.chunks import execute_chunk

    # given a job whose first chunk committed its checkpoint as an object (threshold 0)
    monkeypatch.setenv("STEPLINE_ARTIFACTS__CHECKPOINT_OFFLOAD_BYTES", "0")
    current_settings.cache_clear()
    store = JobStore(redis_client)
    job_id, _ = JobService(store, current_settings()).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, deadline_s=600,
        params={"steps": 3, "step_ms": 1}))
    assert execute_chunk(_worker(store, "w1"), job_id, 0, 0) == "hop"
    stored = store.load_checkpoint(job_id)
    assert stored is not None and is_reference(stored)

    # when the object is lost and another worker (nothing in memory) claims the next chunk
    objects = _objects()
    objects.forget([stored])
    outcome = execute_chunk(_worker(store, "w2"), job_id, 1, store.record(job_id).epoch)

    # then the job fails, naming the missing object, instead of starting over
    record = store.record(job_id)
    assert outcome == "failed" and record.state is JobState.FAILED
    assert "checkpoint object" in str(record.error) and "missing" in str(record.error)


def _request(job_id: str, seq: int, chunk: int, checkpoint: bytes) -> CommitRequest:
    return CommitRequest(job_id, chunk=chunk, epoch=0, seq=seq, complete=True,
                         checkpoint=checkpoint, service_s=0.01, worker="w1")


def test_a_stale_commit_removes_its_object_and_a_landed_one_removes_the_one_it_replaced(
    offloading_env: dict[str, str], redis_client: redis.Redis,
) -> None:
    # given a job claimed twice for its first chunk (a redelivery), each writing an object
    store = JobStore(redis_client)
    job_id, _ = JobService(store, current_settings()).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, deadline_s=600, params={"steps": 4}))
    ctx, objects = _worker(store, "w1"), _objects()
    first, second = (claim_chunk(store, job_id, 0, 0, name, lease_s=5) for name in ("w1", "w2"))
    assert not isinstance(first, str) and not isinstance(second, str)
    written = [objects.offload(job_id, 1, bytes(1024) + name) for name in (b"a", b"b")]
    assert written[0] is not None and written[1] is not None

    # when both commit, the second too late
    for reference in written:
        request = _request(job_id, first.seq, 0, reference.encode())
        _tidy_objects(ctx, request, commit := store.commit(request))
    # then the late one's object is gone, the one Redis names stays
    assert commit.status is CommitStatus.STALE
    assert _object_names(objects, job_id) == [f"{objects.artifacts.root}/{written[0].name}"]

    # when the next chunk commits a checkpoint of its own
    claim_chunk(store, job_id, 1, 0, "w1", lease_s=5)
    later = objects.offload(job_id, 2, bytes(2048))
    assert later is not None
    request = _request(job_id, first.seq + 1, 1, later.encode())
    landed = store.commit(request)
    _tidy_objects(ctx, request, landed)
    # then the commit names the reference it replaced, whose object is gone
    assert landed.replaced == written[0].encode()
    assert _object_names(objects, job_id) == [f"{objects.artifacts.root}/{later.name}"]


def test_the_sweep_removes_the_objects_of_a_job_cancelled_while_queued(
    offloading_env: dict[str, str], redis_client: redis.Redis,
) -> None:
    # given two queued jobs with checkpoint objects (as if a worker had run and stopped them)
    store = JobStore(redis_client)
    service = JobService(store, current_settings())
    jobs = [service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=600,
                                   params={"steps": 4}))[0] for _ in range(2)]
    objects = _objects()
    for job_id in jobs:
        objects.offload(job_id, 1, bytes(1024))

    # when the client cancels the first, which no worker runs, and the scheduler's sweep runs
    assert store.request_cancel(jobs[0]) is JobState.CANCELLED
    sweeper = CheckpointSweeper(objects, redis_client, interval_s=60)
    assert sweeper.maybe_start(now_s=1000.0)
    sweeper.join(timeout_s=60)

    # then the cancelled job's objects are gone, the live job keeps its own, and the next
    # sweep waits for its interval
    assert _object_names(objects, jobs[0]) == []
    assert len(_object_names(objects, jobs[1])) == 1
    assert objects.job_ids() == [jobs[1]]
    assert not sweeper.maybe_start(now_s=1059.0)
    assert sweep_ended_jobs(objects, redis_client) == []


def test_the_text_so_far_of_an_offloaded_text_checkpoint_is_read_from_the_store(
    offloading_env: dict[str, str], redis_client: redis.Redis,
) -> None:
    import torch

    from app.api.follow import TEXT_STATE_FORMAT, read_text_so_far
    from tasks.read_model import ReadModel
    from workers.checkpoint import Checkpoint

    # given a text job whose committed checkpoint (its KV cache above the threshold) is an object
    store = JobStore(redis_client)
    job_id, _ = JobService(store, current_settings()).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, deadline_s=600, params={"steps": 4}))
    state = Checkpoint({"kv": torch.zeros(64, 16)}, {
        "format": TEXT_STATE_FORMAT, "text": "Quantum bits", "generated": 2, "prompt_tokens": 7})
    objects = _objects()
    reference = objects.offload(job_id, 1, state.encode())
    assert reference is not None
    claimed = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(claimed, str)
    store.commit(_request(job_id, claimed.seq, 0, reference.encode()))

    # when the API reads the text so far at that commit
    text = read_text_so_far(ReadModel(store), job_id, 1, objects)

    # then it reads the header from the object, not the reference in Redis
    assert text is not None and (text.text, text.generated) == ("Quantum bits", 2)


def test_batched_jobs_resumed_from_their_objects_at_every_step_apply_each_step_once(
    offloading_env: dict[str, str], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from tasks.batches import execute_batch
    from tasks.dispatch import new_batch_id

    # given two batchable jobs, every checkpoint offloaded (threshold 0)
    monkeypatch.setenv("STEPLINE_ARTIFACTS__CHECKPOINT_OFFLOAD_BYTES", "0")
    current_settings.cache_clear()
    store = JobStore(redis_client)
    service = JobService(store, current_settings())
    jobs = sorted(service.submit(JobSpec(
        kind="simulated", slo=SloClass.INTERACTIVE, deadline_s=600,
        params={"steps": 4, "step_ms": 1, "batch_growth": 0.2}))[0] for _ in range(2))
    objects, batch_id = _objects(), new_batch_id(jobs[0])

    # when each step runs as one batch on a new worker (nothing held in memory)
    for step in range(4):
        members = [(job_id, step, store.record(job_id).epoch) for job_id in jobs]
        outcome = execute_batch(_worker(store, f"w{step}"), batch_id, members)
        if step < 3:
            # then between steps Redis holds references, each job one object
            assert outcome == "hop,hop"
            for job_id in jobs:
                stored = store.load_checkpoint(job_id)
                assert stored is not None and is_reference(stored)
                assert len(_object_names(objects, job_id)) == 1

    # then both jobs applied every step once, and their objects went with them
    for job_id in jobs:
        record = store.record(job_id)
        assert record.state is JobState.DONE
        assert json.loads(objects.artifacts.read(str(record.artifact)))["applied"] == [0, 1, 2, 3]
        assert _object_names(objects, job_id) == []
