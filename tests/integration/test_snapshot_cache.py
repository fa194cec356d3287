"""The tick's incremental snapshot (``SnapshotCache``) against a full read of every live record,
after every step of random histories of the store's real writers on a real redis-server
(hypothesis stateful): folding in only the marked records — and the tick's own writes, from what
it wrote, unread — gives exactly the same snapshot."""

from __future__ import annotations

import itertools
import time
from typing import TypeVar

import hypothesis
import pytest
import redis
from hypothesis import HealthCheck
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler import PolicyConfig
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.heartbeat import Heartbeat, write_heartbeat
from tasks.record import JobRecord, encode
from tasks.script_batch import ScriptBatch
from tasks.snapshot import SnapshotCache, read_snapshot
from tasks.spec import JobSpec
from tasks.store import JobStore
from tasks.store_calls import CommitRequest
from tests.store_steps import claim_chunk, create_job, renew_lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

POLICY = PolicyConfig()
PICK = st.integers(min_value=0, max_value=15)
LEASE_S = 30.0
T = TypeVar("T")
RACES = ["none", "none", "lease renewed before", "note written before", "lease renewed after",
         "note written after", "committed before"]
"""Another writer's write of a record the tick acts on: right before the tick's writes (after
its read), or right after them (before its next fold)."""
RACES_ST = st.sampled_from(RACES)
TICK_WRITES = st.lists(st.sampled_from(["estimate", "release", "requeue", "suspend", "expire",
                                        "preempt", "standby", "level"]), min_size=1, max_size=3)


def _pick(items: list[T], index: int) -> T:
    return items[index % len(items)]


