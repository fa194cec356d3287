"""Warm start: a worker runs a tiny job of every recipe before it takes work, and /readyz says
when every worker has; /healthz stays liveness. Real Redis, a real worker, uvicorn over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import redis

from app.api.server import ThreadedServer
from tasks import keys
from tasks.settings import load_settings
from tests.conftest import Processes, wait_for
from workers.registry import default_registry

# The warm-up builds six tiny models and runs each once: about a minute on a shared CPU.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture()
def api(stack_env: dict[str, str]) -> Iterator[str]:
    with ThreadedServer(load_settings(warm_start=True)) as server:  # the API warms up too
        yield server.url


def test_readyz_says_warming_until_the_worker_ran_every_recipes_warm_up_then_ready(
    api: str, processes: Processes, redis_client: redis.Redis,
) -> None:
    # given no worker yet: alive, not ready
    assert httpx.get(f"{api}/healthz").status_code == 200
    none = httpx.get(f"{api}/readyz")
    assert (none.status_code, none.json()["status"]) == (503, "no_workers")
    # when a worker with warm start comes up
    processes.worker("w1", extra_env={"STEPLINE_WARM_START": "true"})
    wait_for(lambda: redis_client.exists(keys.WORKER_PREFIX + "w1@test"), 120, "w1 to advertise")
    # then it is alive and warming, until it reports every recipe warm
    warming = httpx.get(f"{api}/readyz")
    assert (warming.status_code, warming.json()["status"]) == (503, "warming")
    wait_for(lambda: httpx.get(f"{api}/readyz").status_code == 200, 500, "w1 to be warm")
    ready = httpx.get(f"{api}/readyz").json()
    assert ready["status"] == "ready" and ready["api_warm"] is True
    assert sorted(ready["workers"]["w1@test"]["warmed"]) == sorted(default_registry().names())
    beat = json.loads(redis_client.get(keys.WORKER_PREFIX + "w1@test") or b"{}")
    assert beat["warm"] is True


def test_a_worker_without_warm_start_is_ready_at_once(
    api: str, processes: Processes, redis_client: redis.Redis,
) -> None:
    processes.worker("w1")  # the test environment's default: warm_start false
    wait_for(lambda: httpx.get(f"{api}/readyz").status_code == 200, 300, "w1 to be ready")
    assert httpx.get(f"{api}/readyz").json()["workers"]["w1@test"] == {"warm": True,
                                                                       "warmed": []}
