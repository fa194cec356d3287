"""A submit replayed by its idempotency key is answered like a new one: only once the replicas
``broker.commit_replicas`` asks for hold the job. Else the retry that follows a 503 could get
a job that lives on a master a failover is about to demote (the drill across hosts lost one
that way)."""

from __future__ import annotations

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import SloClass
from tasks import keys
from tasks.errors import RedisUnavailable
from tasks.read_model import ReadModel
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService

pytestmark = pytest.mark.integration

SPEC = JobSpec(kind="simulated", slo=SloClass.BATCH, params={"steps": 2, "step_ms": 1},
               idempotency_key="replay-me")


def test_a_replay_no_replica_holds_is_refused_and_a_replay_without_replicas_wanted_is_not(
    stack_env: dict[str, str], redis_client: redis.Redis
) -> None:
    # given a job created on a server that has no replica
    job_id, created = JobService(JobStore(redis_client), current_settings()).submit(
        SPEC, tenant="t1")
    assert created
    key = keys.idempotency("t1", "replay-me")
    ttl_before = redis_client.ttl(key)
    # when a client that wants one replica replays it, then it is refused as an outage
    wanting = ReadModel(JobStore(redis_client, commit_replicas=1, commit_replica_timeout_s=0.05))
    with pytest.raises(RedisUnavailable, match="0 of 1 replicas"):
        wanting.replayed_job("t1", "replay-me")
    # and the key still names the job, its TTL untouched (the write kept both)
    assert redis_client.get(key) == job_id.encode()
    assert 0 < redis_client.ttl(key) <= ttl_before or ttl_before == redis_client.ttl(key) == -1
    # while a client that wants none gets the job, as before
    assert ReadModel(JobStore(redis_client)).replayed_job("t1", "replay-me") == job_id
    assert ReadModel(JobStore(redis_client)).replayed_job("t1", "other-key") is None
