"""The job store against a real redis-server: lifecycle, events, idempotency, compare-and-set."""

from __future__ import annotations

import pytest
import redis

from app.schemas import JobSpec
from scheduler.errors import IllegalTransition
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.heartbeat import Heartbeat, write_heartbeat
from tasks.record import UnreadableRecord, encode
from tasks.store import JobStore
from tasks.store_calls import CommitRequest, CommitStatus
from tests.store_steps import claim_chunk, claim_with_state, create_job

pytestmark = pytest.mark.timeout(30)


def _create(store: JobStore, key: str | None = None) -> tuple[str, bool]:
    spec = JobSpec(kind="simulated", params={"steps": 3, "step_ms": 1}, idempotency_key=key)
    return create_job(store, spec, tenant="t", tier="standard", num_chunks=3, cost_key="sim",
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
    first = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    duplicate = claim_chunk(store, job_id, 0, 0, "w2", lease_s=5)
    assert not isinstance(first, str) and not isinstance(duplicate, str)
    ok = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=first.seq, complete=True,
                                    checkpoint=b"x", service_s=0.1, worker="w1"))
    again = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=duplicate.seq, complete=True,
                                       checkpoint=b"y", service_s=0.1, worker="w2"))
    assert ok.status is CommitStatus.HOP and ok.next_chunk == 1
    assert again.status is CommitStatus.STALE
    assert store.load_checkpoint(job_id) == b"x"


def _claim_all(store: JobStore, job_id: str, chunks: int) -> None:
    """Run ``chunks`` chunks by hand: claim, commit, hop."""
    for chunk in range(chunks):
        job = claim_chunk(store, job_id, chunk, 0, "w1", lease_s=5)
        assert not isinstance(job, str), job
        store.commit(CommitRequest(job_id, chunk=chunk, epoch=0, seq=job.seq, complete=True,
                                   checkpoint=b"s", service_s=0.01, worker="w1"))


def test_the_last_commit_finishes_the_job_in_the_same_step(redis_client: redis.Redis) -> None:
    # given a queued 3-chunk job whose first two chunks ran
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    _claim_all(store, job_id, 2)
    job = claim_chunk(store, job_id, 2, 0, "w1", lease_s=5)
    assert not isinstance(job, str)
    # when its last chunk commits
    done = store.commit(CommitRequest(job_id, chunk=2, epoch=0, seq=job.seq, complete=True,
                                      checkpoint=None, service_s=0.01, worker="w1",
                                      artifact=("a.png", "image/png")))
    # then the job is DONE at once, with its artifact, out of the live set
    record = store.record(job_id)
    assert done.status is CommitStatus.DONE and record.state is JobState.DONE
    assert (record.artifact, record.next_chunk) == ("a.png", 3)
    assert job_id not in store.active_ids() and record.finished_at_s is not None


def test_a_tick_acting_on_a_snapshot_from_before_the_last_commit_changes_nothing(
    redis_client: redis.Redis,
) -> None:
    # given a running 1-chunk job, snapshotted by the tick while its only chunk runs
    store = JobStore(redis_client)
    spec = JobSpec(kind="simulated", params={"steps": 1, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="t", tier="standard", num_chunks=1, cost_key="sim",
                           cost_units=[1], deadline_s=5, now_s=100.0, queue="interactive")
    store.transition(job_id, JobState.QUEUED, by="test")
    claimed = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(claimed, str)
    seen = store.record(job_id)
    # when the worker commits the last chunk, and then the tick moves the job to standby
    store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=claimed.seq, complete=True,
                               checkpoint=None, service_s=0.01, worker="w1"))
    moved = store.transition_as_seen(seen, JobState.QUEUED, by="scheduler", reason="standby",
                                     updates=encode(epoch=seen.epoch + 1, queue="standby"))
    # then the tick's move is refused and the job stays DONE
    assert not moved
    assert store.record(job_id).state is JobState.DONE


