"""A commit a failover loses, then replayed: no worker may take its own memory of the lost
commit for the job's state.

With Sentinel, a commit whose ``WAIT`` timed out (or one only a replica that is not promoted
acknowledged) is gone once the old master rejoins as a replica; the job is back at the commit
before, and the chunk runs again from the durable checkpoint. The replay can land at the same
sequence number with another state (a chunk that yields or stops inside, at a block-group
boundary, advances the sequence number and not the chunk), so the worker that made the lost
commit still holds, under that sequence number, a state the job never had. These tests lose a
commit the way a failover does (every key put back as it was before it) against a real
redis-server.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import redis

from app.drills.faults import audit_job
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.artifacts import ArtifactStore
from tasks.context import WorkerContext
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tasks.submit import JobService
from tests.store_steps import claim_with_state, create_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class _Replica:
    """What a lagging replica holds: every key as it was when taken, put back by
    :meth:`promote` (the writes since are lost, as a failover to that replica loses them)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.keys: dict[bytes, tuple[bytes, int]] = {}
        for key in client.scan_iter(count=1000):
            dumped = client.dump(key)
            if dumped is not None:
                self.keys[key] = (dumped, max(int(client.pttl(key)), 0))

    def promote(self) -> None:
        self.client.flushall()
        for key, (dumped, ttl_ms) in self.keys.items():
            self.client.restore(key, ttl_ms, dumped)


def _create(store: JobStore) -> str:
    spec = JobSpec(kind="simulated", params={"steps": 3, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="t", tier="standard", num_chunks=3, cost_key="sim",
                           cost_units=[1, 1, 1], deadline_s=5, now_s=100.0, queue="batch")
    store.transition(job_id, JobState.QUEUED, by="test")
    return job_id


def test_a_claim_brings_the_checkpoint_to_the_worker_whose_commit_a_failover_lost(
        redis_client: redis.Redis) -> None:
    # given a job whose chunk 0 committed, replicated
    store = JobStore(redis_client)
    job_id = _create(store)
    job, _ = claim_with_state(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(job, str)
    first = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                       checkpoint=b"after-0", service_s=0.01, worker="w1",
                                       commit_id="c0"))
    replica = _Replica(redis_client)
    # and chunk 1 committed by w1 (which keeps the state it made in memory), then lost
    job, _ = claim_with_state(store, job_id, 1, 0, "w1", lease_s=5, cached_seq=first.seq,
                              cached_commit="c0")
    assert not isinstance(job, str)
    lost = store.commit(CommitRequest(job_id, chunk=1, epoch=0, seq=job.seq, complete=True,
                                      checkpoint=b"after-1", service_s=0.01, worker="w1",
                                      commit_id="lost"))
    assert lost.status is CommitStatus.HOP
    replica.promote()
    # when w2 replays chunk 1 and yields inside it: the same sequence number, another state
    job, blob = claim_with_state(store, job_id, 1, 0, "w2", lease_s=5)
    assert not isinstance(job, str) and blob == b"after-0"
    inside = store.commit(CommitRequest(job_id, chunk=1, epoch=0, seq=job.seq, complete=False,
                                        checkpoint=b"inside-1", service_s=0.01, worker="w2",
                                        yielded=True, commit_id="c1"))
    assert (inside.status, inside.seq, inside.next_chunk) == (CommitStatus.HOP, lost.seq, 1)

    # then w1, holding the lost commit's state under that sequence number, gets the checkpoint
    again, blob = claim_with_state(store, job_id, 1, 0, "w1", lease_s=5, cached_seq=lost.seq,
                                   cached_commit="lost")
    assert not isinstance(again, str) and again.commit_id == "c1" and blob == b"inside-1"
    claims, _, blobs = store.claim_chunks([(job_id, 1, 0)], "w1", 5.0,
                                          cached_seqs={job_id: (lost.seq, "lost")})
    assert not isinstance(claims[0], str) and blobs == {job_id: b"inside-1"}
    # while a worker holding the state the job is at gets none
    assert claim_with_state(store, job_id, 1, 0, "w2", lease_s=5, cached_seq=inside.seq,
                            cached_commit="c1")[1] is None


class _YieldingStore(JobStore):
    """A store whose chunk signals always report work waiting ahead: the chunk yields at its
    first block-group boundary."""

    def chunk_signals(self, job_id: str, ahead: Sequence[str]) -> tuple[bool, str | None]:
        return False, (ahead[0] if ahead else None)


@pytest.fixture()
def workers(stack_env: dict[str, str], redis_client: redis.Redis
            ) -> Iterator[tuple[WorkerContext, WorkerContext]]:
    settings = current_settings()
    queues = ("realtime", "interactive", "batch")

    def worker(store: JobStore, name: str) -> WorkerContext:
        return WorkerContext(settings=settings, store=store, name=name, queues=queues,
                             artifacts=ArtifactStore.from_settings(settings))

    yield worker(JobStore(redis_client), "w1"), worker(_YieldingStore(redis_client), "w2")


def test_a_chunk_replayed_after_a_lost_commit_is_applied_once(
        workers: tuple[WorkerContext, WorkerContext], redis_client: redis.Redis) -> None:
    from tasks.chunks import execute_chunk

    # given a three-chunk job of two block groups whose chunk 0 w1 ran and Redis replicated
    w1, w2 = workers
    store = w1.store
    job_id, _ = JobService(store, current_settings()).submit(JobSpec(
        kind="simulated", slo=SloClass.BATCH, deadline_s=600,
        params={"steps": 3, "step_ms": 2, "block_groups": 2}))
    epoch = store.record(job_id).epoch
    assert execute_chunk(w1, job_id, 0, epoch) == "hop"
    replica = _Replica(redis_client)
    # and chunk 1 w1 ran and committed (its state kept in its memory), lost in a failover
    assert execute_chunk(w1, job_id, 1, epoch) == "hop"
    replica.promote()
    assert store.record(job_id).next_chunk == 1

    # when w2 replays chunk 1 and yields half-way to waiting work (the job hops, same chunk)
    assert execute_chunk(w2, job_id, 1, epoch) == "hop"
    assert store.record(job_id).next_chunk == 1
    # and w1 runs the rest
    assert execute_chunk(w1, job_id, 1, epoch) == "hop"
    assert execute_chunk(w1, job_id, 2, epoch) == "done"

    # then every chunk was applied once, in order: w1 resumed from w2's checkpoint, not from
    # the state of its own lost commit
    audit = audit_job(store, w1.artifacts, job_id)
    assert audit.applied == [0, 1, 2], audit.problem()
    assert audit.exact, audit.problem()
