"""Stochastic and second-order samplers on real worker processes: jobs whose worker is SIGKILLed
mid-job finish on another worker process with exactly the uninterrupted output."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService, validate_params
from tests.conftest import Processes, wait_for, wait_for_workers
from workers.kinds import RunnerOptions, get_runner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOBS: list[tuple[str, dict[str, Any]]] = [
    # second order (2N-1 chunks), its noise from a Brownian tree seeded by the job and rebuilt in
    # the new process
    ("image", {"model": "pixart-tiny", "prompt": "a lighthouse", "scheduler": "dpmpp_sde",
               "num_inference_steps": 8, "seed": 21, "height": 24, "width": 40}),
    # DiT's scheduler step draws from the job's generator, restored from the checkpoint, not from
    # the worker's global RNG
    ("image", {"model": "dit-tiny", "class_label": 7, "scheduler": "dpmpp_2m_sde",
               "num_inference_steps": 16, "seed": 23}),
]


def uninterrupted_artifact(kind: str, params: dict[str, Any]) -> bytes:
    """The job start to end in this process, no checkpoint ever leaving memory."""
    params = validate_params(kind, params)
    runner = get_runner(kind, RunnerOptions(block_groups=current_settings().diffusion.block_groups))
    state, result = None, None
    for index in range(runner.plan(params).num_chunks):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = result.state
    assert result is not None and result.artifact is not None
    return result.artifact.data


def _progressed(store: JobStore, job_id: str, chunks: int) -> bool:
    return int(store.fields(job_id)["next_chunk"]) >= chunks


def _done(store: JobStore, job_id: str) -> bool:
    return store.state(job_id) is JobState.DONE


def test_sigkilled_sampler_jobs_finish_on_another_worker_with_the_uninterrupted_output(
    processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    for number, (kind, params) in enumerate(JOBS, start=1):
        # given a job of a stochastic sampler running on worker w<number>
        job_id, _ = service.submit(JobSpec(kind=kind, slo=SloClass.BATCH,  # type: ignore[arg-type]
                                           params=params, deadline_s=600))
        wait_for(functools.partial(_progressed, store, job_id, 3), 60, "three chunks to commit")
        # when that worker is SIGKILLed mid-job and a fresh worker process takes over
        processes.kill(f"w{number}")
        processes.worker(f"w{number + 1}")
        wait_for(functools.partial(_done, store, job_id), 120, "the job to finish")
        # then it ran on both, and its output is byte-identical to the uninterrupted run
        commits = {e["by"] for e in store.events(job_id) if e["kind"] == "commit"}
        assert commits == {f"w{number}@test", f"w{number + 1}@test"}, params["scheduler"]
        artifact = current_settings().artifacts_path / str(store.record(job_id).artifact)
        assert artifact.read_bytes() == uninterrupted_artifact(kind, params), params["scheduler"]