def test_no_claim_or_commit_can_run_past_the_last_chunk(redis_client: redis.Redis) -> None:
    # given a 3-chunk job whose chunks all ran
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    _claim_all(store, job_id, 3)
    # when a chunk past the end is claimed, even with the job forced back to QUEUED
    redis_client.hset(f"sl:job:{job_id}", mapping={"state": "QUEUED"})
    stale = claim_chunk(store, job_id, 3, 0, "w1", lease_s=5)
    # then the claim is refused and the cursor never moves past the end
    assert isinstance(stale, str) and "past the last" in stale
    assert store.record(job_id).next_chunk == 3


def test_an_unreadable_record_is_failed_once_with_its_reason(redis_client: redis.Redis) -> None:
    # given a live record whose cursor is out of range
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    redis_client.hset(f"sl:job:{job_id}", "next_chunk", "7")
    [item] = store.records([job_id])
    assert isinstance(item, UnreadableRecord) and "next_chunk 7 outside 0..3" in str(item)
    # when the tick fails it
    assert store.fail_unreadable(job_id, f"unreadable record: {item.problem}")
    # then it is FAILED with the reason, gone from the live set, and a second call does nothing
    assert store.state(job_id) is JobState.FAILED and job_id not in store.active_ids()
    assert "next_chunk 7" in store.fields(job_id)["error"]
    assert not store.fail_unreadable(job_id, "again")


def test_a_preempt_flag_stops_the_job_at_its_commit_with_a_durable_checkpoint(
    redis_client: redis.Redis,
) -> None:
    # given a running job flagged for preemption by a tick that saw it running
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    job = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(job, str)
    assert store.request_preempt(job_id, state=JobState.RUNNING, epoch=0)
    # when the worker commits without a checkpoint, then with one
    first = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                       checkpoint=None, service_s=0.01, worker="w1"))
    second = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                        checkpoint=b"c", service_s=0.01, worker="w1"))
    # then the store asks for the checkpoint, and the job stops PREEMPTED with it saved
    assert first.status is CommitStatus.NEEDS_CHECKPOINT
    assert second.status is CommitStatus.PREEMPTED
    record = store.record(job_id)
    assert (record.state, record.preempt, record.preemptions) == (JobState.PREEMPTED, False, 1)
    assert store.load_checkpoint(job_id) == b"c" and record.ckpt_seq == record.seq == 1


