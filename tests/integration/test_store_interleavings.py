"""Every writer of a job record (tick, watchdog, workers, client) interleaved in random orders on a
real redis-server (hypothesis stateful): no order loses a job, reruns a chunk or revives an end,
and no write escapes the change stream the tick's kept snapshot folds — including a write that
lands right before or after one of the tick's own, which the snapshot folds without reading."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import hypothesis
import pytest
import redis
from hypothesis import HealthCheck
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from scheduler.lifecycle import TRANSITIONS, JobState
from tasks import keys
from tasks.record import JobRecord, encode
from tasks.script_batch import ScriptBatch
from tasks.snapshot import SnapshotCache
from tasks.spec import JobSpec
from tasks.store import JobStore
from tasks.store_calls import Commit, CommitRequest, CommitStatus
from tests.store_steps import claim_chunk, create_job, renew_lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WAITING = frozenset({JobState.PENDING, JobState.SUSPENDED, JobState.PREEMPTED})
"""States the tick releases (a waiting job needs no message to be reachable)."""
CANCELLABLE = frozenset({JobState.PENDING, JobState.QUEUED, JobState.SUSPENDED,
                         JobState.PREEMPTED})
"""States a client's cancel ends at once (a running job stops at its next boundary)."""
LIVE = frozenset(s for s in JobState if not s.is_terminal)
TICK_ACTIONS = [
    "read every live record", "read every live record", "release", "release", "release",
    "release, new epoch", "requeue", "requeue to standby", "watchdog requeue", "watchdog requeue",
    "suspend", "suspend", "preempt", "preempt", "standby in place", "level", "expire", "fail",
]
"""What the tick (and its watchdog) does to a job it saw, as often as listed."""
TICK_SOURCES = {"release": WAITING, "release, new epoch": WAITING,
                "requeue": frozenset({JobState.QUEUED}),
                "requeue to standby": frozenset({JobState.QUEUED}),
                "watchdog requeue": frozenset({JobState.RUNNING})}
CLIENT_ACTIONS = ["submit", "submit", "submit", "submit", "submit", "cancel"]
WORKER_OUTCOMES = ["commits", "commits", "commits", "commits, yielded", "commits, yielded",
                   "commits, then dies", "stops on a flag seen at claim",
                   "chunk raises", "dies", "renews its lease"]
RACES = ["none", "none", "none", "lease renewed before", "note written before",
         "lease renewed after", "note written after"]
"""Another writer's write of the same record right before the tick's action (after the kept
snapshot last read it) or right after it (before the snapshot's next fold)."""
TICK_QUEUE = "sl:test:tick-queue"
"""Where the tick's releases push their message (with the move, as direct publish does)."""
DELIVERIES = ["once", "twice at once", "again later"]
"""At-least-once delivery: two workers claim one message, or a copy is delivered later."""
CHUNKS = st.integers(min_value=1, max_value=4)
ATOMIC = st.sampled_from([False, False, False, True])
"""A quarter of the jobs run every chunk in one task (the FIFO baseline's atomic jobs)."""
MAX_LIVE = 3
MAX_JOBS = 8
CLASS_QUEUE = "interactive"
STANDBY = "standby"
LEASE_S = 30.0
SHRINK_S = 90
"""Hypothesis' cap on shrinking a failure (its own is five minutes, past the test's timeout)."""
PICK = st.integers(min_value=0, max_value=15)
"""An index into one of the model's lists (modulo its length): shrinks toward the first item."""


@dataclass(frozen=True, slots=True)
class Message:
    """A chunk message on the broker: only references, as ``publish_chunk`` sends them."""

    job_id: str
    chunk: int
    epoch: int


@dataclass(slots=True)
class Attempt:
    """A worker running a claimed chunk; it holds its message unacked until it ends."""

    worker: str
    message: Message
    claimed: JobRecord
    chunk: int
    seq: int


@dataclass(slots=True)
class JobModel:
    num_chunks: int
    atomic: bool
    commits: int = 0
    first_terminal: JobState | None = None


def _step(rule_body: Callable[..., None]) -> Callable[..., None]:
    """Mark the machine unsettled while a rule runs: the drain at teardown only runs on a
    machine whose last step and invariants passed (not over a failure being reported)."""

    @functools.wraps(rule_body)
    def run(self: StoreInterleavings, **kwargs: Any) -> None:
        self.settled = False
        rule_body(self, **kwargs)

    return run


