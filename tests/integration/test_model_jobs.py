"""Real diffusers and transformers jobs on real worker processes: a job stopped on one worker
(preempted, or its worker SIGKILLed) and finished on another gives the uninterrupted output."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.dispatch import release
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService, validate_params
from tests.conftest import Processes, preempt_after, wait_for, wait_for_workers
from workers.kinds import RunnerOptions, get_runner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

IMAGE = {"model": "dit-tiny", "class_label": 3, "num_inference_steps": 30, "seed": 5,
         "scheduler": "dpmpp_2m", "height": 32, "width": 32}
VIDEO = {"prompt": "a red fox running", "num_inference_steps": 24, "seed": 9,
         "scheduler": "unipc"}
TEXT = {"inputs": "Explain quantum computing in simple terms", "max_new_tokens": 40,
        "chunk_tokens": 2, "routing": "native", "model": "qwen3-moe-tiny"}


def uninterrupted_artifact(kind: str, params: dict[str, Any]) -> bytes:
    """The job run start to end in this process, no checkpoint ever leaving memory."""
    params = validate_params(kind, params)
    runner = get_runner(kind, RunnerOptions(block_groups=current_settings().diffusion.block_groups))
    if kind == "text":
        from tasks.settings.moe import cache_config, router_config
        from workers import moe

        moe_settings = current_settings().moe
        runner = moe.get_runner(router_config(moe_settings), cache_config(moe_settings, "cpu"))
    plan, state, result = runner.plan(params), None, None
    for index in range(plan.num_chunks):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = result.state
    assert result is not None and result.artifact is not None
    return result.artifact.data


def _artifact(store: JobStore, job_id: str) -> bytes:
    record = store.record(job_id)
    return (current_settings().artifacts_path / str(record.artifact)).read_bytes()


def _comparable(kind: str, data: bytes) -> Any:
    if kind != "text":
        return data
    return json.loads(data)["output"]  # metrics carry wall-clock latency


def _progress(store: JobStore, job_id: str) -> int:
    return int(store.fields(job_id)["next_chunk"])


@pytest.mark.parametrize(("kind", "params"), [("image", IMAGE), ("text", TEXT)])
def test_a_preempted_job_resumed_on_another_worker_matches_the_uninterrupted_run(
    processes: Processes, redis_client: redis.Redis, kind: str, params: dict[str, Any]
) -> None:
    processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    job_id, _ = service.submit(JobSpec(kind=kind, slo=SloClass.BATCH, params=params,  # type: ignore[arg-type]
                                       deadline_s=600))

    preempt_after(store, job_id, 3, timeout_s=60)
    processes.kill("w1")
    processes.worker("w2")
    wait_for_workers(redis_client, ["w2"])
    release(store, store.record(job_id), queue="batch", by="test", reason="resume elsewhere")

    wait_for(lambda: store.state(job_id) is JobState.DONE, 90, "the job to finish on w2")
    runs_on = {e["by"] for e in store.events(job_id) if e["kind"] == "commit"}
    assert runs_on == {"w1@test", "w2@test"}
    assert store.record(job_id).preemptions == 1
    assert _comparable(kind, _artifact(store, job_id)) == _comparable(
        kind, uninterrupted_artifact(kind, params))


def test_a_video_job_whose_worker_is_sigkilled_mid_step_matches_the_uninterrupted_run(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    job_id, _ = service.submit(JobSpec(kind="video", slo=SloClass.BATCH, params=VIDEO,
                                       deadline_s=600))

    wait_for(lambda: _progress(store, job_id) >= 4, 60, "four chunks to run on w1")
    processes.kill("w1")
    processes.worker("w2")

    wait_for(lambda: store.state(job_id) is JobState.DONE, 120, "the job to finish on w2")
    commits = [e for e in store.events(job_id) if e["kind"] == "commit"]
    assert {e["by"] for e in commits} == {"w1@test", "w2@test"}
    assert _artifact(store, job_id) == uninterrupted_artifact("video", VIDEO)