def test_a_message_from_an_old_epoch_is_fenced(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test", updates={"epoch": "1"})
    assert isinstance(claim_chunk(store, job_id, 0, 0, "w1", lease_s=5), str)
    assert not isinstance(claim_chunk(store, job_id, 0, 1, "w1", lease_s=5), str)


def test_cancel_of_a_waiting_job_is_immediate(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    assert store.request_cancel(job_id) is JobState.CANCELLED


def test_the_first_estimate_is_kept_once_and_never_recreates_a_deleted_record(
        redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    # given two estimates for one job, then one for a job whose record is gone
    store.keep_first_estimate(job_id, 2.5)
    store.keep_first_estimate(job_id, 9.0)
    store.keep_first_estimate("gone", 1.0)
    # then the first one stands, and no record appears for the missing job
    assert store.record(job_id).first_estimate_s == 2.5
    assert not redis_client.exists(keys.job("gone"))


def test_a_long_jobs_whole_history_is_kept_and_expires_only_after_it_ends(
        redis_client: redis.Redis) -> None:
    store = JobStore(redis_client)
    spec = JobSpec(kind="simulated", params={"steps": 3, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="t", tier="standard", num_chunks=3, cost_key="sim",
                           cost_units=[1, 1, 1], deadline_s=5, now_s=100.0,
                           queue="interactive", events_ttl_s=3600.0)
    for i in range(700):  # far more than the ~512 entries a capped stream would keep
        moved = JobState.QUEUED if i % 2 == 0 else JobState.SUSPENDED
        store.transition(job_id, moved, by="test", reason=f"move {i}")
    assert len(store.events(job_id)) == 701  # the submit event and every move
    assert redis_client.ttl(keys.job_events(job_id)) == -1  # no expiry while it lives
    store.transition(job_id, JobState.CANCELLED, by="client", reason="done with it")
    assert len(store.events(job_id)) == 702
    assert 3500 < redis_client.ttl(keys.job_events(job_id)) <= 3600


def test_a_claim_brings_the_checkpoint_unless_the_worker_holds_that_state(
        redis_client: redis.Redis) -> None:
    # given a queued job: no state yet at its first claim
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    job, blob = claim_with_state(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(job, str) and blob is None
    # when its first chunk commits a checkpoint and hops
    hop = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                     checkpoint=b"state-1", service_s=0.01, worker="w1"))
    assert hop.status is CommitStatus.HOP
    # then a worker holding no state (or an older one) gets the checkpoint with the claim,
    again, blob = claim_with_state(store, job_id, 1, 0, "w2", lease_s=5, cached_seq=-1)
    assert not isinstance(again, str) and again.seq == hop.seq and blob == b"state-1"
    assert claim_with_state(store, job_id, 1, 0, "w2", lease_s=5, cached_seq=0)[1] == b"state-1"
    # one holding this very state (its seq and commit) gets none, nor does a plain claim, nor a
    # stale one
    assert claim_with_state(store, job_id, 1, 0, "w1", lease_s=5, cached_seq=hop.seq,
                            cached_commit=hop.commit_id)[1] is None
    assert claim_with_state(store, job_id, 1, 0, "w1", lease_s=5, cached_seq=hop.seq,
                            cached_commit="another")[1] == b"state-1"
    assert claim_with_state(store, job_id, 1, 0, "w1", lease_s=5, cached_seq=None)[1] is None
    stale, blob = claim_with_state(store, job_id, 0, 0, "w1", lease_s=5)
    assert isinstance(stale, str) and blob is None
    # and a batch's claims say the same, per job, in one round trip
    claims, _, blobs = store.claim_chunks([(job_id, 1, 0)], "w3", 5.0)
    assert not isinstance(claims[0], str) and blobs == {job_id: b"state-1"}
    claims, _, blobs = store.claim_chunks([(job_id, 1, 0)], "w3", 5.0,
                                          cached_seqs={job_id: (hop.seq, hop.commit_id)})
    assert not isinstance(claims[0], str) and blobs == {}


def test_a_hop_commit_pushes_the_next_message_and_a_stop_or_a_stale_one_pushes_none(
        redis_client: redis.Redis) -> None:
    from tasks.store_calls import NextMessage

    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    job = claim_chunk(store, job_id, 0, 0, "w1", lease_s=5)
    assert not isinstance(job, str)
    message = NextMessage(f"{job_id}.1.0.abc", '{"q": ', "}")
    # when the chunk commits and the job hops, to the worker's own queue for its class
    hop = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                     checkpoint=b"s", service_s=0.01, worker="w1",
                                     hop_queues={"interactive": "w1.interactive"},
                                     next_message=message))
    # then the message is on that queue's list, the record says it was published
    assert hop.status is CommitStatus.HOP and hop.published == message.task_id
    assert redis_client.lrange("w1.interactive", 0, -1) == [b'{"q": "w1.interactive"}']
    assert message.for_queue("w1.interactive") == '{"q": "w1.interactive"}'
    record = store.record(job_id)
    assert (record.published, record.last_task_id, record.queue) == (1, message.task_id,
                                                                     "w1.interactive")
    # a duplicate commit of the same chunk pushes nothing
    stale = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                       checkpoint=b"s", service_s=0.01, worker="w1",
                                       next_message=message))
    assert stale.status is CommitStatus.STALE and redis_client.llen("w1.interactive") == 1
    # nor does a commit that stops the job (a preempt flag)
    job = claim_chunk(store, job_id, 1, 0, "w1", lease_s=5)
    assert not isinstance(job, str)
    store.set_fields(job_id, preempt=True)
    stop = store.commit(CommitRequest(job_id, chunk=1, epoch=0, seq=job.seq, complete=True,
                                      checkpoint=b"s", service_s=0.01, worker="w1",
                                      next_message=NextMessage(f"{job_id}.2.0.def", "[", "]")))
    assert stop.status is CommitStatus.PREEMPTED and stop.published is None
    assert redis_client.llen("w1.interactive") == 1 and redis_client.llen("interactive") == 0