T = TypeVar("T")


def _pick(items: list[T], index: int) -> T:
    return items[index % len(items)]


def _state(fields: dict[str, str]) -> JobState:
    return JobState(fields["state"])


def _fence(seen: JobRecord) -> dict[str, str]:
    return encode(state=seen.state, epoch=seen.epoch, seq=seen.seq)


def _matches(fields: dict[str, str], expect: dict[str, str]) -> bool:
    """Whether a raw record matches ``expect`` (an absent field reads as "", as in the store)."""
    return all(fields.get(name, "") == value for name, value in expect.items())


def _commit_outcome(fields: dict[str, str], attempt: Attempt, complete: bool,
                    checkpoint: bool, atomic: bool) -> CommitStatus:
    """What a chunk commit must do to the record as it is now (the store's contract)."""
    claim = encode(state=JobState.RUNNING, epoch=attempt.message.epoch, seq=attempt.seq,
                   next_chunk=attempt.chunk)
    if not _matches(fields, claim):
        return CommitStatus.STALE
    last = complete and attempt.chunk + 1 == int(fields["num_chunks"])
    cancel = fields["cancel"] == "1"
    stop = cancel or fields["preempt"] == "1" or not complete
    if stop and not last and not checkpoint:
        return CommitStatus.NEEDS_CHECKPOINT
    if last:
        return CommitStatus.DONE
    if cancel:
        return CommitStatus.CANCELLED
    if stop:
        return CommitStatus.PREEMPTED
    return CommitStatus.CONTINUE if atomic else CommitStatus.HOP


