"""Broker and store through Redis Sentinel (one master, one replica, three sentinels, all on
loopback): a ``SENTINEL FAILOVER`` mid-run loses no job and applies no chunk twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.drills.faults import audit_job, tolerant
from app.schemas import JobSpec
from scheduler.lifecycle import SloClass
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.errors import RedisUnavailable
from tasks.runtime import current_settings, store_client
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, use_stack_env, wait_for
from tests.redis_ha import MASTER_NAME, SentinelGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture()
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup(tmp_path / "ha")
    group.start()
    yield group
    group.stop()


@pytest.fixture()
def ha_env(sentinel_group: SentinelGroup, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    yield from use_stack_env({"REDIS_URL": sentinel_group.url,
                              "STEPLINE_BROKER__SENTINEL_MASTER": MASTER_NAME,
                              "STEPLINE_BROKER__COMMIT_REPLICAS": "1"}, tmp_path, monkeypatch)
    current_settings.cache_clear()


def _submit(service: JobService, count: int) -> list[str]:
    return [service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=600,
                                   params={"steps": 10, "step_ms": 120}))[0]
            for _ in range(count)]


def test_a_sentinel_failover_mid_run_finishes_every_job_exactly_once(
    sentinel_group: SentinelGroup, ha_env: dict[str, str], tmp_path: Path
) -> None:
    # given two workers and the tick on a Sentinel-managed master, and jobs under way
    settings = current_settings()
    client = store_client(settings)
    store = JobStore(client)
    service = JobService(store, settings)
    processes = Processes(ha_env, tmp_path / "logs")
    try:
        processes.worker("w1")
        processes.worker("w2")
        processes.scheduler()
        wait_for(lambda: all(client.exists(keys.WORKER_PREFIX + f"{n}@test")
                             for n in ("w1", "w2")), 90, "workers on the Sentinel master")
        jobs = _submit(service, 4)
        wait_for(lambda: sum(int(store.fields(j)["next_chunk"]) for j in jobs) >= 6, 60,
                 "progress before the failover")

        # when the sentinels promote the replica
        old_master = sentinel_group.master_port
        new_master = sentinel_group.failover()

        # then the clients follow it, and every job finishes, each chunk applied exactly once
        assert new_master == sentinel_group.replica_port != old_master
        more = _submit(service, 2)  # accepted after the promotion too
        every = jobs + more
        missing = [j for j in every if not client.exists(keys.job(j))]
        assert not missing, f"jobs lost in the failover: {missing} (of {jobs} + {more})"
        wait_for(tolerant(lambda: all(store.state(j).is_terminal for j in every)), 150,
                 "every job to end after the failover")
        artifacts = ArtifactStore.from_settings(settings)
        for job_id in every:
            audit = audit_job(store, artifacts, job_id)
            assert audit.exact, audit.problem()
        assert all(processes.procs[n].poll() is None for n in ("w1", "w2", "scheduler", "beat"))
        # the scripts were loaded again on the new master (it started with an empty cache)
        promoted = redis.Redis(port=new_master)
        assert promoted.info("replication")["role"] == "master"
        assert all(promoted.script_exists(store._commit.sha))
    finally:
        processes.stop_all()


def test_a_job_no_replica_holds_is_refused_rather_than_accepted(
    stack_env: dict[str, str], redis_client: redis.Redis
) -> None:
    # given a store that wants one replica per write, on a server that has none
    store = JobStore(redis_client, commit_replicas=1, commit_replica_timeout_s=0.05)
    service = JobService(store, current_settings())
    spec = JobSpec(kind="simulated", slo=SloClass.BATCH, params={"steps": 2, "step_ms": 1},
                   idempotency_key="retry-me")
    # when a job is submitted, then it is refused as a retryable outage, not silently accepted
    with pytest.raises(RedisUnavailable, match="replicas"):
        service.submit(spec)
    # and a retry with the same key finds the job the server did keep (nothing runs twice)
    job_id, created = JobService(JobStore(redis_client), current_settings()).submit(spec)
    assert not created and store.state(job_id).value == "PENDING"