def test_a_job_placed_on_a_worker_hops_to_that_workers_own_queue_for_its_class(
        redis_client: redis.Redis) -> None:
    # given a batch job placement parked in a worker's placement queue
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    store.set_fields(job_id, queue="w1@h.x.batch.placed")
    job = claim_chunk(store, job_id, 0, 0, "w1@h.x", lease_s=5)
    assert not isinstance(job, str)
    # when its first chunk commits on that worker
    hop = store.commit(CommitRequest(job_id, chunk=0, epoch=0, seq=job.seq, complete=True,
                                     checkpoint=b"s", service_s=0.01, worker="w1@h.x",
                                     hop_queues={"interactive": "w1@h.x.interactive",
                                                 "batch": "w1@h.x.batch"}))
    # then its next chunk waits in the worker's own queue for its class, batch
    assert hop.status is CommitStatus.HOP
    assert store.record(job_id).queue == "w1@h.x.batch"


def test_pipelined_claims_and_commits_survive_a_server_that_forgot_its_scripts(
        redis_client: redis.Redis) -> None:
    # given a queued job and a Redis that lost its script cache (restarted, SCRIPT FLUSH)
    store = JobStore(redis_client)
    job_id, _ = _create(store)
    store.transition(job_id, JobState.QUEUED, by="test")
    redis_client.script_flush()
    # when a batch claims and commits it in pipelines of bare EVALSHA calls
    claims, _, _ = store.claim_chunks([(job_id, 0, 0)], "w1", 5.0)
    job = claims[0]
    assert not isinstance(job, str)
    redis_client.script_flush()
    commits, _ = store.commit_chunks([(job_id, {
        "chunk": 0, "epoch": 0, "seq": job.seq, "complete": True, "checkpoint": b"s",
        "service_s": 0.01, "worker": "w1"})], timing=("sim#step@b2", "cpu", 0.5))
    # then each call ran once, after its script was loaded again
    assert commits[0].status is CommitStatus.HOP and store.record(job_id).seq == 1
    assert len(redis_client.xrange(keys.TIMINGS)) == 1


def test_the_live_heartbeats_read_as_records_and_a_malformed_one_is_left_out(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    # given a current heartbeat (registered in sl:workers:live as a worker writes it), an
    # older worker's partial one (found by the scan of the keyspace) and a malformed one
    pipe = redis_client.pipeline()
    write_heartbeat(pipe, Heartbeat(name="w1@h", queues=("batch",), ts=5.0), 60.0)
    pipe.execute()
    redis_client.set(keys.worker("w2@h"), b'{"busy_job": "j9"}')
    redis_client.set(keys.worker("w3@h"), b'{"queues": "batch"}')
    # when the store reads them
    beats = JobStore(redis_client).heartbeats()
    # then two read back, the partial one named by its key, and the third is logged
    assert beats == {"w1@h": Heartbeat(name="w1@h", queues=("batch",), ts=5.0),
                     "w2@h": Heartbeat(name="w2@h", busy_job="j9")}
    assert "heartbeat of w3@h: queues is str" in caplog.text


def test_the_heartbeats_are_read_by_name_and_the_keyspace_scanned_only_now_and_then(
    redis_client: redis.Redis,
) -> None:
    # given a store that has read the heartbeats once (and scanned the keyspace then)
    store = JobStore(redis_client)
    assert store.heartbeats() == {}
    # when one worker registers and another writes only its key, and they are read again
    pipe = redis_client.pipeline()
    write_heartbeat(pipe, Heartbeat(name="w1@h", ts=5.0), 60.0)
    pipe.execute()
    redis_client.set(keys.worker("w2@h"), Heartbeat(name="w2@h", ts=5.0).encode())
    # then the registered one is there at once, the other after the next scan
    assert set(store.heartbeats()) == {"w1@h"}
    store._heartbeat_scan = (float("-inf"), [])
    assert set(store.heartbeats()) == {"w1@h", "w2@h"}
    # and a lapsed worker's key is gone from the answer though its registry entry remains
    redis_client.delete(keys.worker("w1@h"))
    assert set(store.heartbeats()) == {"w2@h"}
