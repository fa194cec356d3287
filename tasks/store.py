"""The job store in Redis: job records, the lifecycle, per-job event streams, checkpoints.

Every state change is one Lua script, so checks and writes are atomic: a transition is checked
against the lifecycle table and, for racing writers, against what the writer last saw (state,
epoch, sequence number); a chunk commit is a compare-and-set on the sequence number that also
takes the job's next step — hop, stop or finish — in the same script, so no other writer can
slip between a job's last commit and its end. The scripts are files in ``tasks/lua/``
(:mod:`tasks.scripts`).
"""


from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from scheduler.errors import IllegalTransition
from scheduler.lifecycle import JobState
from tasks import keys, scripts
from tasks.errors import JobNotFound, RedisUnavailable
from tasks.record import JobRecord, encode, field_name
from tasks.script_batch import ScriptPipeline
from tasks.store_calls import (
    ClaimRequest,
    Commit,
    CommitRequest,
    NewJob,
    as_commit_request,
    claim_call,
    claimed_of,
    commit_call,
    commit_of,
    flat_fields,
    flat_json,
    joiners_of,
    text,
)
from tasks.store_reads import JobReads

log = logging.getLogger(__name__)


def mark_changed(pipe: Any, job_id: str) -> None:
    """Queue on ``pipe`` (after the write to the job's record, or in its MULTI) the mark the
    scripts' ``changed`` writes: the tick folds a record only when marked, so a write of a live
    record without its mark would never reach the scheduler's snapshot. The record's revision
    is bumped as the scripts bump it, but the mark cannot carry the new one (a MULTI has no
    replies to use): the tick reads the record whatever revision it holds."""
    pipe.hincrby(keys.job(job_id), "rev", 1)
    pipe.xadd(keys.CHANGES, {"k": keys.job(job_id)}, maxlen=keys.CHANGES_MAXLEN,
              approximate=True)


def queue_lease_renewal(pipe: Any, job_ids: Iterable[str], lease_s: float) -> None:
    """Queue on ``pipe`` a renewal of each running job's lease, ``lease_s`` from now, with its
    mark (the worker's heartbeat sends it for the jobs it runs)."""
    lease = encode(lease_until_s=time.time() + lease_s)
    for job_id in job_ids:
        pipe.hset(keys.job(job_id), mapping=lease)
        mark_changed(pipe, job_id)


