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
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, cast

import redis

from scheduler.errors import IllegalTransition
from scheduler.lifecycle import TRANSITIONS, JobState
from scheduler.model import ResourceProfile
from tasks import keys, scripts
from tasks.errors import HeartbeatError, JobNotFound, RedisUnavailable
from tasks.heartbeat import Heartbeat
from tasks.record import JobRecord, UnreadableRecord, encode, field_name
from tasks.spec import JobSpec

log = logging.getLogger(__name__)

for _source, _target in ((JobState.RUNNING, JobState.DONE), (JobState.RUNNING, JobState.QUEUED),
                         (JobState.RUNNING, JobState.PREEMPTED),
                         (JobState.RUNNING, JobState.CANCELLED)):
    assert _target in TRANSITIONS[_source], "the commit script's moves must be legal"


def _commit_call(request: CommitRequest) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the commit script (``tasks/lua/commit.lua``)."""
    job_id = request.job_id
    keys_ = [keys.job(job_id), keys.job_checkpoint(job_id), keys.job_events(job_id),
             keys.ACTIVE, keys.DONE, keys.TIMINGS, keys.CHANGES, keys.FAIR_SERVICE]
    args = [
        request.chunk, request.epoch, request.seq, int(request.complete),
        int(request.checkpoint is not None), request.checkpoint or b"",
        repr(request.service_s), repr(time.time()), request.worker, request.task_id,
        _commit_options(request), request.commit_id,
    ]
    return keys_, args


def _commit_options(request: CommitRequest) -> str:
    """The commit's optional values as the script's one JSON argument."""
    timing: dict[str, str] | None = None
    if request.timing is not None:
        device, s_per_unit = request.timing
        timing = {"device": device, "s_per_unit": repr(s_per_unit)}
        if request.timing_key:
            timing["cost_key"] = request.timing_key
    message = request.next_message
    return scripts.json_arg(
        then_continue=request.then_continue or None, artifact=request.artifact,
        timing=timing, hop_queues=dict(request.hop_queues) or None,
        yielded=request.yielded or None,
        next_message=None if message is None else
        {"task_id": message.task_id, "before": message.before, "after": message.after})


def _claim_call(request: ClaimRequest, now: str) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the claim script (``tasks/lua/claim.lua``)."""
    job_id = request.job_id
    held = "" if request.cached_seq is None else request.cached_seq
    return ([keys.job(job_id), keys.job_events(job_id), keys.job_checkpoint(job_id),
             keys.CHANGES],
            [request.chunk, request.epoch, request.worker, now, request.lease_s, held,
             request.cached_commit])


def _as_request(request: CommitRequest | tuple[str, Mapping[str, Any]]) -> CommitRequest:
    if isinstance(request, CommitRequest):
        return request
    job_id, fields = request
    return CommitRequest(job_id, **fields)


def _joiners(raw: Any) -> list[tuple[str, int, int]]:
    joiners = []
    for item in raw:
        job_id, chunk, epoch = json.loads(item)
        joiners.append((str(job_id), int(chunk), int(epoch)))
    return joiners


def _commit_of(reply: Any, commit_id: str) -> Commit:
    """A commit script's reply; ``commit_id`` the request's, kept when the commit landed."""
    status = CommitStatus(_text(reply[0]))
    if len(reply) < 4:
        return Commit(status)
    return Commit(status, seq=int(reply[1]), next_chunk=int(reply[2]), queue=_text(reply[3]),
                  published=_text(reply[4]) or None if len(reply) > 4 else None,
                  replaced=bytes(reply[5]) or None if len(reply) > 5 else None,
                  commit_id=commit_id)


def _claimed(reply: Any) -> tuple[JobRecord | str, bytes | None]:
    """A claim script's reply: the record (or why the claim is stale) and any checkpoint."""
    if _text(reply[0]) != "ok":
        return " ".join(_text(x) for x in reply), None
    flat = reply[1]
    record = JobRecord.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))
    blob = reply[2] if len(reply) > 2 and isinstance(reply[2], bytes) else None
    return record, blob


