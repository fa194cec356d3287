"""The job store in Redis: job records, the lifecycle, per-job event streams, checkpoints.

Every state change is one Lua script, so checks and writes are atomic: a transition is checked
against the lifecycle table and, for racing writers, against what the writer last saw (state,
epoch, sequence number); a chunk commit is a compare-and-set on the sequence number that also
takes the job's next step — hop, stop or finish — in the same script, so no other writer can
slip between a job's last commit and its end.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

import redis

from scheduler.errors import IllegalTransition
from scheduler.lifecycle import TRANSITIONS, JobState
from scheduler.model import ResourceProfile
from tasks import keys
from tasks.errors import HeartbeatError, JobNotFound
from tasks.heartbeat import Heartbeat
from tasks.record import JobRecord, UnreadableRecord, encode, field_name
from tasks.spec import JobSpec

log = logging.getLogger(__name__)

_EVENT = """
local function event(stream, kind, from_state, to_state, by, reason, now)
  redis.call('XADD', stream, '*', 'kind', kind, 'from', from_state, 'to', to_state, 'by', by,
             'reason', reason, 'ts', now)
end
local function ended(job, active, done, id, state, now)
  redis.call('SREM', active, id)
  redis.call('HSET', job, 'finished_at', now)
  redis.call('XADD', done, 'MAXLEN', '~', 100000, '*', 'id', id, 'state', state)
  local ttl = tonumber(redis.call('HGET', job, 'events_ttl') or '')
  if ttl ~= nil and ttl > 0 then
    redis.call('PEXPIRE', job .. ':events', math.floor(ttl * 1000))
  end
end
"""
# A job's event stream is kept whole while the job lives (no MAXLEN): a long job's preemption
# history is part of its record. Once it has ended, the stream expires after the job's
# ``events_ttl`` (``store.event_retention``; the stream key is the job key plus ``:events``,
# see ``keys.job_events``).

_TERMINAL_LUA = "local terminal = {DONE=true, FAILED=true, CANCELLED=true, EXPIRED=true}\n"

# KEYS: job, events, active, done. ARGV: target, now, by, reason, nsrc, src..., nexp, (f, v)...,
# nset, (f, v)...
_TRANSITION = _EVENT + _TERMINAL_LUA + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing', ''} end
local cur = redis.call('HGET', KEYS[1], 'state')
local i = 5
local nsrc = tonumber(ARGV[i]); i = i + 1
local allowed = false
for j = 1, nsrc do if ARGV[i + j - 1] == cur then allowed = true end end
i = i + nsrc
if not allowed then return {'illegal', cur} end
local nexp = tonumber(ARGV[i]); i = i + 1
for j = 1, nexp do
  local f, v = ARGV[i], ARGV[i + 1]; i = i + 2
  if (redis.call('HGET', KEYS[1], f) or '') ~= v then return {'fenced', cur} end
end
local nset = tonumber(ARGV[i]); i = i + 1
for j = 1, nset do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); i = i + 2 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[2])
if terminal[ARGV[1]] then
  ended(KEYS[1], KEYS[3], KEYS[4], redis.call('HGET', KEYS[1], 'id'), ARGV[1], ARGV[2])
end
event(KEYS[2], 'state', cur, ARGV[1], ARGV[3], ARGV[4], ARGV[2])
return {'ok', cur}
"""

# KEYS: job, events, active, index, idem. ARGV: id, now, nfields, (f, v)...
_CREATE = _EVENT + """
if KEYS[5] ~= '' then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {'exists', existing} end
  redis.call('SET', KEYS[5], ARGV[1], 'EX', 86400)
end
local i = 4
for j = 1, tonumber(ARGV[3]) do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); i = i + 2 end
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
event(KEYS[2], 'state', '', 'PENDING', 'submit', 'accepted', ARGV[2])
return {'ok', ARGV[1]}
"""

# KEYS: job, events, ckpt. ARGV: chunk, epoch, worker, now, lease_s, and the sequence number of
# the job's state the worker holds in memory ('' : no state wanted; -1: none held). Returns the
# claimed record whole and, unless the worker holds the state (or there is none yet), the
# durable checkpoint: the worker reads nothing else before it runs.
_CLAIM = _EVENT + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'next_chunk', 'num_chunks')
local state = h[1]
if state ~= 'QUEUED' and state ~= 'RUNNING' then return {'stale', 'state ' .. state} end
if h[2] ~= ARGV[2] then return {'stale', 'epoch ' .. h[2] .. ' != ' .. ARGV[2]} end
if h[3] ~= ARGV[1] then return {'stale', 'next chunk ' .. h[3] .. ' != ' .. ARGV[1]} end
if tonumber(ARGV[1]) >= tonumber(h[4]) then
  return {'stale', 'chunk ' .. ARGV[1] .. ' past the last (' .. h[4] .. ' chunks)'}
