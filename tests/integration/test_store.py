"""The job store against a real redis-server: lifecycle, events, idempotency, compare-and-set."""

from __future__ import annotations

import pytest
import redis

from app.schemas import JobSpec
from app.store import JobStore
from scheduler.errors import IllegalTransition
from scheduler.lifecycle import JobState

pytestmark = pytest.mark.timeout(30)


def _create(store: JobStore, key: str | None = None) -> tuple[str, bool]:
    spec = JobSpec(kind="simulated", params={"steps": 3, "step_ms": 1}, idempotency_key=key)
    return store.create(spec, tenant="t", tier="standard", num_chunks=3, cost_key="sim",
                        cost_units=[1, 1, 1], deadline_s=5, now_s=100.0, queue="interactive")


def test_an_illegal_transition_raises_and_changes_nothing(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    with pytest.raises(IllegalTransition, match="PENDING -> DONE"):
        store.transition(job_id, JobState.DONE, by="test")
    assert store.state(job_id) is JobState.PENDING


def test_every_transition_lands_on_the_event_stream(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test", reason="release")
    store.transition(job_id, JobState.CANCELLED, by="client", reason="cancelled")
    moves = [(e["from"], e["to"], e["by"]) for e in store.events(job_id) if e["kind"] == "state"]
    assert moves == [("", "PENDING", "submit"), ("PENDING", "QUEUED", "test"),
                     ("QUEUED", "CANCELLED", "client")]
    assert job_id not in store.active_ids()


def test_the_same_idempotency_key_returns_the_same_job(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    first, created_first = _create(store, key="order-42")
    second, created_second = _create(store, key="order-42")
    assert first == second
    assert created_first and not created_second
    assert len(store.active_ids()) == 1


def test_a_redelivered_chunk_cannot_commit_twice(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    first = store.claim_chunk(job_id, 0, 0, "w1", lease_s=5)
    duplicate = store.claim_chunk(job_id, 0, 0, "w2", lease_s=5)
    assert not isinstance(first, str) and not isinstance(duplicate, str)
    ok = store.commit_chunk(job_id, chunk=0, epoch=0, seq=first.seq, complete=True,
                            checkpoint=b"x", service_s=0.1, worker="w1")
    again = store.commit_chunk(job_id, chunk=0, epoch=0, seq=duplicate.seq, complete=True,
                               checkpoint=b"y", service_s=0.1, worker="w2")
    assert ok is not None and ok.next_chunk == 1
    assert again is None
    assert store.load_checkpoint(job_id) == b"x"


def test_a_message_from_an_old_epoch_is_fenced(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test", updates={"epoch": "1"})
    assert isinstance(store.claim_chunk(job_id, 0, 0, "w1", lease_s=5), str)
    assert not isinstance(store.claim_chunk(job_id, 0, 1, "w1", lease_s=5), str)


def test_cancel_of_a_waiting_job_is_immediate(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    assert store.request_cancel(job_id) is JobState.CANCELLED