def mark_changed(pipe: Any, job_id: str) -> None:
    """Queue on ``pipe`` (after the write to the job's record, or in its MULTI) the mark the
    scripts' ``changed`` writes: the tick folds a record only when marked, so a write of a live
    record without its mark would never reach the scheduler's snapshot. The record's revision
    is bumped as the scripts bump it, but the mark cannot carry the new one (a MULTI has no
    replies to use): the tick reads the record whatever revision it holds."""
    pipe.hincrby(keys.job(job_id), "rev", 1)
    pipe.xadd(keys.CHANGES, {"k": keys.job(job_id)}, maxlen=keys.CHANGES_MAXLEN,
              approximate=True)


@dataclass(frozen=True, slots=True)
class Written:
    """A write of a job record that took effect, as its writer knows it: the record's revision
    right after it (``rev``: the write's own mark carries it), the hash fields it set, and
    whether it ended the job (it left the live set). A reader that held the record at
    ``rev - 1`` holds it at ``rev`` by setting ``fields`` (``tasks.snapshot``)."""

    job_id: str
    rev: int
    fields: Mapping[str, str]
    ended: bool = False


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [x for pair in fields.items() for x in pair]


def _flat_json(fields: Mapping[str, str]) -> str:
    """Record fields as one script argument: a JSON list [field, value, ...], in order."""
    return json.dumps(_flat(fields), separators=(",", ":"), ensure_ascii=False)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class CommitStatus(str, Enum):
    """What a chunk commit did."""

    STALE = "stale"
    """Another delivery committed first, or the job moved on: nothing changed."""
    NEEDS_CHECKPOINT = "needs_checkpoint"
    """The job must stop here and the commit carried no durable checkpoint: send one."""
    HOP = "hop"
    """Committed; the job is QUEUED for its next chunk on ``queue``: publish it there."""
    CONTINUE = "continue"
    """Committed; an atomic job stays RUNNING and this worker runs its next chunk."""
    DONE = "done"
    """Committed the last chunk; the job is DONE."""
    PREEMPTED = "preempted"
    """Committed; a preempt flag (or a yield inside the chunk) stopped the job: PREEMPTED."""
    CANCELLED = "cancelled"
    """Committed; the client's cancel stopped the job: CANCELLED."""


@dataclass(frozen=True, slots=True)
class Commit:
    """The outcome of a chunk commit and the job's cursor after it."""

    status: CommitStatus
    seq: int = -1
    next_chunk: int = -1
    queue: str = ""
    published: str | None = None
    """The task id of the next chunk's message when the commit pushed it (a hop given a
    ``next_message``); None when the caller publishes."""
    replaced: bytes | None = None
    """The object-store reference (:mod:`tasks.checkpoint_objects`) that the commit's
    checkpoint took the place of in Redis: nothing reads its object any more. None: the
    commit wrote no checkpoint, or replaced one kept in Redis itself."""
    commit_id: str = ""
    """The id of the state the commit made (``CommitRequest.commit_id``; '' when it did not
    land): with ``seq``, what a worker keeping that state in memory holds it under."""