end
redis.call('HSET', KEYS[1], 'state', 'RUNNING', 'running_on', ARGV[3],
           'chunk_started_at', ARGV[4], 'lease_until', ARGV[4] + ARGV[5], 'updated_at', ARGV[4])
if redis.call('HEXISTS', KEYS[1], 'started_at') == 0 then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[4])
end
if state ~= 'RUNNING' then
  event(KEYS[2], 'state', state, 'RUNNING', ARGV[3], 'chunk ' .. ARGV[1], ARGV[4])
end
local record = redis.call('HGETALL', KEYS[1])
local seq = redis.call('HGET', KEYS[1], 'seq')
if (ARGV[6] or '') == '' or seq == ARGV[6] or seq == '0' then return {'ok', record} end
return {'ok', record, redis.call('GET', KEYS[3])}
"""

# KEYS: job, ckpt, events, active, done, timings.
# ARGV: 1 chunk, 2 epoch, 3 seq, 4 complete, 5 has_ckpt, 6 ckpt, 7 service_s, 8 now, 9 worker,
# 10 task, 11 then ('hop' | 'continue'), 12 artifact, 13 media_type, 14 device,
# 15 s_per_unit ('' for none), 16 npairs, (class, hop queue)..., then the timing's cost key
# ('' for the job's own), the next chunk's task id ('' : the caller publishes it) and its
# message before and after the queue's name.
# The commit and the job's next step are one script: the last chunk's commit is its DONE, a
# flagged job stops, any other job hops to its next chunk's queue (or, atomic, keeps running).
# A hop with a message pushes it onto the chosen queue's list here, as kombu's Redis transport
# would (priority 0: the queue's own list), and records it published: the commit, the publish
# and its bookkeeping are one round trip, and no crash can fall between them.
_COMMIT = _EVENT + """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'seq', 'next_chunk', 'num_chunks',
                     'preempt', 'cancel', 'queue', 'preemptions', 'id', 'cost_key')
if h[1] ~= 'RUNNING' or h[2] ~= ARGV[2] or h[3] ~= ARGV[3] or h[4] ~= ARGV[1] then
  return {'stale'}
end
local nxt, total = tonumber(h[4]), tonumber(h[5])
if nxt >= total then return {'stale'} end
local complete = ARGV[4] == '1'
if complete then nxt = nxt + 1 end
local last = complete and nxt == total
local cancel = h[7] == '1'
local stop = cancel or h[6] == '1' or not complete
if stop and not last and ARGV[5] ~= '1' then return {'needs_checkpoint'} end
local seq = tonumber(h[3]) + 1
local now = ARGV[8]
redis.call('HSET', KEYS[1], 'seq', seq, 'next_chunk', nxt, 'updated_at', now)
redis.call('HINCRBYFLOAT', KEYS[1], 'service_s', ARGV[7])
if ARGV[5] == '1' then
  redis.call('SET', KEYS[2], ARGV[6])
  redis.call('HSET', KEYS[1], 'ckpt_seq', seq, 'ckpt_chunk', nxt)
end
redis.call('XADD', KEYS[3], '*', 'kind', 'commit', 'chunk', ARGV[1], 'complete', ARGV[4],
           'seq', seq, 'by', ARGV[9], 'task', ARGV[10], 'service_s', ARGV[7], 'ts', now)
if complete and ARGV[15] ~= '' then
  local timed_key = ARGV[17 + 2 * tonumber(ARGV[16])]
  if timed_key == nil or timed_key == '' then timed_key = h[11] end
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 10000, '*', 'cost_key', timed_key,
             'device', ARGV[14], 's_per_unit', ARGV[15])
