"""The API's event loop never stalls: a fresh API process (its own uvicorn, as ``stepline up``
runs it) answers ``/healthz`` while its first text, image and video requests are in flight.
Real Redis, a real worker process, HTTP from separate threads.

On a machine shared with other work a poll can wait for a core whatever the API does, so no
answer is held to a time. It is held against a control: a minimal uvicorn app pinging the same
Redis, polled at the same pace by a probe of its own. A stalled event loop shows as an answer
of the API during which the control answered many polls; a lone API poll that waited for a core
waits with the control's polls too (before the fix one stall lasted seconds: 25-32 s, hundreds
of the control's polls). The answers' times (the API's latency and its excess over the
control's) are printed, not asserted."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from app.api.server import api_command
from app.embedded_redis import EmbeddedRedis
from tasks.settings import load_settings
from tests.conftest import PY, Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEY = "loop-key-0123456789ab"
POLL_S = 0.02
"""The pause between one probe's polls (both probes, the API's and the control's)."""
STALL_POLLS = 50
"""The most control polls answered while one API answer waited: a stall of the event loop as
long as 50 of the control's polls (about a second on a quiet machine) fails the test."""
NOISE_WINDOW_S = 1.0
"""A control answer this close in time to an API answer measures the same moment's noise."""
MIN_POLLS = 40
"""Fewer polls than this would say nothing about a stall of a few hundred milliseconds."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class FreshApi:
    url: str
    control_url: str


@pytest.fixture()
def fresh_api(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[FreshApi]:
    """A worker that is ready, and an API process that has served nothing yet."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    config = tmp_path / "api.yaml"
    config.write_text(yaml.safe_dump({
        "service": {"api_port": _free_port()},
        "api": {"keys": [{"key": KEY, "tenant": "acme", "rate_limit_per_s": 1000,
                          "burst": 1000}]},
    }))
    env = {"REDIS_URL": redis_server.url, "STEPLINE_RUN_DIR": str(tmp_path / "run"),
           "STEPLINE_CONFIG": str(config), "STEPLINE_BROKER__CHUNK_LEASE": "1.5"}
    settings = load_settings(config_file=config)
    procs = Processes(env, tmp_path / "logs")
    try:
        procs.worker("w1")
        wait_for_workers(client, ["w1"], timeout_s=180)
        control_port = _free_port()
        procs.start("control", [PY, "-m", "uvicorn", "--factory",
                                "tests.e2e.control_api:create_app", "--port", str(control_port),
                                "--log-level", "warning", "--no-access-log"])
        procs.start("api", api_command(settings))
        url, control = (f"http://127.0.0.1:{port}"
                        for port in (settings.service.api_port, control_port))
        wait_for(lambda: _answers(url) and _answers(control), 300, "the APIs to answer")
        yield FreshApi(url, control)
    finally:
        procs.stop_all()
        client.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class HealthProbe:
    """Reads ``/healthz`` of the API and of the control, each from a thread of its own over its
    own keep-alive connection, every ``POLL_S`` until stopped; keeps when each poll began and
    ended."""

    def __init__(self, api: FreshApi) -> None:
        self.urls = {"api": api.url, "control": api.control_url}
        self.polls: dict[str, list[tuple[float, float]]] = {name: [] for name in self.urls}
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(name,), daemon=True,
                                         name=f"healthz-probe-{name}") for name in self.urls]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout=timeout)

    def _run(self, name: str) -> None:
        with httpx.Client(base_url=self.urls[name], timeout=60) as http:
            while not self.stop.wait(POLL_S):
                started = time.perf_counter()
                try:
                    response = http.get("/healthz")
                    if response.status_code != 200:
                        self.failures.append(f"{name}: {response.status_code} {response.text}")
                except httpx.HTTPError as exc:  # a timeout is a wait too: keep it
                    self.failures.append(f"{name}: {exc!r}")
                finally:
                    self.polls[name].append((started, time.perf_counter()))

    def control_polls_during_api(self) -> list[int]:
        """Per API answer, how many control polls began and ended while it waited."""
        control = list(self.polls["control"])
        return [sum(1 for c_start, c_end in control if start <= c_start and c_end <= end)
                for start, end in self.polls["api"]]

    def excess_over_control_s(self) -> list[float]:
        """Per API answer, its latency minus the slowest control answer polled within
        ``NOISE_WINDOW_S`` of it (printed, not asserted)."""
        control = [(start, end - start) for start, end in self.polls["control"]]
        return [end - start - max([s for t, s in control if abs(t - start) <= NOISE_WINDOW_S],
                                  default=0.0)
                for start, end in self.polls["api"]]

    def summary_ms(self, name: str) -> dict[str, float | int]:
        latencies_ms = sorted((end - start) * 1000 for start, end in self.polls[name])
        return {"polls": len(latencies_ms), "max_ms": round(latencies_ms[-1], 1),
                "p50_ms": round(latencies_ms[len(latencies_ms) // 2], 1),
                "p99_ms": round(latencies_ms[int(len(latencies_ms) * 0.99)], 1)}


def _chat(http: httpx.Client) -> str:
    body = {"model": "mixtral-tiny", "max_tokens": 4, "stream": True, "seed": 1,
            "messages": [{"role": "user", "content": "hello"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    return "chat"


def _completion(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json={"model": "olmoe-tiny", "prompt": "hi",
                                                   "max_tokens": 3, "seed": 2})
    assert response.status_code == 200, response.text
    return "completion"


def _image(http: httpx.Client) -> str:
    response = http.post("/v1/images/generations", json={
        "model": "pixart-tiny", "prompt": "a red square", "size": "32x32",
        "response_format": "b64_json", "stepline": {"params": {"num_inference_steps": 2}}})
    assert response.status_code == 200, response.text
    return "image"


def _video(http: httpx.Client) -> str:
    created = http.post("/v1/jobs", json={"kind": "video", "slo": "interactive", "params": {
        "prompt": "a fox", "num_inference_steps": 2, "seed": 3}})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "DONE", 120,
             "the video job")
    return "video"


def test_healthz_never_stalls_while_a_fresh_apis_first_requests_are_in_flight(
    fresh_api: FreshApi,
) -> None:
    # given a fresh API process, a control beside it, and a probe reading both
    probe = HealthProbe(fresh_api)
    probe.start()
    requests: list[Callable[[httpx.Client], str]] = [_chat, _completion, _image, _video]

    # when its first chat, completion, image and video requests run at once
    with httpx.Client(base_url=fresh_api.url, headers={"X-API-Key": KEY}, timeout=120) as http, \
            ThreadPoolExecutor(len(requests)) as pool:
        done = [future.result() for future in [pool.submit(r, http) for r in requests]]
    probe.stop.set()
    probe.join(timeout=35)

    # then every request was served and no /healthz answer of the API waited while the
    # control answered many polls
    api, control = probe.summary_ms("api"), probe.summary_ms("control")
    during = sorted(probe.control_polls_during_api())
    excesses = sorted(probe.excess_over_control_s())
    print("healthz during the first requests:", json.dumps(
        {"api": api, "control": control, "max_control_polls_during_one": during[-1],
         "p95_control_polls_during_one": during[int(0.95 * (len(during) - 1))],
         "max_excess_ms": round(excesses[-1] * 1000, 1),
         "p95_excess_ms": round(excesses[int(0.95 * (len(excesses) - 1))] * 1000, 1)}))
    assert done == ["chat", "completion", "image", "video"]
    assert not probe.failures, probe.failures[:5]
    assert api["polls"] >= MIN_POLLS and control["polls"] >= MIN_POLLS
    assert during[-1] <= STALL_POLLS, (api, control, during[-5:])
