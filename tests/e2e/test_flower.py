"""Flower, as ``stepline up`` starts it, shows the workers and each job's chunk tasks."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import redis

from app.schemas import JobSpec
from app.stack import flower_command, flower_credentials
from scheduler.lifecycle import JobState
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, auth: tuple[str, str]) -> Any:
    try:
        response = httpx.get(url, auth=auth, timeout=5)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def test_flower_lists_the_workers_and_the_jobs_chunk_tasks_behind_basic_auth(
    processes: Processes, redis_client: redis.Redis, tmp_path: Any
) -> None:
    # given real workers and Flower started as the stack starts it
    settings = current_settings().model_copy(deep=True)
    settings.service.flower_port = free_port()
    login = flower_credentials(settings, tmp_path)
    assert (tmp_path / "flower-auth").stat().st_mode & 0o777 == 0o600
    user, password = login.split(":", 1)
    processes.start("flower", flower_command(settings), {"FLOWER_BASIC_AUTH": login})
    processes.worker("w1")
    base = f"http://127.0.0.1:{settings.service.flower_port}"
    wait_for_workers(redis_client, ["w1"])
    wait_for(lambda: _get(base + "/api/workers?refresh=1", (user, password)), 30,
             "Flower to answer with the workers")

    # when a job runs to completion
    service = JobService(JobStore(redis_client), current_settings())
    job_id, _ = service.submit(JobSpec(kind="simulated", slo="realtime",  # type: ignore[arg-type]
                                       params={"steps": 4, "step_ms": 5}, deadline_s=60))
    wait_for(lambda: service.store.state(job_id) is JobState.DONE, 30, "the job to finish")

    # then Flower's REST API shows the worker, and each chunk with its job, name and class
    def chunk_tasks() -> dict[str, Any]:
        tasks = _get(base + "/api/tasks", (user, password)) or {}
        done = {k: v for k, v in tasks.items()
                if k.startswith(job_id + ".") and v.get("state") == "SUCCESS"}
        return done if len(done) == 4 else {}

    tasks = wait_for(chunk_tasks, 30, "Flower to record the job's 4 chunk tasks")
    assert isinstance(tasks, dict)
    assert sorted(int(task_id.split(".")[1]) for task_id in tasks) == [0, 1, 2, 3]
    for task in tasks.values():
        assert task["name"] == "stepline.chunk"
        assert task["worker"] == "w1@test"
        assert "'slo': 'realtime'" in task["kwargs"] and "chunk_name" in task["kwargs"]
    workers = _get(base + "/api/workers", (user, password))
    assert "w1@test" in workers
    assert httpx.get(base + "/api/workers", timeout=5).status_code == 401
    assert httpx.get(base + "/api/workers", auth=(user, "wrong"), timeout=5).status_code == 401
