"""Degradation before shedding on the live submit path (a real redis-server): under a published
overload a job that gave a quality floor is stored at fewer steps, says so in its first event
and its record, and is exactly the job submitted at those steps; a job without a floor is
stored as asked."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import redis

from app.schemas import JobSpec
from scheduler import AdmissionState, AdmissionStatus, ClusterSnapshot, PolicyState, plan_tick
from tasks.adapter import LiveTarget, policy_config
from tasks.errors import InvalidJob, Overloaded
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService, prepare_submits, validate_params

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _service_under_load(redis_client: redis.Redis, load: float) -> JobService:
    """The submit path, after a tick published ``load`` as its admission status."""
    settings = current_settings()
    store = JobStore(redis_client)
    store.set_policy("stepline")
    policy = policy_config(settings, store)
    status = AdmissionStatus(AdmissionState.CONVERGING if load > policy.convergence_threshold
                             else AdmissionState.OPEN, load, 1.0, time.time())
    empty = ClusterSnapshot((), (), policy.new_cost_model(), PolicyState())
    LiveTarget(store, {}, settings).publish_decisions(
        replace(plan_tick(empty, policy, status.measured_at_s), admission=status))
    return JobService(store, settings)


def _simulated(floor: int | None) -> JobSpec:
    return JobSpec(kind="simulated", slo="interactive", deadline_s=30.0,
                   quality_floor=None if floor is None else {"min_steps": floor},
                   params={"steps": 40, "step_ms": 1000.0})


def test_under_overload_a_job_with_a_floor_runs_fewer_steps_and_says_why(
        stack_env: dict[str, str], redis_client: redis.Redis) -> None:
    # given a published load of 1.4 (past degrade_load) and a 40 s job due in 30 s
    service = _service_under_load(redis_client, 1.4)
    # when it is submitted with a floor of 5 steps, and again without a floor
    degraded_id, _ = service.submit(_simulated(5))
    plain_id, _ = service.submit(_simulated(None))
    # then the first is stored at fewer steps, at least its floor, with the reason
    record = service.store.record(degraded_id)
    chosen = json.loads(record.degraded or "{}")
    assert 5 <= chosen["steps"] < 40 == chosen["full_steps"]
    assert record.params["steps"] == chosen["steps"] == record.num_chunks
    first = service.store.events(degraded_id)[0]
    assert "degraded to" in first["reason"] and first["reason"] == "accepted; " + chosen["reason"]
    # and the job without a floor is stored as asked
    plain = service.store.record(plain_id)
    assert plain.degraded is None and plain.num_chunks == 40
    assert service.store.events(plain_id)[0]["reason"] == "accepted"


def test_past_the_shed_load_a_job_a_lower_level_saves_is_admitted_and_the_rest_are_shed(
        stack_env: dict[str, str], redis_client: redis.Redis) -> None:
    # given a published load of 1.6, past interactive work's shed load (1.5)
    service = _service_under_load(redis_client, 1.6)
    # when a 40 s job due in 30 s is submitted with a floor of 1 step (the prediction, 20 x its
    # work at this load, fits one step in 30 s), of 30 steps (it fits none), and without one
    saved_id, _ = service.submit(_simulated(1))
    # then the first runs degraded, saying why, where it would have been shed
    record = service.store.record(saved_id)
    assert json.loads(record.degraded or "{}")["meets"] is True and record.num_chunks == 1
    # and the others are refused with the overload's reason: shedding stays the last resort
    for floor in (30, None):
        with pytest.raises(Overloaded, match="overloaded"):
            service.submit(_simulated(floor))


def test_below_the_degrade_load_a_job_with_a_floor_runs_as_asked(
        stack_env: dict[str, str], redis_client: redis.Redis) -> None:
    # given a published load of 0.9: busy, not past degrade_load
    service = _service_under_load(redis_client, 0.9)
    # when a late-looking job with a floor is submitted
    job_id, _ = service.submit(_simulated(5))
    # then it keeps its steps
    record = service.store.record(job_id)
    assert record.degraded is None and record.num_chunks == 40


def test_a_degraded_image_job_is_exactly_the_job_asked_at_those_steps(
        stack_env: dict[str, str], redis_client: redis.Redis) -> None:
    # given overload and an image job with a floor of 2 of its 8 steps, due almost at once (its
    # kind loaded first, as in a warm API process: the status is fresh for 2 s only)
    asked = {"model": "dit-tiny", "class_label": 207, "num_inference_steps": 8, "seed": 3}
    prepare_submits([("image", asked)])
    service = _service_under_load(redis_client, 1.4)
    spec = JobSpec(kind="image", slo="interactive", deadline_s=0.05,
                   quality_floor={"min_steps": 2}, params=asked)
    # when it is submitted
    job_id, _ = service.submit(spec)
    record = service.store.record(job_id)
    steps = json.loads(record.degraded or "{}")["steps"]
    # then its stored params are those of the same job asked at that many steps: the runner
    # cannot tell them apart, so its output is the library's at that level
    assert steps == 2
    assert record.params == validate_params("image", {**asked, "num_inference_steps": steps})


@pytest.mark.parametrize(("spec", "problem"), [
    (JobSpec(kind="simulated", quality_floor={"min_steps": 50}, params={"steps": 40}),
     "quality_floor.min_steps=50 is more than the job's steps=40"),
    (JobSpec(kind="text", quality_floor={"min_steps": 2},
             params={"model": "qwen3-moe-tiny", "prompt": "hi", "max_new_tokens": 4}),
     "quality_floor applies to image, video, simulated jobs, not text"),
])
def test_a_floor_that_cannot_apply_is_refused_naming_the_problem(
        stack_env: dict[str, str], redis_client: redis.Redis, spec: JobSpec,
        problem: str) -> None:
    # given the submit path
    service = _service_under_load(redis_client, 0.2)
    # when a job's floor cannot apply, then it is refused with what to fix, and nothing stored
    with pytest.raises(InvalidJob, match=problem):
        service.submit(spec)
    assert redis_client.zcard("sl:jobs:index") == 0