class CacheAgainstFullRead(RuleBasedStateMachine):
    """Jobs submitted (some depending on others, or on jobs that never existed), released,
    claimed, committed (with chunk times), flagged, suspended, cancelled, ended, re-estimated,
    levelled; workers beating; the change stream trimmed; the lease changing hands. After every
    step the cache's snapshot is the full read's."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        client.flushdb()
        self.client = client
        self.store = JobStore(client)
        self.cache = SnapshotCache(self.store)
        self.cache.heartbeat_scan_s = 3600.0  # registered workers are found without a scan
        self.jobs: list[str] = []
        self.names = itertools.count()
        self.clock = 1000.0
        """Seconds added to the tick's clock: running jobs become long-running."""
        self.seen: dict[str, JobRecord] = {}
        """The records of the tick's last read (its cache's)."""

    def _live(self) -> list[JobRecord]:
        return [r for r in self.store.records(self.store.active_ids())
                if isinstance(r, JobRecord)]

    def _in(self, states: set[JobState], index: int) -> JobRecord | None:
        found = [r for r in self._live() if r.state in states]
        return _pick(found, index) if found else None

    @initialize(n=st.integers(min_value=1, max_value=3))
    def submit_some(self, n: int) -> None:
        for _ in range(n):
            self.submit(chunks=3, deps=0, dep=0)

    @rule(chunks=st.integers(min_value=1, max_value=6), deps=st.integers(0, 2), dep=PICK)
    def submit(self, chunks: int, deps: int, dep: int) -> None:
        depends_on: list[str] = []
        if deps == 1 and self.jobs:
            depends_on = [_pick(self.jobs, dep)]
        elif deps == 2:
            depends_on = [*self.jobs[-1:], "never-existed"]
        spec = JobSpec(kind="simulated", params={"steps": chunks, "step_ms": 1},
                       depends_on=depends_on)
        job_id, _ = create_job(
            self.store, spec, tenant="t", tier="standard", num_chunks=chunks, cost_key="sim",
            cost_units=[1.0 + (i % 2) for i in range(chunks)], deadline_s=60,
            now_s=time.time(), queue="interactive")
        self.jobs.append(job_id)

    @rule(job=PICK, bump=st.booleans())
    def release(self, job: int, bump: bool) -> None:
        seen = self._in({JobState.PENDING, JobState.SUSPENDED, JobState.PREEMPTED,
                         JobState.QUEUED}, job)
        if seen is None or (seen.state is JobState.QUEUED and not bump):
            return
        epoch = seen.epoch + int(bump)
        if self.store.transition_as_seen(
                seen, JobState.QUEUED, by="scheduler", reason="release",
                updates=encode(queue="interactive", epoch=epoch, preempt=False,
                               queued_at_s=time.time())):
            self.store.set_fields(seen.job_id, published=seen.next_chunk,
                                  last_task_id=f"{seen.job_id}.{seen.next_chunk}.{epoch}.x")

    @rule(job=PICK)
    def claim(self, job: int) -> None:
        seen = self._in({JobState.QUEUED}, job)
        if seen is not None:
            claim_chunk(self.store, seen.job_id, seen.next_chunk, seen.epoch,
                        f"w{job % 2}", LEASE_S)

    @rule(job=PICK, complete=st.booleans(), service_ms=st.integers(1, 900))
    def commit(self, job: int, complete: bool, service_ms: int) -> None:
        seen = self._in({JobState.RUNNING}, job)
        if seen is None:
            return
        self.store.commit(CommitRequest(
            seen.job_id, chunk=seen.next_chunk, epoch=seen.epoch, seq=seen.seq,
            complete=complete, checkpoint=b"ckpt", service_s=service_ms / 1000,
            worker=seen.running_on or "w", then_continue=job % 2 == 0))

    @rule(job=PICK, service_ms=st.lists(st.integers(1, 900), min_size=1, max_size=3))
    def an_atomic_worker_runs_on(self, job: int, service_ms: list[int]) -> None:
        """Chunks committed under one claim: a long-running job's own chunk times grow."""
        for ms in service_ms:
            seen = self._in({JobState.RUNNING}, job)
            if seen is None or seen.next_chunk >= seen.num_chunks:
                return
            self.store.commit(CommitRequest(
                seen.job_id, chunk=seen.next_chunk, epoch=seen.epoch, seq=seen.seq,
                complete=True, checkpoint=b"ckpt", service_s=ms / 1000,
                worker=seen.running_on or "w", then_continue=True))

    @rule(job=PICK, action=st.sampled_from(["preempt", "suspend", "cancel", "expire", "fail",
                                            "estimate", "standby", "level", "lease",
                                            "fail unreadable"]))
    def tick_or_client_acts(self, job: int, action: str) -> None:
        seen = self._in(set(JobState), job)
        if seen is None:
            return
        if action == "preempt":
            self.store.request_preempt(seen.job_id, state=seen.state, epoch=seen.epoch)
        elif action == "suspend":
            self.store.transition_as_seen(seen, JobState.SUSPENDED, by="scheduler", reason="s")
        elif action == "cancel":
            self.store.request_cancel(seen.job_id)
        elif action in ("expire", "fail"):
            target = JobState.EXPIRED if action == "expire" else JobState.FAILED
            self.store.transition_as_seen(seen, target, by="scheduler", reason=action,
                                          updates=encode(error=action))
        elif action == "estimate":
            self.store.keep_first_estimate(seen.job_id, 1.0 + job)
        elif action == "standby":
            self.store.update_as_seen(seen, queue="standby")
        elif action == "level":
            self.store.set_fields(seen.job_id, level=job % 3, level_mark_s=float(job))
        elif action == "lease":
            renew_lease(self.store, seen.job_id, LEASE_S)
        else:
            self.store.fail_unreadable(seen.job_id, "unreadable")

    @rule(job=PICK, writes=TICK_WRITES, race=RACES_ST)
    def the_tick_applies_and_folds_its_own_writes(self, job: int, writes: list[str],
                                                   race: str) -> None:
        """The tick's apply (a batch of fenced scripts on the records as it read them), its
        writes folded into its cache unread; another writer may write the record right
        before or after (the cache must then read it, not trust its own fold)."""
        if not self.seen:
            return
        seen = _pick(sorted(self.seen.values(), key=lambda r: r.job_id), job)
        if race.endswith("before"):
            self._another_writer(seen, race)
        batch = ScriptBatch(self.store)
        for write in writes:
            if write in ("release", "requeue"):
                epoch = seen.epoch + int(write == "requeue")
                task_id = f"{seen.job_id}.{seen.next_chunk}.{epoch}.t"
                batch.transition_as_seen(
                    seen, JobState.QUEUED, by="scheduler", reason=write,
                    updates=encode(queue="interactive", epoch=epoch, preempt=False,
                                   queued_at_s=time.time(), published=seen.next_chunk,
                                   last_task_id=task_id),
                    push=("sl:test:queue", task_id))
            elif write in ("suspend", "expire"):
                target = JobState.SUSPENDED if write == "suspend" else JobState.EXPIRED
                batch.transition_as_seen(seen, target, by="scheduler", reason=write)
            elif write == "preempt":
                batch.request_preempt(seen.job_id, state=seen.state, epoch=seen.epoch)
            elif write == "standby":
                batch.update_as_seen(seen, queue="standby")
            elif write == "level":
                batch.set_fields(seen.job_id, level=job % 3, level_mark_s=float(job))
            else:
                batch.keep_first_estimate(seen.job_id, 2.0 + job)
        batch.execute()
        self.cache.fold_written(batch.written)
        if race.endswith("after"):
            self._another_writer(seen, race)

    def _another_writer(self, seen: JobRecord, race: str) -> None:
        if race.startswith("lease"):  # a MULTI: its mark carries no revision
            renew_lease(self.store, seen.job_id, LEASE_S)
        elif race.startswith("note"):  # a script: its mark carries the revision
            self.store.set_fields(seen.job_id, expert_version=race)
        elif seen.state is JobState.RUNNING:  # a worker's commit: the tick's fences refuse
            self.store.commit(CommitRequest(
                seen.job_id, chunk=seen.next_chunk, epoch=seen.epoch, seq=seen.seq,
                complete=True, checkpoint=b"ckpt", service_s=0.01,
                worker=seen.running_on or "w", then_continue=True))

    @rule(worker=st.integers(0, 2), busy=PICK)
    def worker_beats(self, worker: int, busy: int) -> None:
        running = self._in({JobState.RUNNING}, busy)
        beat = Heartbeat(name=f"w{worker}@host", busy_job=running and running.job_id,
                         queues=("realtime", "interactive", "batch"), device="cpu",
                         ts=time.time())
        pipe = self.client.pipeline(transaction=False)
        write_heartbeat(pipe, beat, LEASE_S)
        pipe.execute()

    @rule(keep=st.integers(0, 3))
    def the_change_stream_is_trimmed(self, keep: int) -> None:
        self.client.xtrim(keys.CHANGES, maxlen=keep)

    @rule()
    def the_lease_changes_hands(self) -> None:
        self.cache.invalidate()

    @rule(seconds=st.sampled_from([0.0, 1000.0, 1000.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock = seconds

    @invariant()
    def the_cache_reads_what_a_full_read_reads(self) -> None:
        now = time.time() + self.clock
        cost = POLICY.new_cost_model()
        folded = self.cache.read(cost, POLICY, now)
        self.seen = dict(folded.records)
        full = read_snapshot(self.store, cost, POLICY, now)
        assert folded.snapshot.jobs == full.snapshot.jobs
        assert folded.snapshot.unreadable == full.snapshot.unreadable
        assert folded.snapshot.workers == full.snapshot.workers
        assert folded.snapshot.state == full.snapshot.state
        assert folded.records == full.records


def test_the_incremental_snapshot_is_the_full_read_after_every_step(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # given any history of the store's writers (jobs with dependencies, commits with chunk
    # times, flags, ends, heartbeats, a trimmed change stream, a lease changing hands);
    # then after every step the cache's folded snapshot equals a full read's
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 60, raising=False)

    class OnTheTestServer(CacheAgainstFullRead):
        def __init__(self) -> None:
            super().__init__(redis_client)

    hypothesis.stateful.run_state_machine_as_test(
        OnTheTestServer,
        settings=hypothesis.settings(
            max_examples=60, stateful_step_count=30, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow]))


def test_only_marked_records_are_read_and_a_trimmed_stream_reads_everything(
        redis_client: redis.Redis) -> None:
    # given ten live jobs and a cache that has read them all once
    store = JobStore(redis_client)
    spec = JobSpec(kind="simulated", params={"steps": 2, "step_ms": 1})
    ids = [create_job(store, spec, tenant="t", tier="standard", num_chunks=2, cost_key="sim",
                      cost_units=[1.0, 1.0], deadline_s=60, now_s=time.time(),
                      queue="interactive")[0] for _ in range(10)]
    cache = SnapshotCache(store)
    cache.read(POLICY.new_cost_model(), POLICY, time.time())
    assert (cache.full_reads, cache.changed) == (1, 10)
    # when nothing changes, then nothing is read
    cache.read(POLICY.new_cost_model(), POLICY, time.time())
    assert (cache.full_reads, cache.changed) == (1, 0)
    # when two records change, then only those two are read
    store.set_fields(ids[0], level=2, level_mark_s=1.0)
    store.transition(ids[1], JobState.SUSPENDED, by="test")
    seen = cache.read(POLICY.new_cost_model(), POLICY, time.time())
    assert (cache.full_reads, cache.changed) == (1, 2)
    assert seen.records[ids[1]].state is JobState.SUSPENDED and seen.records[ids[0]].level == 2
    # when the stream is trimmed past the cache's last read, then every record is read again
    store.set_fields(ids[2], level=1, level_mark_s=1.0)
    redis_client.xtrim(keys.CHANGES, maxlen=0)
    seen = cache.read(POLICY.new_cost_model(), POLICY, time.time())
    assert (cache.full_reads, cache.changed) == (2, 10) and seen.records[ids[2]].level == 1


def test_a_long_running_jobs_own_chunk_time_follows_its_commits_without_rereading_events(
        redis_client: redis.Redis) -> None:
    # given a job running chunk after chunk under one claim, long-running at the tick's clock
    store = JobStore(redis_client)
    spec = JobSpec(kind="simulated", params={"steps": 6, "step_ms": 1})
    job_id, _ = create_job(store, spec, tenant="t", tier="standard", num_chunks=6, cost_key="sim",
                           cost_units=[1.0, 2.0, 1.0, 2.0, 1.0, 2.0], deadline_s=60,
                           now_s=time.time(), queue="interactive")
    store.transition(job_id, JobState.QUEUED, by="test")
    claim_chunk(store, job_id, 0, 0, "w", LEASE_S)
    cache = SnapshotCache(store)
    owns = []
    for i in range(5):
        r = store.record(job_id)
        store.commit(CommitRequest(job_id, chunk=r.next_chunk, epoch=r.epoch, seq=r.seq,
                                   complete=True, checkpoint=b"c", service_s=0.1 * (i + 1) ** 2,
                                   worker="w", then_continue=True))
        now = time.time() + 1000.0
        # when the tick reads after each commit
        folded = cache.read(POLICY.new_cost_model(), POLICY, now).snapshot.jobs[0]
        full = read_snapshot(store, POLICY.new_cost_model(), POLICY, now).snapshot.jobs[0]
        # then the cache's own median is the one the event stream gives
        assert folded.own_s_per_unit == full.own_s_per_unit
        owns.append(folded.own_s_per_unit)
    assert owns[:2] == [None, None] and None not in owns[2:] and len(set(owns[2:])) == 3
    assert cache.full_reads == 1