@dataclass(frozen=True, slots=True)
class NextMessage:
    """The broker message of a job's next chunk, its queue still open: the commit that hops the
    job pushes ``before + <queue name as a JSON string> + after`` onto the list of the queue it
    chooses (``tasks.dispatch.next_chunk_message`` builds it; the store does not know Celery)."""

    task_id: str
    before: str
    after: str

    def for_queue(self, queue: str) -> str:
        """The message as it lands on ``queue``."""
        return self.before + json.dumps(queue) + self.after


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A worker's claim of one chunk message: the message's fence (job, chunk, epoch), who
    claims it and for how long, and the sequence number and commit id of the job's state the
    worker holds in memory (-1: it holds none, so the claim brings the durable checkpoint;
    None: it wants none). The claim brings the checkpoint unless both match the record's: a
    sequence number alone is not a state's identity once a failover has lost a commit and
    its replay reached that sequence number again (:attr:`JobRecord.commit_id`)."""

    job_id: str
    chunk: int
    epoch: int
    worker: str
    lease_s: float
    cached_seq: int | None = -1
    cached_commit: str = ""


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """One chunk's commit and the job's next step (:meth:`JobStore.commit`)."""

    job_id: str
    chunk: int
    epoch: int
    seq: int
    """The sequence number the worker claimed: the commit is a compare-and-set on it."""
    complete: bool
    """The chunk ran to its end (False: it yielded inside, and the job stops here)."""
    checkpoint: bytes | None
    """The job's durable state after the chunk (or a reference to it in the object store,
    :mod:`tasks.checkpoint_objects`), or None when this commit writes none."""
    service_s: float
    """Worker time charged to the job."""
    worker: str
    task_id: str = ""
    hop_queues: Mapping[str, str] = field(default_factory=dict)
    """Class queue → where this worker sends the job's next chunk of that class (its own
    affinity queue); a class not named hops to its class queue."""
    then_continue: bool = False
    """An atomic job stays RUNNING and this worker runs its next chunk."""
    artifact: tuple[str, str] | None = None
    """(name, media type) of the last chunk's stored output."""
    timing: tuple[str, float] | None = None
    """(device, seconds per cost unit) for the cost model, learned under ``timing_key``."""
    timing_key: str = ""
    """The chunk kind's cost key (:func:`scheduler.cost.chunk_cost_key`); the job's cost key
    when empty."""
    next_message: NextMessage | None = None
    """The next chunk's message, pushed by the commit when the job hops
    (``Commit.published``), so a hop is one round trip."""
    yielded: bool = False
    """The chunk (``complete`` False) yielded for work its worker takes first, not for a flag:
    the job stays in flight and hops with the same next chunk (``checkpoint`` required)."""
    commit_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This commit's id, unique: the record keeps it as the id of the state the job is at
    (:attr:`JobRecord.commit_id`), so a worker's memory of a commit a failover lost is never
    taken for the state its replay made at the same sequence number."""

    def with_checkpoint(self, checkpoint: bytes) -> CommitRequest:
        """The same commit carrying the job's durable state (the store asked for one)."""
        return replace(self, checkpoint=checkpoint)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to store as PENDING (:meth:`JobStore.create_many`): its spec, what its plan and
    the submit decision made of it, and the submit time."""

    spec: JobSpec
    tenant: str
    tier: str
    num_chunks: int
    cost_key: str
    cost_units: tuple[float, ...]
    deadline_s: float
    """Seconds from ``now_s`` to its deadline."""
    now_s: float
    queue: str
    atomic: bool = False
    chunk_names: tuple[str, ...] = ()
    resource_profile: ResourceProfile = ResourceProfile.COMPUTE
    events_ttl_s: float | None = None
    batch_group: str | None = None
    batch_growth: float | None = None
    degraded: str | None = None
    """JSON of the degradation admission chose (None: none); its reason is the job's first
    event's."""

    def fields(self, job_id: str) -> dict[str, str]:
        """The record this job is stored as under ``job_id``."""
        spec, now_s = self.spec, self.now_s
        return encode(
            job_id=job_id, kind=spec.kind, state=JobState.PENDING, slo=spec.slo,
            tenant=self.tenant, tier=self.tier, params=spec.params, depends_on=spec.depends_on,
            submitted_at_s=now_s, deadline_at_s=now_s + self.deadline_s,
            num_chunks=self.num_chunks, next_chunk=0, seq=0, epoch=0, queue=self.queue,
            preempt=False, cancel=False, preemptions=0, service_s=0.0, cost_key=self.cost_key,
            cost_units=tuple(self.cost_units), updated_at_s=now_s, atomic=self.atomic,
            chunk_names=tuple(self.chunk_names), resource_profile=self.resource_profile,
            shed_if_late=spec.shed_if_late, events_ttl_s=self.events_ttl_s,
            batch_group=self.batch_group, batch_growth=self.batch_growth,
            degraded=self.degraded,
        )

    def create_call(self, job_id: str, fields: Mapping[str, str]) -> tuple[list[str], list[Any]]:
        """The ``create`` script's keys and arguments for this job under ``job_id``."""
        spec = self.spec
        idem = (keys.idempotency(self.tenant, spec.idempotency_key)
                if spec.idempotency_key else "")
        keys_ = [keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.INDEX, idem,
                 keys.CHANGES]
        note = "accepted" if self.degraded is None else (
            "accepted; " + json.loads(self.degraded)["reason"])
        return keys_, [job_id, repr(self.now_s), _flat_json(fields), note]


