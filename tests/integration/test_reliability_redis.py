"""Redis goes away mid-run (SIGTERM, then SIGKILL) and comes back on the same socket and
append-only file: every accepted job survives and completes exactly, workers reconnect, and the
API answers 503 with Retry-After during the outage, never a stack trace."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.api.server import ThreadedServer
from app.drills.faults import audit_job, tolerant
from app.embedded_redis import EmbeddedRedis
from app.schemas import JobSpec
from scheduler.lifecycle import SloClass
from tasks.artifacts import ArtifactStore
from tasks.runtime import current_settings
from tasks.settings import load_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

KEY = "reliability-key-0123456789"


def _submit_mix(service: JobService) -> list[str]:
    mix = [(SloClass.BATCH, 24, 100.0, 2), (SloClass.BATCH, 24, 100.0, 1),
           (SloClass.INTERACTIVE, 8, 40.0, 1), (SloClass.REALTIME, 3, 10.0, 1)]
    return [service.submit(JobSpec(kind="simulated", slo=slo, deadline_s=600, params={
        "steps": steps, "step_ms": step_ms, "block_groups": groups}))[0]
        for slo, steps, step_ms, groups in mix]


def _assert_outage_answers(api: httpx.Client, job_id: str) -> None:
    """Every route that needs Redis answers 503 + Retry-After with a JSON reason."""
    for method, path, body in (("GET", f"/v1/jobs/{job_id}", None), ("GET", "/healthz", None),
                               ("POST", "/v1/jobs", {"kind": "simulated", "params": {}})):
        response = api.request(method, path, json=body)
        assert response.status_code == 503, (path, response.status_code, response.text)
        assert int(response.headers["Retry-After"]) >= 1
        assert "Redis" in response.json()["detail"]
        assert "Traceback" not in response.text


def _answers(server: EmbeddedRedis) -> bool:
    client = redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _outage(redis_server: EmbeddedRedis, client: redis.Redis, sig: int, api: httpx.Client,
            job_id: str) -> None:
    pid = int(client.info("server")["process_id"])
    try:
        os.kill(pid, sig)
        wait_for(lambda: not _answers(redis_server), 10, "redis-server to go away")
        _assert_outage_answers(api, job_id)
        time.sleep(1.0)  # workers, beat and scheduler retry meanwhile
    finally:
        redis_server.stop()  # reaps the old process
        redis_server.start()


def test_every_accepted_job_survives_redis_restarts_after_sigterm_and_sigkill(
    processes: Processes, redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    # given two workers, the tick, the API and a mix of jobs under way
    processes.worker("w1")
    processes.worker("w2")
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "w2", "scheduler"])
    settings = load_settings(api={"keys": [{"key": KEY, "tenant": "ops"}]})
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    with ThreadedServer(settings) as server, httpx.Client(
            base_url=server.url, headers={"X-API-Key": KEY}, timeout=10) as api:
        first = _submit_mix(service)
        wait_for(lambda: int(store.fields(first[0])["next_chunk"]) >= 4, 30, "progress")

        # when redis-server is stopped (SIGTERM) and restarted on the same socket and dir
        _outage(redis_server, redis_client, signal.SIGTERM, api, first[0])

        # then the API answers again, and jobs accepted before and after the restart finish
        wait_for(tolerant(lambda: api.get("/healthz").status_code == 200), 10, "the API")
        second = _submit_mix(service)
        wait_for(tolerant(lambda: int(store.fields(second[0])["next_chunk"]) >= 4), 30,
                 "progress after the first restart")

        # when redis-server is SIGKILLed (no shutdown: whatever the AOF holds is what survives)
        _outage(redis_server, redis_client, signal.SIGKILL, api, second[0])

        # then the same holds: every accepted job is DONE, each chunk applied exactly once
        third = _submit_mix(service)
        every = first + second + third
        wait_for(tolerant(lambda: all(store.state(j).is_terminal for j in every)), 90,
                 "every job to end")
    artifacts = ArtifactStore(current_settings().artifacts_path)
    for job_id in every:
        audit = audit_job(store, artifacts, job_id)
        assert audit.exact, audit.problem()
    assert all(processes.procs[n].poll() is None for n in ("w1", "w2", "scheduler", "beat"))


class _BlippingStore(JobStore):
    """The real store, except that Redis drops the connection once when a chunk checks its
    preempt flag between block groups (a blip the retries did not absorb)."""

    blips = 1

    def chunk_signals(self, job_id: str, ahead: Sequence[str] = ()) -> tuple[bool, str | None]:
        if self.blips:
            self.blips -= 1
            raise redis.ConnectionError("Connection closed by server.")
        return super().chunk_signals(job_id, ahead)


def test_a_redis_blip_inside_a_chunk_leaves_the_job_to_the_watchdog_instead_of_failing_it(
    stack_env: dict[str, str], redis_client: redis.Redis
) -> None:
    from tasks.chunks import execute_chunk
    from tasks.context import WorkerContext

    # given a job whose step has two block groups, claimed by a worker whose store blips
    settings = current_settings()
    store = _BlippingStore(redis_client)
    job_id, _ = JobService(store, settings).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, deadline_s=600,
        params={"steps": 2, "step_ms": 20, "block_groups": 2}))
    ctx = WorkerContext(settings=settings, store=store,
                        artifacts=ArtifactStore(settings.artifacts_path), name="w-blip")

    # when the blip hits between the block groups
    with pytest.raises(redis.ConnectionError):
        execute_chunk(ctx, job_id, 0, 0)

    # then the job is not FAILED: it is still RUNNING, for the lease watchdog to requeue
    fields = store.fields(job_id)
    assert (fields["state"], fields["next_chunk"], fields.get("error")) == ("RUNNING", "0", None)


def test_with_appendfsync_always_a_sigkilled_redis_keeps_every_acknowledged_write(
    tmp_path: Path,
) -> None:
    server = EmbeddedRedis(tmp_path / "strict", appendfsync="always")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        client.set("accepted", "1")
        os.kill(int(client.info("server")["process_id"]), signal.SIGKILL)
        client.close()
        server.stop()
        server.start()
        assert redis.Redis.from_url(server.url).get("accepted") == b"1"
    finally:
        server.stop()
