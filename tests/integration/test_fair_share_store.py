"""The fair-share counters in a real redis-server: each commit charges its measured seconds to
its tenant's band once (a fenced duplicate charges nothing), and the counters and the join
rule's state read back whole by a new client, as after a scheduler restart."""

from __future__ import annotations

import pytest
import redis

from app.schemas import JobSpec
from scheduler.fairness import FairShareConfig, ServiceLedger, join
from scheduler.lifecycle import JobState
from tasks.fair_share import read_ledger, save_joined
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tests.store_steps import claim_chunk, create_job

pytestmark = pytest.mark.timeout(30)


def test_a_commit_charges_its_tenants_band_once_and_the_counters_survive_a_restart(
        redis_client: redis.Redis) -> None:
    # given a queued interactive job of tenant "acme"
    store = JobStore(redis_client)
    spec = JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="acme", tier="gold", num_chunks=2, cost_key="sim",
                           cost_units=[1, 1], deadline_s=5, now_s=100.0, queue="interactive")
    store.transition(job_id, JobState.QUEUED, by="test")
    first = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    duplicate = claim_chunk(store, job_id, 0, 0, "w2", lease_s=5)
    assert not isinstance(first, str) and not isinstance(duplicate, str)
    # when its chunk commits, and a redelivered copy of it tries to
    ok = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=first.seq, complete=True,
                                    checkpoint=b"x", service_s=0.25, worker="w1"))
    stale = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=duplicate.seq, complete=True,
                                       checkpoint=b"y", service_s=0.25, worker="w2"))
    assert ok.status is CommitStatus.HOP and stale.status is CommitStatus.STALE
    # then the band's counter holds the one measured charge
    ledger = read_ledger(redis_client)
    assert ledger.service_s == {("interactive", "acme", "gold"): 0.25}
    # and the tick's join, saved, reads back the same from a new connection
    config = FairShareConfig(enabled=True)
    joined = join(ledger.charged("interactive", "b", "standard", 4.0),
                  [("interactive", "acme"), ("interactive", "b")], config)
    save_joined(redis_client, joined)
    again = read_ledger(redis.Redis(connection_pool=redis_client.connection_pool))
    assert (again.active, again.floor, dict(again.lift)) == (
        joined.ledger.active, joined.ledger.floor, dict(joined.ledger.lift))


def test_an_absent_or_foreign_state_reads_as_nobody_active(redis_client: redis.Redis) -> None:
    assert read_ledger(redis_client) == ServiceLedger()
    redis_client.set("sl:fair:state", b"not json")
    assert read_ledger(redis_client).active == frozenset()


def test_the_live_tick_joins_the_active_tenants_and_persists_the_join(
        stack_env: dict[str, str], redis_client: redis.Redis) -> None:
    import time

    from scheduler.lifecycle import SloClass
    from tasks.adapter import run_tick
    from tasks.artifacts import ArtifactStore
    from tasks.context import WorkerContext
    from tasks.runtime import current_settings
    from tasks.submit import JobService

    # given fair share on, and tenant "late" away while "early" was served 3 s
    base = current_settings()
    settings = base.model_copy(update={"scheduler": base.scheduler.model_copy(
        update={"fair_share": base.scheduler.fair_share.model_copy(update={"enabled": True})})})
    store = JobStore(redis_client)
    redis_client.hset("sl:fair:service", "interactive\tearly\tstandard", "3.0")
    service = JobService(store, settings)
    spec = JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                   params={"steps": 2, "step_ms": 1, "block_groups": 1})
    service.submit(spec, tenant="early")
    ctx = WorkerContext(settings=settings, store=store,
                        artifacts=ArtifactStore.from_settings(settings), name="s1@test")
    run_tick(ctx, time.time())
    # when "late" submits and the next tick runs
    service.submit(spec, tenant="late")
    run_tick(ctx, time.time())
    # then "late" joins at early's counter (no credit for its absence), and that is stored
    ledger = read_ledger(redis_client)
    assert ledger.active == {("interactive", "early"), ("interactive", "late")}
    counters = ledger.virtual(settings.scheduler.to_policy().fair_share)
    assert counters["interactive", "late"] >= counters["interactive", "early"] - 1e-9 >= 3.0 - 1e-9