class _ScriptPipeline:
    """A pipeline of script calls (and plain commands) in one round trip. redis-py sends a
    ``SCRIPT EXISTS`` for a pipeline's scripts before the pipeline itself — one more round trip
    each time; here scripts go as bare ``EVALSHA``, and a call the server refuses as
    ``NOSCRIPT`` (a restarted or flushed Redis: the call did not run) is sent again with its
    script loaded."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self.calls: list[tuple[Any, list[str], list[Any]] | None] = []

    def script(self, script: Any, keys_: list[str], args: list[Any]) -> None:
        self.pipe.evalsha(script.sha, len(keys_), *keys_, *args)
        self.calls.append((script, keys_, args))

    def command(self, name: str, *args: Any, **kwargs: Any) -> None:
        getattr(self.pipe, name)(*args, **kwargs)
        self.calls.append(None)

    def execute(self) -> list[Any]:
        replies = self.pipe.execute(raise_on_error=False)
        again = [i for i, reply in enumerate(replies)
                 if isinstance(reply, redis.exceptions.NoScriptError) and self.calls[i]]
        if again:
            retry = self.client.pipeline(transaction=False)
            for i in again:
                script, keys_, args = cast(tuple[Any, list[str], list[Any]], self.calls[i])
                script(keys=keys_, args=args, client=retry)  # redis-py loads it first
            for i, reply in zip(again, retry.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return list(replies)


class ScriptBatch:
    """Fenced writes of many jobs sent together, in one round trip per :meth:`execute`: each is
    the script the store's own method sends, fenced the same way, so a job that moved since
    the writer saw it is left alone; :meth:`execute` returns whether each write took effect,
    in the order queued, and adds what each wrote to :attr:`written`. For a tick's thousands
    of actions."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._pipe = _ScriptPipeline(store.redis)
        self._kinds: list[tuple[str, str, Mapping[str, str], bool]] = []
        """Per write: its kind, the job, the fields it sets when it takes effect, whether it
        ends the job."""
        self.written: list[Written] = []
        """The writes that took effect so far, in order, with the revision each left."""

    def __len__(self) -> int:
        return len(self._kinds)

    def transition_as_seen(self, seen: JobRecord, target: JobState, *, by: str, reason: str,
                           expect: Mapping[str, str] | None = None,
                           updates: Mapping[str, str] | None = None,
                           push: tuple[str, str] | None = None) -> None:
        """:meth:`JobStore.transition_as_seen`, queued (an illegal move, or a job gone, is a
        refusal: False). ``push``: (queue, message) pushed with the move (a release's chunk
        message; its note on the record goes in ``updates``)."""
        fence = encode(state=seen.state, epoch=seen.epoch, seq=seen.seq)
        options = scripts.json_arg(expect={**fence, **(expect or {})},
                                   set=_flat(updates or {}) or None)
        job_id, now = seen.job_id, repr(time.time())
        queue, message = push if push is not None else ("", "")
        self._pipe.script(self.store._transition,
                          [keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE,
                           keys.CHANGES, queue],
                          [target.value, now, by, reason, options, message])
        written = {**(updates or {}), "state": target.value, "updated_at": now}
        self._kinds.append(("transition", job_id, written, target.is_terminal))

    def update_as_seen(self, seen: JobRecord, **values: Any) -> None:
        """:meth:`JobStore.update_as_seen`, queued."""
        fields = encode(**values)
        self._pipe.script(self.store._update_as_seen, [keys.job(seen.job_id), keys.CHANGES],
                          [seen.state.value, str(seen.epoch), str(seen.seq), _flat_json(fields)])
        self._kinds.append(("rev", seen.job_id, fields, False))

    def request_preempt(self, job_id: str, *, state: JobState, epoch: int) -> None:
        """:meth:`JobStore.request_preempt`, queued."""
        self._pipe.script(self.store._flag_preempt, [keys.job(job_id), keys.CHANGES],
                          [state.value, str(epoch)])
        self._kinds.append(("rev", job_id, encode(preempt=True), False))

    def keep_first_estimate(self, job_id: str, estimate_s: float) -> None:
        """:meth:`JobStore.keep_first_estimate`, queued (True whether or not an estimate was
        kept already)."""
        name = field_name("first_estimate_s")
        self._pipe.script(self.store._first_estimate, [keys.job(job_id), keys.CHANGES],
                          [name, repr(estimate_s)])
        self._kinds.append(("always", job_id, {name: repr(estimate_s)}, False))

    def set_fields(self, job_id: str, **values: Any) -> None:
        """:meth:`JobStore.set_fields`, queued."""
        fields = encode(**values)
        self._pipe.script(self.store._set_fields, [keys.job(job_id), keys.CHANGES],
                          [_flat_json(fields)])
        self._kinds.append(("always", job_id, fields, False))

    def execute(self) -> list[bool]:
        """Send everything queued in one round trip; whether each write took effect."""
        if not self._kinds:
            return []
        out = []
        for (kind, job_id, fields, ends), reply in zip(self._kinds, self._pipe.execute(),
                                                       strict=True):
            if kind == "transition":
                moved = _text(reply[0]) == "ok"
                rev = int(reply[2]) if moved else 0
            else:
                rev = int(reply)
                moved = kind == "always" or rev > 0
            if rev > 0:
                self.written.append(Written(job_id, rev, fields, ends))
            out.append(moved)
        self._pipe, self._kinds = _ScriptPipeline(self.store.redis), []
        return out