end
if last then
  redis.call('HSET', KEYS[1], 'state', 'DONE', 'preempt', '0')
  if ARGV[12] ~= '' then
    redis.call('HSET', KEYS[1], 'artifact', ARGV[12], 'media_type', ARGV[13])
  end
  ended(KEYS[1], KEYS[4], KEYS[5], h[10], 'DONE', now)
  event(KEYS[3], 'state', 'RUNNING', 'DONE', ARGV[9], 'all chunks ran', now)
  return {'done', tostring(seq), tostring(nxt), ''}
end
if cancel then
  redis.call('HSET', KEYS[1], 'state', 'CANCELLED')
  ended(KEYS[1], KEYS[4], KEYS[5], h[10], 'CANCELLED', now)
  event(KEYS[3], 'state', 'RUNNING', 'CANCELLED', ARGV[9], 'cancelled by client', now)
  return {'cancelled', tostring(seq), tostring(nxt), ''}
end
if stop then
  redis.call('HSET', KEYS[1], 'state', 'PREEMPTED', 'preempt', '0', 'preempted_at', now,
             'preemptions', tonumber(h[9] or '0') + 1)
  event(KEYS[3], 'state', 'RUNNING', 'PREEMPTED', ARGV[9], 'preempt flag', now)
  return {'preempted', tostring(seq), tostring(nxt), ''}
end
if ARGV[11] == 'continue' then return {'continue', tostring(seq), tostring(nxt), ''} end
local class = string.match(h[8], '([^.]+)$')
local target = class
for j = 17, 16 + 2 * tonumber(ARGV[16]), 2 do
  if ARGV[j] == class then target = ARGV[j + 1] end
end
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'queue', target, 'queued_at', now)
event(KEYS[3], 'state', 'RUNNING', 'QUEUED', ARGV[9], 'next chunk ' .. nxt .. ' on ' .. target,
      now)
local sent = 18 + 2 * tonumber(ARGV[16])
if (ARGV[sent] or '') == '' then return {'hop', tostring(seq), tostring(nxt), target} end
redis.call('LPUSH', target, ARGV[sent + 1] .. cjson.encode(target) .. ARGV[sent + 2])
redis.call('HSET', KEYS[1], 'published', nxt, 'last_task_id', ARGV[sent])
return {'hop', tostring(seq), tostring(nxt), target, ARGV[sent]}
"""

# KEYS: open, joins. ARGV: member (JSON). A job joins a batch only while the batch is in flight:
# once its last step took the joiners and closed it, the caller publishes the job on its own.
_BATCH_JOIN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: open, joins. ARGV: keep ('1': the batch goes on), lease_ms. The joiners so far, taken
# in one step with the batch's open mark: renewed while it goes on, dropped when it ends, so a
# join is either taken here or refused (never left behind).
_BATCH_TAKE = """
local joiners = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[2])
if ARGV[1] == '1' then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return joiners
"""

# KEYS: job. ARGV: field, value. Set once, on a record that exists.
_FIRST_ESTIMATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

# KEYS: job. ARGV: state, epoch. A preempt flag only for the attempt the tick saw running.
_FLAG_PREEMPT = """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'preempt', '1')
return 1
"""

# KEYS: job. ARGV: state, epoch, seq, nset, (f, v)... Fields of a job as the writer saw it.
_UPDATE_AS_SEEN = """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'seq')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= ARGV[3] then return 0 end
for j = 5, 4 + 2 * tonumber(ARGV[4]), 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
return 1
"""

# KEYS: job, events, active, done. ARGV: reason, now. A record nobody can parse leaves the live
# set once, FAILED with its reason (or, if its state is already terminal, just leaves).
_FAIL_UNREADABLE = _EVENT + _TERMINAL_LUA + """
local id = string.match(KEYS[1], '^sl:job:(.*)$')
local cur = redis.call('HGET', KEYS[1], 'state') or ''
if terminal[cur] then redis.call('SREM', KEYS[3], id); return 0 end
redis.call('HSET', KEYS[1], 'state', 'FAILED', 'error', ARGV[1], 'updated_at', ARGV[2])
ended(KEYS[1], KEYS[3], KEYS[4], id, 'FAILED', ARGV[2])
event(KEYS[2], 'state', cur, 'FAILED', 'scheduler', ARGV[1], ARGV[2])
return 1
"""

for _source, _target in ((JobState.RUNNING, JobState.DONE), (JobState.RUNNING, JobState.QUEUED),
                         (JobState.RUNNING, JobState.PREEMPTED),
                         (JobState.RUNNING, JobState.CANCELLED)):
    assert _target in TRANSITIONS[_source], "the commit script's moves must be legal"


def _commit_call(
    job_id: str, *, chunk: int, epoch: int, seq: int, complete: bool, checkpoint: bytes | None,
    service_s: float, worker: str, task_id: str = "",
    hop_queues: Mapping[str, str] | None = None, then_continue: bool = False,
    artifact: tuple[str, str] | None = None, timing: tuple[str, float] | None = None,
    timing_key: str = "", next_message: NextMessage | None = None,
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the commit script (see ``_COMMIT``)."""
    pairs = [x for pair in (hop_queues or {}).items() for x in pair]
    name, media_type = artifact or ("", "")
    device, s_per_unit = timing or ("", None)
    keys_ = [keys.job(job_id), keys.job_checkpoint(job_id), keys.job_events(job_id),
             keys.ACTIVE, keys.DONE, keys.TIMINGS]
    args = [
        chunk, epoch, seq, int(complete), int(checkpoint is not None), checkpoint or b"",
        repr(service_s), repr(time.time()), worker, task_id,
        "continue" if then_continue else "hop", name, media_type, device,
        "" if s_per_unit is None else repr(s_per_unit), len(pairs) // 2, *pairs, timing_key,
    ]
    if next_message is not None:
        args += [next_message.task_id, next_message.before, next_message.after]
    return keys_, args