class JobStore(JobReads):
    """Jobs in Redis: the reads of :class:`JobReads` and every write. All methods are safe to
    call from any process."""

    def __init__(self, client: redis.Redis, *, commit_replicas: int = 0,
                 commit_replica_timeout_s: float = 0.5, broker: redis.Redis | None = None) -> None:
        super().__init__(client, broker=broker)
        self.commit_replicas = commit_replicas  # a commit waits for them (WAIT); 0: none
        self.commit_replica_timeout_ms = max(1, round(commit_replica_timeout_s * 1000))
        self._transition = scripts.register(client, "transition")
        self._create = scripts.register(client, "create")
        self._claim = scripts.register(client, "claim")
        self._commit = scripts.register(client, "commit")
        self._first_estimate = scripts.register(client, "first_estimate")
        self._flag_preempt = scripts.register(client, "flag_preempt")
        self._update_as_seen = scripts.register(client, "update_as_seen")
        self._set_fields = scripts.register(client, "set_fields")
        self._fail_unreadable = scripts.register(client, "fail_unreadable")
        self._batch_join = scripts.register(client, "batch_join")
        self._batch_take = scripts.register(client, "batch_take")

    # create -----------------------------------------------------------------------------------
    def create_many(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool, JobRecord | None]]:
        """Store each new PENDING job in one round trip (all of them then wait for
        ``commit_replicas``): (job id, created, the record as stored; None for an
        idempotency-key replay, whose id is the first job's) per job, in order."""
        if not jobs:
            return []
        pipe = ScriptPipeline(self.redis)
        written: list[dict[str, str]] = []
        for job in jobs:
            written.append(job.fields(uuid.uuid4().hex[:16]))
            keys_, args = job.create_call(written[-1]["id"], written[-1])
            pipe.script(self._create, keys_, args)
        if self.commit_replicas:
            self._wait_for_replicas(pipe)
        replies = pipe.execute()
        if self.commit_replicas and int(replies[-1]) < self.commit_replicas:
            # a failover could drop them: never accept them
            raise RedisUnavailable(
                f"{len(jobs)} new job(s) reached {replies[-1]} of {self.commit_replicas} "
                "replicas; submit again (with the same idempotency keys, to get the jobs "
                "that survived)")
        out: list[tuple[str, bool, JobRecord | None]] = []
        for (status, value), fields in zip(replies, written, strict=False):
            job_id, created = text(value), text(status) == "ok"
            out.append((job_id, created, JobRecord.from_hash(fields) if created else None))
        return out

    def set_policy(self, policy: str | None) -> None:
        """Switch every submitter and the tick to another policy (None: back to the settings)."""
        if policy is None:
            self.redis.delete(keys.POLICY)
        else:
            self.redis.set(keys.POLICY, policy)

    # lifecycle --------------------------------------------------------------------------------
    def transition(
        self,
        job_id: str,
        target: JobState,
        *,
        by: str,
        reason: str = "",
        expect: Mapping[str, str] | None = None,
        updates: Mapping[str, str] | None = None,
        now_s: float | None = None,
    ) -> bool:
        """Move a job to ``target``. Raises :class:`IllegalTransition` if the lifecycle table
        forbids it; returns False (and changes nothing) if a field in ``expect`` differs (an
        absent field reads as ``""``)."""
        options = scripts.json_arg(expect=dict(expect or {}) or None,
                                   set=flat_fields(updates or {}) or None)
        reply = self._transition(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE,
                  keys.CHANGES, ""],
            args=[target.value, repr(now_s or time.time()), by, reason, options, ""],
        )
        status, current = text(reply[0]), reply[1]
        if status == "missing":
            raise JobNotFound(f"no job {job_id}")
        if status == "illegal":
            raise IllegalTransition(job_id, text(current), target.value)
        return status == "ok"

    def try_transition(self, job_id: str, target: JobState, **kwargs: Any) -> bool:
        """:meth:`transition` for racing callers: an illegal move is a no-op that returns False."""
        try:
            return self.transition(job_id, target, **kwargs)
        except IllegalTransition as exc:
            log.debug("job %s: %s", job_id, exc)
            return False

    def transition_as_seen(
        self, seen: JobRecord, target: JobState, *, by: str, reason: str,
        expect: Mapping[str, str] | None = None, updates: Mapping[str, str] | None = None,
    ) -> bool:
        """Move a job only if it is still exactly as ``seen`` (its state, epoch and sequence
        number, plus ``expect``): a job that committed, finished or moved since is left alone
        and returns False. The tick and the watchdog act through this."""
        fence = encode(state=seen.state, epoch=seen.epoch, seq=seen.seq)
        return self.try_transition(seen.job_id, target, by=by, reason=reason,
                                   expect={**fence, **(expect or {})}, updates=updates)

    def update_as_seen(self, seen: JobRecord, **values: Any) -> bool:
        """Write record attributes only if the job is still as ``seen`` (state, epoch, seq)."""
        return bool(self._update_as_seen(
            keys=[keys.job(seen.job_id), keys.CHANGES],
            args=[seen.state.value, str(seen.epoch), str(seen.seq), flat_json(encode(**values))]))

    def fail_unreadable(self, job_id: str, reason: str) -> bool:
        """Take a record nobody can parse out of the live set, FAILED with ``reason``; False if
        it had already ended."""
        return bool(self._fail_unreadable(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE,
                  keys.CHANGES],
            args=[job_id, reason[:500], repr(time.time())]))

    def set_fields(self, job_id: str, **values: Any) -> None:
        """Write record attributes (typed, encoded by the record's codecs)."""
        self._set_fields(keys=[keys.job(job_id), keys.CHANGES],
                         args=[flat_json(encode(**values))])

    def request_cancel(self, job_id: str) -> JobState:
        """Cancel a job: at once unless a worker is running one of its chunks, in which case it
        stops at the next chunk (or block-group) boundary. Returns the state after the call."""
        self.record(job_id)  # raises JobNotFound
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.job(job_id), "cancel", "1")
        mark_changed(pipe, job_id)
        pipe.execute()
        for waiting in (JobState.PENDING, JobState.QUEUED, JobState.SUSPENDED, JobState.PREEMPTED):
            if self.try_transition(
                job_id, JobState.CANCELLED, by="client", reason="cancelled by client",
                expect=encode(state=waiting),
            ):
                break
        return self.state(job_id)

    def request_preempt(self, job_id: str, *, state: JobState, epoch: int) -> bool:
        """Flag the job's running attempt to stop at its next boundary, only if the job is
        still in ``state`` at ``epoch`` (what the caller saw)."""
        return bool(self._flag_preempt(keys=[keys.job(job_id), keys.CHANGES],
                                       args=[state.value, str(epoch)]))

    # chunks -----------------------------------------------------------------------------------
    def claim_chunks(
        self, members: Sequence[tuple[str, int, int]], worker: str, lease_s: float, *,
        take_joiners_of: str | None = None,
        cached_seqs: Mapping[str, tuple[int | None, str]] | None = None,
    ) -> tuple[list[JobRecord | str], list[tuple[str, int, int]], dict[str, bytes]]:
        """Fence each chunk message (job id, chunk, epoch) with the claim script, in one round
        trip: each job is fenced on its own, its record as claimed or why the claim is stale,
        and comes with its durable checkpoint unless ``cached_seqs`` (job id → sequence number
        and commit id of the state held; a sequence number None: it wants none) says the caller
        holds its state (a job missing from it: none held; a job at sequence 0 has none).
        With ``take_joiners_of``, that batch's joiners are taken in the same round trip, the
        batch going on (:meth:`take_joiners`); returns (claims, joiners, checkpoints by job
        id)."""
        pipe = ScriptPipeline(self.redis)
        self._take_in(pipe, take_joiners_of, lease_s)
        now = repr(time.time())
        held = cached_seqs or {}
        for job_id, chunk, epoch in members:
            seq, commit_id = held.get(job_id, (-1, ""))
            request = ClaimRequest(job_id, chunk, epoch, worker, lease_s, seq, commit_id)
            pipe.script(self._claim, *claim_call(request, now))
        replies = pipe.execute()
        joiners = joiners_of(replies.pop(0)) if take_joiners_of is not None else []
        claimed: list[JobRecord | str] = []
        checkpoints: dict[str, bytes] = {}
        for (job_id, _, _), reply in zip(members, replies, strict=True):
            record, blob = claimed_of(reply)
            claimed.append(record)
            if blob is not None:
                checkpoints[job_id] = blob
        return claimed, joiners, checkpoints

    def _take_in(self, pipe: ScriptPipeline, batch_id: str | None, lease_s: float) -> None:
        if batch_id is not None:
            pipe.script(self._batch_take, [keys.batch_open(batch_id), keys.batch_joins(batch_id)],
                        ["1", max(int(lease_s * 1000), 1)])

    def join_batch(self, batch_id: str, job_id: str, chunk: int, epoch: int) -> bool:
        """Put a released job into an in-flight batch: its worker takes it at the batch's next
        step boundary. False when the batch has ended (publish the job on its own then)."""
        member = json.dumps([job_id, chunk, epoch])
        return bool(self._batch_join(keys=[keys.batch_open(batch_id), keys.batch_joins(batch_id)],
                                     args=[member]))

    def take_joiners(self, batch_id: str, *, keep: bool, lease_s: float
                     ) -> list[tuple[str, int, int]]:
        """The jobs released into the batch since the last take; ``keep`` renews the batch's
        open mark (it goes on), else closes it (later joins are refused)."""
        raw = self._batch_take(keys=[keys.batch_open(batch_id), keys.batch_joins(batch_id)],
                               args=["1" if keep else "0", max(int(lease_s * 1000), 1)])
        return joiners_of(raw)

    def commit(self, request: CommitRequest) -> Commit:
        """Compare-and-set the job's cursor and take its next step in one script: the last
        chunk's commit is its DONE, a flagged job stops, any other job hops to its next chunk's
        queue (pushing ``request.next_message`` there when given) or, atomic, keeps running."""
        keys_, args = commit_call(request)
        if not self.commit_replicas:
            return commit_of(self._commit(keys=keys_, args=args), request.commit_id)
        pipe = ScriptPipeline(self.redis)
        pipe.script(self._commit, keys_, args)
        self._wait_for_replicas(pipe)
        reply, replicas = pipe.execute()
        self._check_replicas([request.job_id], replicas)
        return commit_of(reply, request.commit_id)

    def _wait_for_replicas(self, pipe: ScriptPipeline) -> None:
        """``WAIT`` on the commit's own connection (WAIT counts that client's writes), last."""
        pipe.command("execute_command", "WAIT", self.commit_replicas,
                     self.commit_replica_timeout_ms)

    def _check_replicas(self, job_ids: Sequence[str], replicas: Any) -> None:
        if int(replicas) < self.commit_replicas:
            log.warning("jobs %s: the commit reached %s of %d replicas in %d ms; a failover now "
                        "replays the chunk from its previous checkpoint", ",".join(job_ids),
                        replicas, self.commit_replicas, self.commit_replica_timeout_ms)

    def commit_chunks(
        self, requests: Sequence[CommitRequest | tuple[str, Mapping[str, Any]]], *,
        take_joiners_of: str | None = None, lease_s: float = 10.0,
        timing: tuple[str, str, float] | None = None,
    ) -> tuple[list[Commit], list[tuple[str, int, int]]]:
        """:meth:`commit` of each request (or (job id, its fields)), in one round trip; each
        job's commit is its own script, as alone. With ``take_joiners_of``, that batch's
        joiners are taken after the commits in the same round trip, the batch going on (close
        it with :meth:`take_joiners` if nothing does); returns (commits, joiners). ``timing``
        (cost key, device, seconds per unit) is one more sample for the cost model (a batched
        step's)."""
        pipe = ScriptPipeline(self.redis)
        commits = [as_commit_request(request) for request in requests]
        for request in commits:
            pipe.script(self._commit, *commit_call(request))
        if timing is not None:
            cost_key, device, s_per_unit = timing
            pipe.command("xadd", keys.TIMINGS, {"cost_key": cost_key, "device": device,
                                                "s_per_unit": repr(s_per_unit)},
                         maxlen=10000, approximate=True)
        self._take_in(pipe, take_joiners_of, lease_s)
        if self.commit_replicas:
            self._wait_for_replicas(pipe)
        replies = pipe.execute()
        if self.commit_replicas:
            self._check_replicas([request.job_id for request in commits], replies.pop())
        joiners = joiners_of(replies.pop()) if take_joiners_of is not None else []
        if timing is not None:
            replies.pop()
        return [commit_of(reply, request.commit_id)
                for reply, request in zip(replies, commits, strict=True)], joiners

    def keep_first_estimate(self, job_id: str, estimate_s: float) -> None:
        """Record the scheduler's first estimate of the job's whole service time, once, and
        only on a record that still exists (never recreating a deleted job's hash)."""
        self._first_estimate(keys=[keys.job(job_id), keys.CHANGES],
                             args=[field_name("first_estimate_s"), repr(estimate_s)])