class JobStore:
    """Jobs in Redis. All methods are safe to call from any process."""

    heartbeat_scan_s = 5.0
    """How often :meth:`heartbeats` scans the keyspace for workers that do not register."""

    def __init__(self, client: redis.Redis, *, commit_replicas: int = 0,
                 commit_replica_timeout_s: float = 0.5, broker: redis.Redis | None = None) -> None:
        self.redis = client
        # Celery's queue lists, only read here: another Redis with ``broker.url``, else this one
        self.broker = broker if broker is not None else client
        self.commit_replicas = commit_replicas  # a commit waits for them (WAIT); 0: none
        self.commit_replica_timeout_ms = max(1, round(commit_replica_timeout_s * 1000))
        self._heartbeat_scan: tuple[float, list[str]] = (float("-inf"), [])
        """(when, heartbeat keys found) of the last scan of the keyspace (:meth:`heartbeats`)."""
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
    def create(self, spec: JobSpec, **fields: Any) -> tuple[str, bool]:
        """Store a new PENDING job (``fields``: those of :class:`NewJob`); returns (job id,
        created). An idempotency key seen before for this tenant returns the first job's id
        and ``created=False``."""
        job_id, created, _ = self.create_many([NewJob(spec, **fields)])[0]
        return job_id, created

    def create_many(self, jobs: Sequence[NewJob]) -> list[tuple[str, bool, JobRecord | None]]:
        """Store each new PENDING job in one round trip (all of them then wait for
        ``commit_replicas``): (job id, created, the record as stored; None for an
        idempotency-key replay, whose id is the first job's) per job, in order."""
        if not jobs:
            return []
        pipe = _ScriptPipeline(self.redis)
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
            job_id, created = _text(value), _text(status) == "ok"
            out.append((job_id, created, JobRecord.from_hash(fields) if created else None))
        return out

    # read -------------------------------------------------------------------------------------
    def fields(self, job_id: str) -> dict[str, str]:
        """The job's raw hash (for audits and drills; code that acts on a job reads
        :meth:`record`)."""
        raw = cast(dict[bytes, bytes], self.redis.hgetall(keys.job(job_id)))
        if not raw:
            raise JobNotFound(f"no job {job_id}")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def record(self, job_id: str) -> JobRecord:
        """The job's typed record; raises :class:`JobNotFound` or :class:`UnreadableRecord`."""
        raw = cast(dict[bytes, bytes], self.redis.hgetall(keys.job(job_id)))
        if not raw:
            raise JobNotFound(f"no job {job_id}")
        return JobRecord.from_hash(raw)

    def records(self, job_ids: Iterable[str]) -> list[JobRecord | UnreadableRecord]:
        """Many jobs in one round trip; a job that vanished meanwhile is left out, one that
        cannot be parsed comes back as its :class:`UnreadableRecord`."""
        pipe = self.redis.pipeline(transaction=False)
        ids = list(job_ids)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        out: list[JobRecord | UnreadableRecord] = []
        for job_id, raw in zip(ids, pipe.execute(), strict=True):
            if not raw:
                continue
            try:
                out.append(JobRecord.from_hash(raw))
            except UnreadableRecord as exc:
                out.append(UnreadableRecord(job_id, exc.problem))
        return out

    def many_fields(self, job_ids: list[str]) -> list[dict[str, str]]:
        """Raw hashes of many jobs (for audits and drills)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return [
            {k.decode(): v.decode() for k, v in raw.items()} for raw in pipe.execute() if raw
        ]

    def state(self, job_id: str) -> JobState:
        raw = self.redis.hget(keys.job(job_id), "state")
        if raw is None:
            raise JobNotFound(f"no job {job_id}")
        return JobState(_text(raw))

    def origin_id(self) -> str | None:
        raw = self.redis.get(keys.ORIGIN)
        return None if raw is None else _text(raw)

    def active_policy(self, default: str) -> str:
        """The policy in force: one set at run time (``set_policy``) outranks the settings."""
        raw = self.redis.get(keys.POLICY)
        return default if raw is None else _text(raw)

    def set_policy(self, policy: str | None) -> None:
        """Switch every submitter and the tick to another policy (None: back to the settings)."""
        if policy is None:
            self.redis.delete(keys.POLICY)
        else:
            self.redis.set(keys.POLICY, policy)

    def active_ids(self) -> list[str]:
        return sorted(_text(x) for x in cast(set[bytes], self.redis.smembers(keys.ACTIVE)))

    def list_ids(self, offset: int = 0, limit: int = 50) -> list[str]:
        raw = cast(list[bytes], self.redis.zrevrange(keys.INDEX, offset, offset + limit - 1))
        return [_text(x) for x in raw]

    def events(self, job_id: str, count: int | None = None) -> list[dict[str, str]]:
        """The job's events, oldest first (all of them unless ``count`` is given)."""
        raw = cast(list[Any], self.redis.xrange(keys.job_events(job_id), count=count))
        return [{_text(k): _text(v) for k, v in fields.items()} for _, fields in raw]

    def read_stream(
        self, key: str, after_id: str = "0-0", count: int = 10_000
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of a stream after ``after_id`` (exclusive), decoded."""
        raw = cast(list[tuple[bytes, dict[bytes, bytes]]],
                   self.redis.xrange(key, min=f"({after_id}", max="+", count=count))
        return [(eid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for eid, f in raw]

    def heartbeats(self, prune: bool = False) -> dict[str, Heartbeat]:
        """The live workers' heartbeats by worker name (a key expires when its worker stops
        renewing it; an unreadable one is logged and skipped), in two round trips whatever the
        size of the keyspace: read by name from ``sl:workers:live``, where every heartbeat
        registers, plus the keys the last scan of the keyspace found (a worker that does not
        register), the scan made at most every :attr:`heartbeat_scan_s` — a scan reads every
        key, tens of thousands with a 10 000-job backlog. ``prune``: also drop the registry's
        entries lapsed over a minute ago (the tick's job)."""
        now = time.monotonic()
        scanned_at, scanned = self._heartbeat_scan
        if now - scanned_at >= self.heartbeat_scan_s:
            scanned = self.heartbeat_names()
            self._heartbeat_scan = (now, scanned)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrange(keys.WORKERS_LIVE, 0, -1)
        if prune:
            pipe.zremrangebyscore(keys.WORKERS_LIVE, "-inf", int(time.time() * 1000) - 60_000)
        registered = pipe.execute()[0]
        names = sorted({*scanned, *(keys.worker(_text(n)) for n in registered)})
        bodies = cast(list[bytes | None], self.redis.mget(names)) if names else []
        return decode_heartbeats(names, bodies)

    def heartbeat_names(self) -> list[str]:
        """Every heartbeat key, found by a scan of the keyspace (what :meth:`heartbeats` reads;
        a worker that registers in ``sl:workers:live`` is also found without a scan)."""
        return sorted(_text(k) for k in self.redis.scan_iter(keys.WORKER_PREFIX + "*",
                                                             count=1000))

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
                                   set=_flat(updates or {}) or None)
        reply = self._transition(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE,
                  keys.CHANGES, ""],
            args=[target.value, repr(now_s or time.time()), by, reason, options, ""],
        )
        status, current = _text(reply[0]), reply[1]
        if status == "missing":
            raise JobNotFound(f"no job {job_id}")
        if status == "illegal":
            raise IllegalTransition(job_id, _text(current), target.value)
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
            args=[seen.state.value, str(seen.epoch), str(seen.seq), _flat_json(encode(**values))]))

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
                         args=[_flat_json(encode(**values))])

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

    def chunk_signals(self, job_id: str, ahead: Sequence[str] = ()) -> tuple[bool, str | None]:
        """What a running chunk asks between its block groups, in one round trip: whether the
        job's preempt or cancel flag is raised, and the first of the queues ``ahead`` (those
        its worker takes before the job's own) that holds work (None: none does). With the
        queues on a broker of their own, one round trip to each."""
        if self.broker is not self.redis and ahead:
            flags = self.redis.hmget(keys.job(job_id), "preempt", "cancel")
            lengths = self.queue_lengths(ahead)
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(keys.job(job_id), "preempt", "cancel")
            for queue in ahead:
                pipe.llen(queue)
            flags, *lengths = pipe.execute()
        waiting = next((q for q, n in zip(ahead, lengths, strict=True) if int(n) > 0), None)
        return any(flag == b"1" for flag in flags), waiting

    def queue_lengths(self, queues: Sequence[str]) -> list[int]:
        """The length of each Celery queue list, read from the broker in one round trip."""
        pipe = self.broker.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return [int(n) for n in pipe.execute()]

    # chunks -----------------------------------------------------------------------------------
    def claim(self, request: ClaimRequest) -> tuple[JobRecord | str, bytes | None]:
        """Fence a chunk message: the job's record as claimed (or why the claim is stale), and
        its durable checkpoint in the same round trip unless the worker holds the job's state
        at ``request.cached_seq`` in memory. The checkpoint is None too for a job with no
        state yet (sequence 0)."""
        return _claimed(self._claim(*_claim_call(request, repr(time.time()))))

    def claim_chunk(
        self, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float
    ) -> JobRecord | str:
        """:meth:`claim` wanting no checkpoint: the job's record as claimed, or why it is
        stale."""
        return self.claim(ClaimRequest(job_id, chunk, epoch, worker, lease_s, None))[0]

    def claim_with_state(
        self, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float, *,
        cached_seq: int | None = -1, cached_commit: str = "",
    ) -> tuple[JobRecord | str, bytes | None]:
        """:meth:`claim` of ``ClaimRequest(job_id, chunk, epoch, worker, lease_s,
        cached_seq, cached_commit)``."""
        return self.claim(ClaimRequest(job_id, chunk, epoch, worker, lease_s, cached_seq,
                                       cached_commit))

    def claim_chunks(
        self, members: Sequence[tuple[str, int, int]], worker: str, lease_s: float, *,
        take_joiners_of: str | None = None,
        cached_seqs: Mapping[str, tuple[int, str]] | None = None,
    ) -> tuple[list[JobRecord | str], list[tuple[str, int, int]], dict[str, bytes]]:
        """:meth:`claim` of each (job id, chunk, epoch), in one round trip; each job is fenced
        on its own and comes with its checkpoint unless ``cached_seqs`` (job id → sequence
        number and commit id of the state held) says the caller holds its state (a job missing
        from it: none held). With ``take_joiners_of``, that batch's
        joiners are taken in the same round trip, the batch going on (:meth:`take_joiners`);
        returns (claims, joiners, checkpoints by job id)."""
        pipe = _ScriptPipeline(self.redis)
        self._take_in(pipe, take_joiners_of, lease_s)
        now = repr(time.time())
        held = cached_seqs or {}
        for job_id, chunk, epoch in members:
            seq, commit_id = held.get(job_id, (-1, ""))
            request = ClaimRequest(job_id, chunk, epoch, worker, lease_s, seq, commit_id)
            pipe.script(self._claim, *_claim_call(request, now))
        replies = pipe.execute()
        joiners = _joiners(replies.pop(0)) if take_joiners_of is not None else []
        claimed: list[JobRecord | str] = []
        checkpoints: dict[str, bytes] = {}
        for (job_id, _, _), reply in zip(members, replies, strict=True):
            record, blob = _claimed(reply)
            claimed.append(record)
            if blob is not None:
                checkpoints[job_id] = blob
        return claimed, joiners, checkpoints

    def _take_in(self, pipe: _ScriptPipeline, batch_id: str | None, lease_s: float) -> None:
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
        return _joiners(raw)

    def commit(self, request: CommitRequest) -> Commit:
        """Compare-and-set the job's cursor and take its next step in one script: the last
        chunk's commit is its DONE, a flagged job stops, any other job hops to its next chunk's
        queue (pushing ``request.next_message`` there when given) or, atomic, keeps running."""
        keys_, args = _commit_call(request)
        if not self.commit_replicas:
            return _commit_of(self._commit(keys=keys_, args=args), request.commit_id)
        pipe = _ScriptPipeline(self.redis)
        pipe.script(self._commit, keys_, args)
        self._wait_for_replicas(pipe)
        reply, replicas = pipe.execute()
        self._check_replicas([request.job_id], replicas)
        return _commit_of(reply, request.commit_id)

    def _wait_for_replicas(self, pipe: _ScriptPipeline) -> None:
        """``WAIT`` on the commit's own connection (WAIT counts that client's writes), last."""
        pipe.command("execute_command", "WAIT", self.commit_replicas,
                     self.commit_replica_timeout_ms)

    def _check_replicas(self, job_ids: Sequence[str], replicas: Any) -> None:
        if int(replicas) < self.commit_replicas:
            log.warning("jobs %s: the commit reached %s of %d replicas in %d ms; a failover now "
                        "replays the chunk from its previous checkpoint", ",".join(job_ids),
                        replicas, self.commit_replicas, self.commit_replica_timeout_ms)

    def commit_chunk(self, job_id: str, **fields: Any) -> Commit:
        """:meth:`commit` of ``CommitRequest(job_id, **fields)``."""
        return self.commit(CommitRequest(job_id, **fields))

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
        pipe = _ScriptPipeline(self.redis)
        commits = [_as_request(request) for request in requests]
        for request in commits:
            pipe.script(self._commit, *_commit_call(request))
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
        joiners = _joiners(replies.pop()) if take_joiners_of is not None else []
        if timing is not None:
            replies.pop()
        return [_commit_of(reply, request.commit_id)
                for reply, request in zip(replies, commits, strict=True)], joiners

    def keep_first_estimate(self, job_id: str, estimate_s: float) -> None:
        """Record the scheduler's first estimate of the job's whole service time, once, and
        only on a record that still exists (never recreating a deleted job's hash)."""
        self._first_estimate(keys=[keys.job(job_id), keys.CHANGES],
                             args=[field_name("first_estimate_s"), repr(estimate_s)])

    def load_checkpoint(self, job_id: str) -> bytes | None:
        """What Redis holds for the job's durable checkpoint: the checkpoint, or a reference
        to it in the object store (:meth:`tasks.checkpoint_objects.CheckpointObjects.resolve`
        reads either)."""
        return cast(bytes | None, self.redis.get(keys.job_checkpoint(job_id)))

    def renew_lease(self, job_id: str, lease_s: float) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.job(job_id), "lease_until", repr(time.time() + lease_s))
        mark_changed(pipe, job_id)
        pipe.execute()


def write_heartbeat(pipe: Any, beat: Heartbeat, lease_s: float) -> None:
    """Queue a worker's heartbeat on ``pipe``: its key (expiring with its lease) and its entry in
    ``sl:workers:live`` (when it lapses), where the tick finds it without scanning."""
    lease_ms = int(lease_s * 1000)
    pipe.set(keys.worker(beat.name), beat.encode(), px=lease_ms)
    pipe.zadd(keys.WORKERS_LIVE, {beat.name: int(time.time() * 1000) + lease_ms})


def decode_heartbeats(names: Sequence[bytes | str], bodies: Sequence[bytes | None]
                      ) -> dict[str, Heartbeat]:
    """Heartbeats by worker name from their keys and bodies (a key that expired is skipped, an
    unreadable body logged and skipped)."""
    beats: dict[str, Heartbeat] = {}
    for key, raw in zip(names, bodies, strict=True):
        if raw is None:  # expired between the scan and the read
            continue
        try:
            beat = Heartbeat.decode(raw, _text(key).removeprefix(keys.WORKER_PREFIX))
        except HeartbeatError as exc:
            log.warning("%s; skipped", exc)
            continue
        beats[beat.name] = beat
    return beats