class StoreInterleavings(RuleBasedStateMachine):
    """The model: jobs, the broker's bag of in-flight messages, workers' live attempts and the
    tick's view (the records it read last, acted on steps later, whatever ran in between)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        client.flushdb()
        self.store = JobStore(client)
        self.jobs: dict[str, JobModel] = {}
        self.bag: list[Message] = []
        self.attempts: list[Attempt] = []
        self.view: dict[str, JobRecord] = {}
        self.live: list[str] = []
        """The jobs not yet terminal at the last check of the invariants."""
        self.names = itertools.count()
        self.settled = True
        self.cache = SnapshotCache(self.store)
        """The scheduler worker's snapshot, folding in only the records marked as changed."""

    # helpers: the workers' and the tick's code paths, over the real store ----------------------
    def _publish(self, job_id: str, chunk: int, epoch: int) -> None:
        """``dispatch.publish_chunk``: the message, then the record's note of it."""
        self.bag.append(Message(job_id, chunk, epoch))
        self.store.set_fields(job_id, published=chunk,
                              last_task_id=f"{job_id}.{chunk}.{epoch}.{next(self.names)}")

    def _tick_sends(self, queue: Callable[[ScriptBatch], None]) -> bool:
        """One of the tick's writes as its apply sends it (the fenced script, in a batch), and
        what it wrote folded into the kept snapshot as the tick folds its own, unread."""
        batch = ScriptBatch(self.store)
        queue(batch)
        [sent] = batch.execute()
        self.cache.fold_written(batch.written)
        return sent

    def _as_seen(self, seen: JobRecord, target: JobState, *, by: str, reason: str,
                 expect: dict[str, str] | None = None, updates: dict[str, str] | None = None,
                 push: tuple[str, str] | None = None, tick: bool = False) -> bool:
        """``transition_as_seen`` (the tick's: through its batch, with ``push``), checked: it
        moves the job if and only if the job is still as seen (state, epoch, seq and
        ``expect``) and the lifecycle allows the move."""
        now = self.store.fields(seen.job_id)
        moves = (_matches(now, {**_fence(seen), **(expect or {})})
                 and target in TRANSITIONS[_state(now)])
        if tick:
            moved = self._tick_sends(lambda batch: batch.transition_as_seen(
                seen, target, by=by, reason=reason, expect=expect, updates=updates, push=push))
        else:
            assert push is None, "only the tick's batch pushes with the move"
            moved = self.store.transition_as_seen(seen, target, by=by, reason=reason,
                                                  expect=expect, updates=updates)
        assert moved == moves, f"{target.value} as seen {_fence(seen)}, {expect}: {now}"
        return moved

    def _flag_preempt(self, seen: JobRecord) -> None:
        """The tick's ``request_preempt``, checked: a flag only for the attempt the tick saw
        (same state and epoch)."""
        now = self.store.fields(seen.job_id)
        flags = _matches(now, encode(state=seen.state, epoch=seen.epoch))
        flagged = self._tick_sends(lambda batch: batch.request_preempt(
            seen.job_id, state=seen.state, epoch=seen.epoch))
        assert flagged == flags, f"preempt as seen {_fence(seen)}: {now}"
        assert self.store.fields(seen.job_id)["preempt"] == ("1" if flags else now["preempt"])

    def _update_as_seen(self, seen: JobRecord) -> None:
        now = self.store.fields(seen.job_id)
        updated = self._tick_sends(lambda batch: batch.update_as_seen(seen, queue=STANDBY))
        assert updated == _matches(now, _fence(seen)), f"update as seen {_fence(seen)}: {now}"

    def _cancel(self, job_id: str) -> None:
        """``request_cancel``, checked: a waiting job ends at once, a running one is flagged."""
        before = self.store.state(job_id)
        after = self.store.request_cancel(job_id)
        assert self.store.fields(job_id)["cancel"] == "1"
        assert after is (JobState.CANCELLED if before in CANCELLABLE else before), (before, after)

    def _release(self, seen: JobRecord, *, queue: str, bump_epoch: bool,
                 tick: bool = False) -> bool:
        """``dispatch.release``: QUEUED as seen (a new epoch for a requeue), then publish; the
        tick's (``LiveTarget``, direct publish): the message and the record's note of it go
        with the move, in one script."""
        epoch = seen.epoch + (1 if bump_epoch else 0)
        updates = encode(queue=queue, epoch=epoch, preempt=False, queued_at_s=time.time())
        if tick:
            task_id = f"{seen.job_id}.{seen.next_chunk}.{epoch}.{next(self.names)}"
            updates.update(encode(published=seen.next_chunk, last_task_id=task_id))
            moved = self._as_seen(seen, JobState.QUEUED, by="scheduler",
                                  reason=f"released to {queue}", updates=updates,
                                  push=(TICK_QUEUE, task_id), tick=True)
            if moved:
                self.bag.append(Message(seen.job_id, seen.next_chunk, epoch))
            return moved
        moved = self._as_seen(seen, JobState.QUEUED, by="scheduler",
                              reason=f"released to {queue}", updates=updates)
        if moved:
            self._publish(seen.job_id, seen.next_chunk, epoch)
        return moved

    def _requeue_lost(self, seen: JobRecord) -> bool:
        """``dispatch.requeue_from_checkpoint``: the watchdog's requeue of a lapsed lease."""
        same_attempt = encode(chunk_started_at_s=seen.chunk_started_at_s,
                              last_task_id=seen.last_task_id)
        updates = encode(epoch=seen.epoch + 1, queued_at_s=time.time(), running_on=None,
                         queue=CLASS_QUEUE)
        moved = self._as_seen(seen, JobState.QUEUED, by="watchdog", reason="lease lapsed",
                              expect=same_attempt, updates=updates)
        if moved:
            self._publish(seen.job_id, seen.next_chunk, seen.epoch + 1)
        return moved

    def _claim(self, message: Message) -> Attempt | None:
        """``chunks.execute_chunk``: fence the message; a stale one republishes a successor a
        dead worker committed but never published (``_republish_if_lost``)."""
        worker = f"w{next(self.names)}"
        now = self.store.fields(message.job_id)
        claims = (_state(now) in (JobState.QUEUED, JobState.RUNNING)
                  and _matches(now, encode(epoch=message.epoch, next_chunk=message.chunk))
                  and message.chunk < int(now["num_chunks"]))
        claimed = claim_chunk(self.store, message.job_id, message.chunk, message.epoch, worker,
                              LEASE_S)
        assert isinstance(claimed, str) != claims, f"claim {message}: {claimed}; was {now}"
        if isinstance(claimed, str):
            job = self.store.record(message.job_id)
            nxt = job.next_chunk
            published = job.published if job.published is not None else -1
            if (job.state is JobState.QUEUED and job.epoch == message.epoch
                    and nxt == message.chunk + 1 and published < nxt):
                self._publish(job.job_id, nxt, message.epoch)
            return None
        assert claimed.state is JobState.RUNNING, claimed
        assert (claimed.next_chunk, claimed.epoch) == (message.chunk, message.epoch), claimed
        assert claimed.running_on == worker
        attempt = Attempt(worker, message, claimed, message.chunk, claimed.seq)
        self.attempts.append(attempt)
        return attempt

    def _commit(self, attempt: Attempt, *, complete: bool, checkpoint: bool,
                dies: bool = False) -> Commit:
        """``chunks.commit_result`` and the step after it: retry with a checkpoint when the store
        asks for one; a hop publishes the next chunk, an atomic job keeps running. A worker that
        ``dies`` right after its commit publishes nothing, and its message is redelivered."""
        job = self.jobs[attempt.message.job_id]
        for with_checkpoint in (checkpoint, True):
            seq, nxt = attempt.seq + 1, attempt.chunk + int(complete)
            now = self.store.fields(attempt.message.job_id)
            expected = _commit_outcome(now, attempt, complete, with_checkpoint, job.atomic)
            commit = self.store.commit(CommitRequest(
                attempt.message.job_id, chunk=attempt.chunk, epoch=attempt.message.epoch,
                seq=attempt.seq, complete=complete,
                checkpoint=f"seq={seq} chunk={nxt}".encode() if with_checkpoint else None,
                service_s=0.001, worker=attempt.worker, hop_queues={},
                then_continue=job.atomic))
            assert commit.status is expected, f"{attempt}: {commit}, expected {expected}: {now}"
            if commit.status is not CommitStatus.NEEDS_CHECKPOINT:
                break
            assert not with_checkpoint, "a commit with a checkpoint never asks for one"
        if commit.status is CommitStatus.STALE:
            self.attempts.remove(attempt)
            return commit
        job.commits += 1
        assert (commit.seq, commit.next_chunk) == (seq, nxt), commit
        assert commit.status is not CommitStatus.DONE or nxt == job.num_chunks, commit
        assert commit.status is not CommitStatus.HOP or commit.queue in (CLASS_QUEUE, STANDBY)
        if dies:
            self.attempts.remove(attempt)
            self.bag.append(attempt.message)
        elif commit.status is CommitStatus.CONTINUE:
            attempt.chunk, attempt.seq = nxt, seq
        else:
            self.attempts.remove(attempt)
            if commit.status is CommitStatus.HOP:
                self._publish(attempt.message.job_id, nxt, attempt.message.epoch)
        return commit

    def _stop(self, attempt: Attempt, target: JobState, reason: str) -> None:
        """``chunks.stop_attempt``: end the claimed attempt without a commit, if nothing moved."""
        self.attempts.remove(attempt)
        job = attempt.claimed
        updates = encode(error=reason) if target is JobState.FAILED else {}
        if target is JobState.PREEMPTED:
            updates = encode(preempt=False, preemptions=job.preemptions + 1,
                             preempted_at_s=time.time())
        expect = encode(state=JobState.RUNNING, epoch=attempt.message.epoch, seq=attempt.seq)
        now = self.store.fields(job.job_id)
        moved = self.store.try_transition(job.job_id, target, by=attempt.worker, reason=reason,
                                          expect=expect, updates=updates)
        assert moved == _matches(now, expect), f"{attempt} stops {target.value}: {now}"

    def _read(self, job_ids: list[str]) -> None:
        """The tick reads records into its view."""
        for seen in self.store.records(job_ids):
            assert isinstance(seen, JobRecord), seen
            self.view[seen.job_id] = seen

    def _new_job(self, num_chunks: int, atomic: bool, released: bool) -> None:
        spec = JobSpec(kind="simulated", params={"steps": num_chunks, "step_ms": 1})
        job_id, created = create_job(
            self.store, spec, tenant="t", tier="standard", num_chunks=num_chunks, cost_key="sim",
            cost_units=[1.0] * num_chunks, deadline_s=60, now_s=time.time(), queue=CLASS_QUEUE,
            atomic=atomic)
        assert created
        self.jobs[job_id] = JobModel(num_chunks, atomic)
        self.live.append(job_id)
        if released:
            assert self._release(self.store.record(job_id), queue=CLASS_QUEUE, bump_epoch=False)

    # the client -------------------------------------------------------------------------------
    @initialize(plans=st.lists(st.tuples(CHUNKS, ATOMIC, st.sampled_from([True, True, False])),
                               min_size=1, max_size=MAX_LIVE))
    def client_submits_jobs(self, plans: list[tuple[int, bool, bool]]) -> None:
        for num_chunks, atomic, released in plans:
            self._new_job(num_chunks, atomic, released)

    @rule(action=st.sampled_from(CLIENT_ACTIONS), job=PICK, num_chunks=CHUNKS, atomic=ATOMIC)
    @_step
    def client_acts(self, action: str, job: int, num_chunks: int, atomic: bool) -> None:
        if action == "cancel" and self.live:
            self._cancel(_pick(self.live, job))
        elif action == "submit" and len(self.live) < MAX_LIVE and len(self.jobs) < MAX_JOBS:
            self._new_job(num_chunks, atomic, released=job % 2 == 0)

    # the tick and the watchdog ----------------------------------------------------------------
    @rule(action=st.sampled_from(TICK_ACTIONS), job=PICK, race=st.sampled_from(RACES))
    @_step
    def tick_acts(self, action: str, job: int, race: str) -> None:
        # on the record as the tick read it last: whatever ran since (a worker's commit between
        # the tick's read and its move is the race that once lost jobs) must fence the move;
        # the tick's own writes go as its apply sends them and are folded into its kept
        # snapshot unread, so another writer's write right before or after one (``race``) must
        # still reach the snapshot
        states = TICK_SOURCES.get(action, LIVE)
        candidates = [r for r in self.view.values() if r.state in states]
        if action == "read every live record" or not candidates:  # a new tick: a new view
            self.view.clear()
            self._read(self.live)
            return
        seen = _pick(candidates, job)
        if race.endswith("before"):
            self._another_writer(seen.job_id, race)
        if action.startswith("release"):
            self._release(seen, queue=CLASS_QUEUE, bump_epoch=action.endswith("epoch"),
                          tick=True)
        elif action.startswith("requeue"):
            self._release(seen, queue=STANDBY if action.endswith("standby") else CLASS_QUEUE,
                          bump_epoch=True, tick=True)
        elif action == "watchdog requeue":  # lapsed or not: a slow worker is fenced as a dead one
            self._requeue_lost(seen)
        elif action == "suspend":
            self._as_seen(seen, JobState.SUSPENDED, by="scheduler",
                          reason="overload convergence: held back", tick=True)
        elif action in ("expire", "fail"):
            ending = JobState.EXPIRED if action == "expire" else JobState.FAILED
            self._as_seen(seen, ending, by="scheduler", reason=action,
                          updates=encode(error=action), tick=True)
        elif action == "preempt":
            self._flag_preempt(seen)
        elif action == "standby in place":
            self._update_as_seen(seen)
        else:  # a blind write of the job's level: it must not disturb the cursor
            self._tick_sends(lambda batch: batch.set_fields(seen.job_id, level=job % 3,
                                                            level_mark_s=1.0))
        if race.endswith("after"):
            self._another_writer(seen.job_id, race)

    def _another_writer(self, job_id: str, race: str) -> None:
        """A blind write of the record by someone else: a worker's lease renewal (a MULTI: its
        mark carries no revision) or a worker's note (a script: its mark carries one)."""
        if race.startswith("lease"):
            renew_lease(self.store, job_id, LEASE_S)
        else:
            self.store.set_fields(job_id, expert_version=f"v{next(self.names)}")

    # workers and the broker (each rule does the other's work when it has none of its own) -------
    @rule(msg=PICK, delivery=st.sampled_from(DELIVERIES), tick_reads_first=st.booleans())
    @_step
    def worker_takes_a_message(self, msg: int, delivery: str, tick_reads_first: bool) -> None:
        if not self.bag:
            self._run(msg, "commits", checkpoint=True, tick_reads_first=tick_reads_first)
            return
        message = _pick(self.bag, msg)
        if tick_reads_first:  # the tick reads the record just before this worker claims it
            self._read([message.job_id])
        if delivery != "again later":  # else a copy stays on the broker for another worker
            self.bag.remove(message)
        self._claim(message)  # a stale message is acked
        if delivery == "twice at once":
            self._claim(message)

    @rule(att=PICK, outcome=st.sampled_from(WORKER_OUTCOMES), checkpoint=st.booleans(),
          tick_reads_first=st.booleans())
    @_step
    def worker_runs_its_chunk(self, att: int, outcome: str, checkpoint: bool,
                              tick_reads_first: bool) -> None:
        if not self.attempts:
            self.worker_takes_a_message(msg=att, delivery="once",
                                        tick_reads_first=tick_reads_first)
            return
        self._run(att, outcome, checkpoint, tick_reads_first)

    def _run(self, att: int, outcome: str, checkpoint: bool,
             tick_reads_first: bool = False) -> None:
        if not self.attempts:
            return
        attempt = _pick(self.attempts, att)
        if tick_reads_first:  # the tick reads the record just before this worker writes it
            self._read([attempt.message.job_id])
        if outcome.startswith("commits"):  # "yielded": the runner stopped inside the chunk;
            # "dies": the worker is lost between its commit and the publish of the next chunk
            self._commit(attempt, complete="yielded" not in outcome, checkpoint=checkpoint,
                         dies="dies" in outcome)
        elif outcome == "stops on a flag seen at claim":  # (no flag: it runs on)
            if attempt.claimed.cancel:
                self._stop(attempt, JobState.CANCELLED, "cancelled by client")
            elif attempt.claimed.preempt:
                self._stop(attempt, JobState.PREEMPTED, "preempt flag")
        elif outcome == "chunk raises":
            self._stop(attempt, JobState.FAILED, f"chunk {attempt.chunk}: boom")
        elif outcome == "renews its lease":  # a blind write, even after the job moved on
            renew_lease(self.store, attempt.message.job_id, LEASE_S)
        else:  # lost: its unacked message is redelivered
            self.attempts.remove(attempt)
            self.bag.append(attempt.message)

    # invariants -------------------------------------------------------------------------------
    @invariant()
    def every_job_is_consistent_and_reachable(self) -> None:
        done_stream = [f for _, f in self.store.read_stream(keys.DONE)]
        active = set(self.store.active_ids())
        for job_id, model in self.jobs.items():
            self._check_job(job_id, model, active, done_stream)
        self.live = [job_id for job_id, model in self.jobs.items() if model.first_terminal is None]
        self.settled = True

    @invariant()
    def the_tick_sees_every_change(self) -> None:
        # a write of a live record that the change stream does not mark would leave the
        # scheduler's kept snapshot behind the store: it must fold to what a full read reads
        # (tests/integration/test_snapshot_cache.py holds the views to the full read's)
        full = {r.job_id: r for r in self.store.records(self.store.active_ids())}
        assert self.cache.fold() == full, "the tick's kept snapshot missed a change"

    def _check_job(self, job_id: str, model: JobModel, active: set[str],
                   done_stream: list[dict[str, str]]) -> None:
        f = self.store.fields(job_id)
        events = self.store.events(job_id)
        state, nxt, n = JobState(f["state"]), int(f["next_chunk"]), int(f["num_chunks"])
        seq, epoch = int(f["seq"]), int(f["epoch"])
        where = f"job {job_id} ({state.value}, chunk {nxt}/{n}, seq {seq}, epoch {epoch})"
        commits = [e for e in events if e["kind"] == "commit"]
        # 1. each chunk applied at most once, in order: exactly chunks 0..next_chunk-1
        applied = [int(e["chunk"]) for e in commits if e["complete"] == "1"]
        assert applied == list(range(nxt)), f"{where}: chunks applied {applied}"
        # 2. the cursor is in range, and a job past its last chunk is DONE (and only then)
        assert 0 <= nxt <= n, where
        assert (nxt == n) == (state is JobState.DONE), f"{where}: finished but not DONE"
        # 3. a terminal state is final, and the job left the live set once
        if model.first_terminal is None and state.is_terminal:
            model.first_terminal = state
        if model.first_terminal is not None:
            assert state is model.first_terminal, f"{where}: was {model.first_terminal.value}"
        ended = [e["state"] for e in done_stream if e["id"] == job_id]
        if state.is_terminal:
            assert job_id not in active and ended == [state.value], f"{where}: ended {ended}"
        else:
            assert job_id in active and not ended, f"{where}: live but ended {ended}"
        # 4. a live job is reachable: a message for its next chunk is in flight, a worker runs
        #    it (or its lease lapses and the watchdog requeues it), or the tick releases it
        if state is JobState.QUEUED:
            published = int(f.get("published") or -1)
            assert (Message(job_id, nxt, epoch) in self.bag
                    or (Message(job_id, nxt - 1, epoch) in self.bag and published < nxt)), (
                f"{where}: QUEUED with no message in flight ({self.bag})")
        if state is JobState.RUNNING:
            assert f.get("running_on") and f.get("lease_until"), f"{where}: no lease"
        # 5. seq counts the successful commits
        assert seq == model.commits == len(commits), (
            f"{where}: {model.commits} commits made, {len(commits)} logged")
        # 6. the event history is one chain of legal moves ending in the current state
        moves = [(e["from"], e["to"]) for e in events if e["kind"] == "state"]
        assert moves[0] == ("", "PENDING"), moves
        for (_, before), (source, target) in itertools.pairwise(moves):
            assert before == source, f"{where}: broken history {moves}"
            assert JobState(target) in TRANSITIONS[JobState(source)], f"{where}: {moves}"
        assert moves[-1][1] == state.value, f"{where}: history ends {moves[-1]}"
        # 7. the durable checkpoint is the one the record names
        if f.get("ckpt_seq"):
            blob = self.store.load_checkpoint(job_id)
            assert blob == f"seq={f['ckpt_seq']} chunk={f['ckpt_chunk']}".encode(), where
            assert int(f["ckpt_seq"]) <= seq, where

    def teardown(self) -> None:
        if self.settled:
            self._drain()

    def _drain(self) -> None:
        """A healthy system from here on: each round the tick releases waiting jobs and the
        watchdog requeues running ones nobody runs, workers claim every message, then finish
        what they hold, the oldest attempt first. Every job must end, each chunk run once."""
        for _ in range(4 * sum(m.num_chunks for m in self.jobs.values()) + 8):
            self.every_job_is_consistent_and_reachable()
            records = self.store.records(self.jobs)
            assert all(isinstance(r, JobRecord) for r in records), records
            live = [r for r in records if isinstance(r, JobRecord) and not r.state.is_terminal]
            if not live:
                return
            for seen in live:
                running = any((a.message.job_id, a.message.epoch, a.seq)
                              == (seen.job_id, seen.epoch, seen.seq) for a in self.attempts)
                if seen.state in WAITING:
                    assert self._release(seen, queue=CLASS_QUEUE, bump_epoch=False), seen
                elif seen.state is JobState.RUNNING and not running:
                    assert self._requeue_lost(seen), seen
            while self.bag:
                self._claim(self.bag.pop(0))
            while self.attempts:
                self._commit(self.attempts[0], complete=True, checkpoint=True)
        raise AssertionError(f"jobs never finished: {self.store.records(self.jobs)}")


def _search(client: redis.Redis, max_examples: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", SHRINK_S, raising=False)

    class OnTheTestServer(StoreInterleavings):
        def __init__(self) -> None:
            super().__init__(client)

    run_state_machine_as_test(
        OnTheTestServer,
        settings=hypothesis.settings(
            max_examples=max_examples, stateful_step_count=40, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow]),
    )


def test_no_interleaving_of_the_writers_loses_a_job_or_runs_a_chunk_twice(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given jobs of 1-4 chunks on a real redis-server; when the tick (acting on records it read
    # steps earlier), the watchdog, workers (duplicate deliveries, deaths, commits with and
    # without checkpoints) and the client interleave in any order; then after every step each
    # chunk ran at most once, finished jobs are DONE, terminal states hold, live jobs are
    # reachable, seq counts the commits, and a healthy system finishes every job from there
    _search(redis_client, 200, monkeypatch)


def test_the_interleavings_hold_on_a_machine_busy_with_other_work(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given two processes burning the CPUs the test and redis-server run on
    # (each in its own session: with per-session CPU grouping they would otherwise count as one)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                start_new_session=True) for _ in range(2)]
    try:
        # when the same search runs, shorter; then the same invariants hold
        _search(redis_client, 30, monkeypatch)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=10)