def _joiners(raw: Any) -> list[tuple[str, int, int]]:
    joiners = []
    for item in raw:
        job_id, chunk, epoch = json.loads(item)
        joiners.append((str(job_id), int(chunk), int(epoch)))
    return joiners


def _commit_of(reply: Any) -> Commit:
    status = CommitStatus(_text(reply[0]))
    if len(reply) < 4:
        return Commit(status)
    return Commit(status, seq=int(reply[1]), next_chunk=int(reply[2]), queue=_text(reply[3]),
                  published=_text(reply[4]) if len(reply) > 4 else None)


def _claimed(reply: Any) -> tuple[JobRecord | str, bytes | None]:
    """A claim script's reply: the record (or why the claim is stale) and any checkpoint."""
    if _text(reply[0]) != "ok":
        return " ".join(_text(x) for x in reply), None
    flat = reply[1]
    record = JobRecord.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))
    blob = reply[2] if len(reply) > 2 and isinstance(reply[2], bytes) else None
    return record, blob


def _sources_of(target: JobState) -> list[str]:
    return [s.value for s, targets in TRANSITIONS.items() if target in targets]


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


class JobStore:
    """Jobs in Redis. All methods are safe to call from any process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._transition = client.register_script(_TRANSITION)
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._commit = client.register_script(_COMMIT)
        self._first_estimate = client.register_script(_FIRST_ESTIMATE)
        self._flag_preempt = client.register_script(_FLAG_PREEMPT)
        self._update_as_seen = client.register_script(_UPDATE_AS_SEEN)
        self._fail_unreadable = client.register_script(_FAIL_UNREADABLE)
        self._batch_join = client.register_script(_BATCH_JOIN)
        self._batch_take = client.register_script(_BATCH_TAKE)

    # create -----------------------------------------------------------------------------------
    def create(
        self,
        spec: JobSpec,
        *,
        tenant: str,
        tier: str,
        num_chunks: int,
        cost_key: str,
        cost_units: Iterable[float],
        deadline_s: float,
        now_s: float,
        queue: str,
        atomic: bool = False,
        chunk_names: Iterable[str] = (),
        resource_profile: ResourceProfile = ResourceProfile.COMPUTE,
        events_ttl_s: float | None = None,
        batch_group: str | None = None,
        batch_growth: float | None = None,
    ) -> tuple[str, bool]:
        """Store a new PENDING job; returns (job id, created). An idempotency key seen before
        for this tenant returns the first job's id and ``created=False``."""
        job_id = uuid.uuid4().hex[:16]
        fields = encode(
            job_id=job_id, kind=spec.kind, state=JobState.PENDING, slo=spec.slo, tenant=tenant,
            tier=tier, params=spec.params, depends_on=spec.depends_on, submitted_at_s=now_s,
            deadline_at_s=now_s + deadline_s, num_chunks=num_chunks, next_chunk=0, seq=0,
            epoch=0, queue=queue, preempt=False, cancel=False, preemptions=0, service_s=0.0,
            cost_key=cost_key, cost_units=tuple(cost_units), updated_at_s=now_s, atomic=atomic,
            chunk_names=tuple(chunk_names), resource_profile=resource_profile,
            shed_if_late=spec.shed_if_late, events_ttl_s=events_ttl_s, batch_group=batch_group,
            batch_growth=batch_growth,
        )
        idem = keys.idempotency(tenant, spec.idempotency_key) if spec.idempotency_key else ""
        flat = [item for pair in fields.items() for item in pair]
        status, value = self._create(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.INDEX, idem],
            args=[job_id, repr(now_s), len(fields), *flat],
        )
        return _text(value), _text(status) == "ok"

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

    get = record

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

    def heartbeats(self) -> dict[str, Heartbeat]:
        """The live workers' heartbeats by worker name (a key expires when its worker stops
        renewing it; an unreadable one is logged and skipped)."""
        names = sorted(self.redis.scan_iter(keys.WORKER_PREFIX + "*", count=1000))
        bodies = cast(list[bytes | None], self.redis.mget(names)) if names else []
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
        expect = expect or {}
        updates = updates or {}
        sources = _sources_of(target)
        args: list[Any] = [target.value, repr(now_s or time.time()), by, reason, len(sources)]
        args += sources
        args += [len(expect), *[x for pair in expect.items() for x in pair]]
        args += [len(updates), *[x for pair in updates.items() for x in pair]]
        status, current = self._transition(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE], args=args
        )
        status = _text(status)
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
        fields = encode(**values)
        flat = [x for pair in fields.items() for x in pair]
        return bool(self._update_as_seen(
            keys=[keys.job(seen.job_id)],
            args=[seen.state.value, str(seen.epoch), str(seen.seq), len(fields), *flat]))

    def fail_unreadable(self, job_id: str, reason: str) -> bool:
        """Take a record nobody can parse out of the live set, FAILED with ``reason``; False if
        it had already ended."""
        return bool(self._fail_unreadable(
            keys=[keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE],
            args=[reason[:500], repr(time.time())]))

    def set_fields(self, job_id: str, **values: Any) -> None:
        """Write record attributes (typed, encoded by the record's codecs)."""
        self.redis.hset(keys.job(job_id), mapping=encode(**values))  # type: ignore[arg-type]

    def request_cancel(self, job_id: str) -> JobState:
        """Cancel a job: at once unless a worker is running one of its chunks, in which case it
        stops at the next chunk (or block-group) boundary. Returns the state after the call."""
        self.record(job_id)  # raises JobNotFound
        self.redis.hset(keys.job(job_id), "cancel", "1")
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
        return bool(self._flag_preempt(keys=[keys.job(job_id)],
                                       args=[state.value, str(epoch)]))

    def preempt_requested(self, job_id: str) -> bool:
        flags = cast(list[bytes | None], self.redis.hmget(keys.job(job_id), "preempt", "cancel"))
        return any(flag == b"1" for flag in flags)

    # chunks -----------------------------------------------------------------------------------
    def claim_chunk(
        self, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float
    ) -> JobRecord | str:
        """Fence a chunk message; returns the job's record as claimed, or why it is stale."""
        return self.claim_with_state(job_id, chunk, epoch, worker, lease_s, cached_seq=None)[0]

    def claim_with_state(
        self, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float, *,
        cached_seq: int | None = -1,
    ) -> tuple[JobRecord | str, bytes | None]:
        """:meth:`claim_chunk`, and the job's durable checkpoint in the same round trip unless
        the caller holds the job's state at ``cached_seq`` in memory (-1: it holds none; None:
        it wants none). The checkpoint is None too for a job with no state yet (sequence 0)."""
        reply = self._claim(keys=[keys.job(job_id), keys.job_events(job_id),
                                  keys.job_checkpoint(job_id)],
                            args=[chunk, epoch, worker, repr(time.time()), lease_s,
                                  "" if cached_seq is None else cached_seq])
        return _claimed(reply)

    def claim_chunks(
        self, members: Sequence[tuple[str, int, int]], worker: str, lease_s: float, *,
        take_joiners_of: str | None = None, cached_seqs: Mapping[str, int] | None = None,
    ) -> tuple[list[JobRecord | str], list[tuple[str, int, int]], dict[str, bytes]]:
        """:meth:`claim_with_state` for each (job id, chunk, epoch), in one round trip; each
        job is fenced on its own and comes with its checkpoint unless ``cached_seqs`` says the
        caller holds its state (a job missing from it: none held). With ``take_joiners_of``,
        that batch's joiners are taken in the same round trip, the batch going on
        (:meth:`take_joiners`); returns (claims, joiners, checkpoints by job id)."""
        pipe = _ScriptPipeline(self.redis)
        self._take_in(pipe, take_joiners_of, lease_s)
        now = repr(time.time())
        held = cached_seqs or {}
        for job_id, chunk, epoch in members:
            pipe.script(self._claim, [keys.job(job_id), keys.job_events(job_id),
                                      keys.job_checkpoint(job_id)],
                        [chunk, epoch, worker, now, lease_s, held.get(job_id, -1)])
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

    def commit_chunk(
        self,
        job_id: str,
        *,
        chunk: int,
        epoch: int,
        seq: int,
        complete: bool,
        checkpoint: bytes | None,
        service_s: float,
        worker: str,
        task_id: str = "",
        hop_queues: Mapping[str, str] | None = None,
        then_continue: bool = False,
        artifact: tuple[str, str] | None = None,
        timing: tuple[str, float] | None = None,
        timing_key: str = "",
        next_message: NextMessage | None = None,
    ) -> Commit:
        """Compare-and-set the job's cursor and take its next step in one script.

        ``hop_queues`` maps a class queue to where this worker sends the job's next chunk of
        that class (its own affinity queue); ``then_continue`` keeps an atomic job RUNNING;
        ``artifact`` is (name, media type) of the last chunk's output; ``timing`` is (device,
        seconds per cost unit) for the cost model, learned under ``timing_key`` (the chunk
        kind's key, :func:`scheduler.cost.chunk_cost_key`; the job's cost key when empty);
        ``next_message`` is the next chunk's message, pushed by the commit when the job hops
        (``Commit.published``), so a hop is one round trip."""
        keys_, args = _commit_call(
            job_id, chunk=chunk, epoch=epoch, seq=seq, complete=complete, checkpoint=checkpoint,
            service_s=service_s, worker=worker, task_id=task_id, hop_queues=hop_queues,
            then_continue=then_continue, artifact=artifact, timing=timing,
            timing_key=timing_key, next_message=next_message)
        return _commit_of(self._commit(keys=keys_, args=args))

    def commit_chunks(
        self, requests: Sequence[tuple[str, Mapping[str, Any]]], *,
        take_joiners_of: str | None = None, lease_s: float = 10.0,
        timing: tuple[str, str, float] | None = None,
    ) -> tuple[list[Commit], list[tuple[str, int, int]]]:
        """:meth:`commit_chunk` for each (job id, its keyword arguments), in one round trip;
        each job's commit is its own script, as alone. With ``take_joiners_of``, that batch's
        joiners are taken after the commits in the same round trip, the batch going on (close
        it with :meth:`take_joiners` if nothing does); returns (commits, joiners). ``timing``
        (cost key, device, seconds per unit) is one more sample for the cost model (a batched
        step's)."""
        pipe = _ScriptPipeline(self.redis)
        for job_id, kwargs in requests:
            pipe.script(self._commit, *_commit_call(job_id, **kwargs))
        if timing is not None:
            cost_key, device, s_per_unit = timing
            pipe.command("xadd", keys.TIMINGS, {"cost_key": cost_key, "device": device,
                                                "s_per_unit": repr(s_per_unit)},
                         maxlen=10000, approximate=True)
        self._take_in(pipe, take_joiners_of, lease_s)
        replies = pipe.execute()
        joiners = _joiners(replies.pop()) if take_joiners_of is not None else []
        if timing is not None:
            replies.pop()
        return [_commit_of(reply) for reply in replies], joiners

    def keep_first_estimate(self, job_id: str, estimate_s: float) -> None:
        """Record the scheduler's first estimate of the job's whole service time, once, and
        only on a record that still exists (never recreating a deleted job's hash)."""
        self._first_estimate(keys=[keys.job(job_id)],
                             args=[field_name("first_estimate_s"), repr(estimate_s)])

    def load_checkpoint(self, job_id: str) -> bytes | None:
        return cast(bytes | None, self.redis.get(keys.job_checkpoint(job_id)))

    def renew_lease(self, job_id: str, lease_s: float) -> None:
        self.redis.hset(keys.job(job_id), "lease_until", repr(time.time() + lease_s))
