"""Expert affinity on real workers: a text job's chunks stay on the worker that holds its experts
and checkpoint; a chunk parked behind a busy worker moves to its class queue within max_wait."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers
from tests.integration.test_model_jobs import uninterrupted_artifact

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "qwen3-moe-tiny"
TEXT = {"inputs": "Explain quantum computing in simple terms", "max_new_tokens": 25,
        "chunk_tokens": 2, "routing": "native", "model": MODEL}


def _commits(store: JobStore, job_id: str) -> list[dict[str, str]]:
    return [e for e in store.events(job_id) if e["kind"] == "commit"]


def _heartbeat(client: redis.Redis, worker: str) -> dict[str, Any]:
    raw = client.get(keys.WORKER_PREFIX + worker)
    assert raw is not None
    return dict(json.loads(raw))


def _output(store: JobStore, job_id: str) -> dict[str, Any]:
    record = store.record(job_id)
    return dict(json.loads((current_settings().artifacts_path / str(record.artifact)).read_bytes()))


def test_a_text_jobs_chunks_all_run_on_one_worker_while_another_is_idle(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    processes.worker("w2")
    wait_for_workers(redis_client, ["w1", "w2"])
    service = JobService(JobStore(redis_client), current_settings())
    queues = _heartbeat(redis_client, "w1@test")["queues"]
    assert queues == ["realtime", "w1@test.interactive", "w1@test.interactive.placed",
                      "interactive", "w1@test.batch", "w1@test.batch.placed", "batch",
                      "w1@test.standby", "standby"]

    job_id, _ = service.submit(JobSpec(kind="text", slo=SloClass.INTERACTIVE, params=TEXT,
                                       deadline_s=300))

    wait_for(lambda: service.store.state(job_id) is JobState.DONE, 60, "the text job")
    commits = _commits(service.store, job_id)
    assert len(commits) == 13  # prefill + 12 decode chunks
    (worker,) = {e["by"] for e in commits}
    beat = wait_for(lambda: (b := _heartbeat(redis_client, worker))["ckpt_cache"]["hits"] >= 12
                    and b, 30, "the heartbeat to report the checkpoint-cache hits")
    assert isinstance(beat, dict) and beat["ckpt_cache"]["misses"] == 0
    assert beat["ckpt_cache"]["hit_rate"] == 1.0
    assert "qwen3-moe-tiny" in beat["experts"]
    metrics = _output(service.store, job_id)["metrics"]
    assert metrics["cache"]["hits"] > 0 and metrics["cache"]["hit_rate"] > 0.9
    assert _output(service.store, job_id)["output"] == json.loads(
        uninterrupted_artifact("text", TEXT))["output"]


def test_a_chunk_parked_behind_a_busy_worker_moves_to_its_class_queue_and_finishes_elsewhere(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.env["STEPLINE_SCHEDULER__RESOURCE_RESERVE_RATIO"] = "0"  # no worker held back
    # Room in flight for all three jobs, so none is sent to standby: the scenario is the
    # parked chunk, not the policy's choice of which job waits.
    processes.env["STEPLINE_SCHEDULER__SLOTS_PER_WORKER"] = "2"
    processes.worker("w1")
    processes.worker("w2")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    params = {**TEXT, "max_new_tokens": 201}
    text, _ = service.submit(JobSpec(kind="text", slo=SloClass.INTERACTIVE, params=params,
                                     deadline_s=300))
    wait_for(lambda: int(store.fields(text)["next_chunk"]) >= 2, 60, "the text job to start")
    first = _commits(store, text)[0]["by"]

    # Two realtime jobs: the idle worker takes the short one at once, the text job's worker
    # the long one right after its current chunk, parking the text job's next chunk. The short
    # one outlasts any text chunk on a busy machine, so the idle worker cannot take both. (Both
    # stay under the tests' 4 s visibility timeout, past which a message is redelivered.)
    short, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.REALTIME, deadline_s=60,
                                      params={"steps": 1, "step_ms": 1500}))
    long, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.REALTIME, deadline_s=60,
                                     params={"steps": 1, "step_ms": 3000}))

    wait_for(lambda: store.state(text) is JobState.DONE, 60, "the text job to finish")
    wait_for(lambda: store.state(long) is JobState.DONE, 30, "the long realtime job to finish")
    # Every time the text job's chunk was parked on its worker's own queue, it started within
    # max_wait (+ a tick + slack): claimed there, or moved to its class queue by the tick and
    # claimed by whichever worker was free. (Which worker runs what depends on timing and on
    # the policy's order; the bound on a parked chunk's wait does not.)
    events = store.events(text)
    max_wait_s = current_settings().affinity.max_wait
    for k, event in enumerate(events):
        if event.get("to") == "QUEUED" and " on w" in event.get("reason", "") \
                and "@test." in event.get("reason", ""):
            started = next(e for e in events[k + 1:] if e.get("to") == "RUNNING"
                           or e.get("reason", "").startswith("affinity: "))
            assert float(started["ts"]) - float(event["ts"]) <= max_wait_s + 0.1 + 0.25
    moves = [e for e in events if e.get("reason", "").startswith(f"affinity: {first} busy")]
    if moves:  # the moved chunk ran on the other worker, or on its own once that one was free
        after = next(e for e in events[events.index(moves[0]) + 1:] if e.get("to") == "RUNNING")
        # (with both workers busy when it moved, the first to free up takes it: its own worker
        # only after finishing the realtime chunk it was parked behind)
        freed = [float(e["ts"]) for job in (short, long) for e in _commits(store, job)
                 if e["by"] == first]
        assert after["by"] != first or any(ts <= float(after["ts"]) for ts in freed)
    assert store.state(short) is JobState.DONE
    assert _output(store, text)["output"] == json.loads(
        uninterrupted_artifact("text", params))["output"]


def _resident_experts(beat: dict[str, Any], model: str) -> int | None:
    """How many experts the heartbeat says ``model`` holds on the device, over all layers; None
    while it names no such model (a heartbeat written before the model's first chunk ran)."""
    if model not in beat["experts"]:
        return None
    masks = beat["experts"][model]["resident"].values()
    return sum(bin(int(mask, 16)).count("1") for mask in masks)


def test_a_worker_that_gets_no_more_text_work_unloads_its_experts_after_the_idle_time(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given a worker whose experts unload after 2 s idle, that ran one text job
    processes.worker("w1", extra_env={"STEPLINE_MOE__CACHE__IDLE_UNLOAD": "2s"})
    wait_for_workers(redis_client, ["w1"])
    service = JobService(JobStore(redis_client), current_settings())
    job_id, _ = service.submit(JobSpec(kind="text", slo=SloClass.INTERACTIVE, params=TEXT,
                                       deadline_s=300))
    wait_for(lambda: service.store.state(job_id) is JobState.DONE, 60, "the text job")
    assert _output(service.store, job_id)["metrics"]["cache"]["hits"] > 0  # it held experts

    # when it gets no text work for longer than the idle time
    # then its heartbeat soon says the model holds no expert on the device
    wait_for(lambda: _resident_experts(_heartbeat(redis_client, "w1@test"), MODEL) == 0, 30,
             "the idle worker to unload its experts")


IMAGE = {"model": "dit-tiny", "class_label": 3, "num_inference_steps": 6, "seed": 5,
         "height": 32, "width": 32}


def _holds(client: redis.Redis, worker: str, model: str) -> bool:
    device = _heartbeat(client, worker).get("residency", {}).get("device", {})
    return any(key.startswith(f"diffusion:{model}:") for key in device)


def _finished_and_first_released_to(store: JobStore, job_id: str) -> str:
    """Once the job is DONE, the reason its first release gave (which queue it went to)."""
    wait_for(lambda: store.state(job_id) is JobState.DONE, 60, "the image job")
    released = [e for e in store.events(job_id)
                if e["kind"] == "state" and e["to"] == JobState.QUEUED.value]
    return released[0]["reason"]


def test_an_image_job_is_released_to_the_idle_worker_that_holds_its_model(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given two idle workers: w1 warmed (it built every recipe), w2 cold (it holds no model)
    processes.worker("w1", extra_env={"STEPLINE_WARM_START": "true"})
    processes.worker("w2")
    wait_for_workers(redis_client, ["w1", "w2"])
    wait_for(lambda: _holds(redis_client, "w1@test", "dit-tiny"), 90, "w1 to hold dit-tiny")
    assert not _holds(redis_client, "w2@test", "dit-tiny")
    service = JobService(JobStore(redis_client), current_settings())

    # when an image job of that model is submitted (admitted: released at once, no tick)
    job_id, _ = service.submit(JobSpec(kind="image", slo=SloClass.INTERACTIVE, params=IMAGE,
                                       deadline_s=120))

    # then its release went to w1's own queue, and w1 ran its first step without a load
    assert _finished_and_first_released_to(service.store, job_id) == \
        "admitted to w1@test.interactive.placed"
    assert _commits(service.store, job_id)[0]["by"] == "w1@test"


def test_with_no_warm_worker_an_image_job_goes_to_its_class_queue_under_route_to_warm(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given one idle worker that holds no model, and route-to-warm placement
    processes.worker("w2")
    wait_for_workers(redis_client, ["w2"])
    settings = current_settings()
    warm = settings.model_copy(update={"affinity": settings.affinity.model_copy(
        update={"placement": "warm"})})
    service = JobService(JobStore(redis_client), warm)
    # when an image job is submitted, then it is released to its class queue (any worker)
    job_id, _ = service.submit(JobSpec(kind="image", slo=SloClass.INTERACTIVE, params=IMAGE,
                                       deadline_s=120))
    assert _finished_and_first_released_to(service.store, job_id) == "admitted to interactive"
