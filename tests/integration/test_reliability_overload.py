"""Overload: a bounded burst of 1000 submissions/s at the API while the workers are busy. The API
stays responsive, realtime jobs keep their SLO, batch degrades by 429, memory stays bounded,
the burst stops by itself, and every accepted job still finishes."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from app.api.server import api_command
from app.drills.faults import MemorySampler, api_burst
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.settings import load_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLOOD_KEY, RT_KEY = "flood-key-0123456789ab", "realtime-key-0123456789"
BURST_RATE_PER_S, BURST_S = 1000, 3.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "overload.yaml"
    path.write_text(yaml.safe_dump({
        "service": {"api_port": _free_port()},
        "api": {"keys": [
            {"key": FLOOD_KEY, "tenant": "flood", "rate_limit_per_s": 20, "burst": 40,
             "max_queued": 200},
            {"key": RT_KEY, "tenant": "rt", "tier": "gold", "rate_limit_per_s": 100,
             "burst": 100},
        ]},
    }))
    return path


class RealtimeProbe(threading.Thread):
    """Submits a small realtime job and reads /healthz every 250 ms until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="probe")
        self.url = url
        self.jobs: list[str] = []
        self.health_s: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"X-API-Key": RT_KEY}, timeout=10) as api:
            while not self.stop.wait(0.25):
                started = time.perf_counter()
                assert api.get("/healthz").status_code == 200
                self.health_s.append(time.perf_counter() - started)
                created = api.post("/v1/jobs", json={
                    "kind": "simulated", "slo": "realtime",
                    "params": {"steps": 2, "step_ms": 10}})
                assert created.status_code == 201, created.text
                self.jobs.append(created.json()["id"])


def test_a_burst_of_submissions_is_absorbed_with_realtime_kept_and_nothing_lost(
    processes: Processes, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # given the API as its own process, two workers busy with batch jobs, and the tick
    config = _config(tmp_path)
    settings = load_settings(config_file=config)
    url = f"http://127.0.0.1:{settings.service.api_port}"
    processes.start("api", api_command(settings), {"STEPLINE_CONFIG": str(config)})
    for name in ("w1", "w2"):
        processes.worker(name)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    wait_for(lambda: _healthy(url), 30, "the API to answer")
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    busy = [service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=600,
                                   params={"steps": 30, "step_ms": 50}))[0] for _ in range(4)]
    redis_pid = int(redis_client.info("server")["process_id"])

    # when a flood tenant offers 1000 submissions/s (32 in flight at most) for 3 s while a
    # realtime tenant keeps submitting
    probe = RealtimeProbe(url)
    with MemorySampler({"redis": redis_pid, "api": processes.procs["api"].pid}) as memory:
        probe.start()
        burst = api_burst(url, FLOOD_KEY, {"kind": "simulated", "slo": "batch",
                                           "params": {"steps": 1, "step_ms": 5}},
                          rate_per_s=BURST_RATE_PER_S, duration_s=BURST_S, concurrency=32)
        probe.stop.set()
        probe.join(timeout=15)
    report = {**burst.summary(), "memory": memory.summary_mb(),
              "health_max_ms": round(max(probe.health_s) * 1000, 1)}
    print("overload:", report)

    # then the burst stopped by itself, nothing failed server-side, and batch got 429s
    assert burst.duration_s < BURST_S + 12
    assert set(burst.statuses) <= {201, 429}, report
    assert burst.statuses[429] > 0 and burst.retry_after_missing == 0
    assert burst.errors == 0
    assert burst.percentile_s(0.99) is not None and burst.percentile_s(0.99) < 3.0, report
    assert max(probe.health_s) < 3.0, report
    for name, mem in report["memory"].items():
        assert mem["max_mb"] - mem["start_mb"] < 200, (name, mem)

    # and every accepted job finishes; realtime jobs by their deadline
    every = busy + probe.jobs + burst.accepted
    wait_for(lambda: all(store.state(j).is_terminal for j in every), 60, "every job to end")
    assert all(store.state(j) is JobState.DONE for j in every)
    met = sum(1 for j in probe.jobs if (r := store.record(j)).finished_at_s is not None
              and r.finished_at_s <= r.deadline_at_s)
    assert probe.jobs and met / len(probe.jobs) >= 0.9, (met, len(probe.jobs))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
