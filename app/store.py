"""The job store in Redis: job records, the lifecycle, per-job event streams, checkpoints.

Every state change is one Lua script, so checks and writes are atomic: a transition is checked
against the lifecycle table, and a chunk commit is a compare-and-set on the job's sequence number
(a redelivered or duplicated chunk never advances a job twice).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from app.errors import JobNotFound
from app.schemas import JobRecord, JobSpec
from scheduler.errors import IllegalTransition
from scheduler.lifecycle import TRANSITIONS, JobState, SloClass

log = logging.getLogger(__name__)

PREFIX = "sl:"
ACTIVE_KEY = PREFIX + "jobs:active"
INDEX_KEY = PREFIX + "jobs:index"
TIMINGS_KEY = PREFIX + "timings"
POLICY_KEY = PREFIX + "policy"
EXPERT_UPDATES_KEY = PREFIX + "experts:updating"
"""Models with an expert hot update in progress (see ``app.expert_updates``)."""
DONE_KEY = PREFIX + "done"
"""A stream of (job id, final state): clients block on it instead of polling every job."""
EVENTS_MAXLEN = 512

_EVENT = """
local function event(stream, kind, from_state, to_state, by, reason, now)
  redis.call('XADD', stream, 'MAXLEN', '~', 512, '*', 'kind', kind, 'from', from_state,
             'to', to_state, 'by', by, 'reason', reason, 'ts', now)
end
"""

# KEYS: job, events, active, done. ARGV: target, now, by, reason, nsrc, src..., nexp, (f, v)...,
# nset, (f, v)...
_TRANSITION = _EVENT + """
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
  if redis.call('HGET', KEYS[1], f) ~= v then return {'fenced', cur} end
end
local nset = tonumber(ARGV[i]); i = i + 1
for j = 1, nset do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); i = i + 2 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[2])
if ARGV[1] == 'DONE' or ARGV[1] == 'FAILED' or ARGV[1] == 'CANCELLED' or ARGV[1] == 'EXPIRED'
then
  local id = redis.call('HGET', KEYS[1], 'id')
  redis.call('SREM', KEYS[3], id)
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', 100000, '*', 'id', id, 'state', ARGV[1])
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

# KEYS: job, events. ARGV: chunk, epoch, worker, now, lease_s.
_CLAIM = _EVENT + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'next_chunk', 'seq', 'ckpt_seq',
                     'ckpt_chunk', 'cancel')
local state = h[1]
if state ~= 'QUEUED' and state ~= 'RUNNING' then return {'stale', 'state ' .. state} end
if h[2] ~= ARGV[2] then return {'stale', 'epoch ' .. h[2] .. ' != ' .. ARGV[2]} end
if h[3] ~= ARGV[1] then return {'stale', 'next chunk ' .. h[3] .. ' != ' .. ARGV[1]} end
redis.call('HSET', KEYS[1], 'state', 'RUNNING', 'running_on', ARGV[3],
           'chunk_started_at', ARGV[4], 'lease_until', ARGV[4] + ARGV[5], 'updated_at', ARGV[4])
if redis.call('HEXISTS', KEYS[1], 'started_at') == 0 then
  redis.call('HSET', KEYS[1], 'started_at', ARGV[4])
end
if state ~= 'RUNNING' then
  event(KEYS[2], 'state', state, 'RUNNING', ARGV[3], 'chunk ' .. ARGV[1], ARGV[4])
end
return {'ok', h[4], h[5] or '-1', h[6] or '0', h[7] or '0'}
"""

# KEYS: job, ckpt, events. ARGV: chunk, epoch, seq, complete, has_ckpt, ckpt, service_s, now,
# worker, task.
_COMMIT = _EVENT + """
local h = redis.call('HMGET', KEYS[1], 'epoch', 'seq', 'next_chunk')
if h[1] ~= ARGV[2] or h[2] ~= ARGV[3] or h[3] ~= ARGV[1] then return {'stale'} end
local seq = tonumber(h[2]) + 1
local nxt = tonumber(h[3])
if ARGV[4] == '1' then nxt = nxt + 1 end
redis.call('HSET', KEYS[1], 'seq', seq, 'next_chunk', nxt, 'updated_at', ARGV[8])
redis.call('HINCRBYFLOAT', KEYS[1], 'service_s', ARGV[7])
if ARGV[5] == '1' then
  redis.call('SET', KEYS[2], ARGV[6])
  redis.call('HSET', KEYS[1], 'ckpt_seq', seq, 'ckpt_chunk', nxt)
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 512, '*', 'kind', 'commit', 'chunk', ARGV[1],
           'complete', ARGV[4], 'seq', seq, 'by', ARGV[9], 'task', ARGV[10],
           'service_s', ARGV[7], 'ts', ARGV[8])
return {'ok', tostring(seq), tostring(nxt)}
"""


def _sources_of(target: JobState) -> list[str]:
    return [s.value for s, targets in TRANSITIONS.items() if target in targets]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class Claim:
    """A worker's right to run one chunk: the sequence it must commit against."""

    seq: int
    ckpt_seq: int
    ckpt_chunk: int
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Commit:
    """The job's cursor after a successful chunk commit."""

    seq: int
    next_chunk: int


class JobStore:
    """Jobs in Redis. All methods are safe to call from any process."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._transition = client.register_script(_TRANSITION)
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._commit = client.register_script(_COMMIT)

    # keys -------------------------------------------------------------------------------------
    @staticmethod
    def job_key(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}"

    @staticmethod
    def events_key(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:events"

    @staticmethod
    def ckpt_key(job_id: str) -> str:
        return f"{PREFIX}job:{job_id}:ckpt"

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
        extra: Mapping[str, str] | None = None,
    ) -> tuple[str, bool]:
        """Store a new PENDING job; returns (job id, created). An idempotency key seen before
        for this tenant returns the first job's id and ``created=False``."""
        job_id = uuid.uuid4().hex[:16]
        fields = {
            "id": job_id, "kind": spec.kind, "state": JobState.PENDING.value,
            "slo": spec.slo.value, "tenant": tenant, "tier": tier,
            "params": json.dumps(spec.params, sort_keys=True),
            "depends_on": json.dumps(spec.depends_on),
            "submitted_at": repr(now_s), "deadline_at": repr(now_s + deadline_s),
            "num_chunks": str(num_chunks), "next_chunk": "0", "seq": "0", "epoch": "0",
            "queue": queue, "preempt": "0", "cancel": "0", "preemptions": "0",
            "service_s": "0", "cost_key": cost_key,
            "cost_units": json.dumps(list(cost_units)), "updated_at": repr(now_s),
            **(extra or {}),
        }
        idem = f"{PREFIX}idem:{tenant}:{spec.idempotency_key}" if spec.idempotency_key else ""
        flat = [item for pair in fields.items() for item in pair]
        status, value = self._create(
            keys=[self.job_key(job_id), self.events_key(job_id), ACTIVE_KEY, INDEX_KEY, idem],
            args=[job_id, repr(now_s), len(fields), *flat],
        )
        return _text(value), _text(status) == "ok"

    # read -------------------------------------------------------------------------------------
    def fields(self, job_id: str) -> dict[str, str]:
        raw = cast(dict[bytes, bytes], self.redis.hgetall(self.job_key(job_id)))
        if not raw:
            raise JobNotFound(f"no job {job_id}")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def get(self, job_id: str) -> JobRecord:
        return record_from_fields(self.fields(job_id), origin_id=self.origin_id())

    def state(self, job_id: str) -> JobState:
        raw = self.redis.hget(self.job_key(job_id), "state")
        if raw is None:
            raise JobNotFound(f"no job {job_id}")
        return JobState(_text(raw))

    def origin_id(self) -> str | None:
        raw = self.redis.get(PREFIX + "origin")
        return None if raw is None else _text(raw)

    def active_policy(self, default: str) -> str:
        """The policy in force: one set at run time (``set_policy``) outranks the settings."""
        raw = self.redis.get(POLICY_KEY)
        return default if raw is None else _text(raw)

    def set_policy(self, policy: str | None) -> None:
        """Switch every submitter and the tick to another policy (None: back to the settings)."""
        if policy is None:
            self.redis.delete(POLICY_KEY)
        else:
            self.redis.set(POLICY_KEY, policy)

    def active_ids(self) -> list[str]:
        return sorted(_text(x) for x in cast(set[bytes], self.redis.smembers(ACTIVE_KEY)))

    def list_ids(self, offset: int = 0, limit: int = 50) -> list[str]:
        raw = cast(list[bytes], self.redis.zrevrange(INDEX_KEY, offset, offset + limit - 1))
        return [_text(x) for x in raw]

    def many_fields(self, job_ids: list[str]) -> list[dict[str, str]]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.job_key(job_id))
        return [
            {k.decode(): v.decode() for k, v in raw.items()} for raw in pipe.execute() if raw
        ]

    def events(self, job_id: str, count: int = 512) -> list[dict[str, str]]:
        raw = cast(list[Any], self.redis.xrange(self.events_key(job_id), count=count))
        return [{_text(k): _text(v) for k, v in fields.items()} for _, fields in raw]

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
        forbids it; returns False (and changes nothing) if a field in ``expect`` differs."""
        expect = expect or {}
        updates = updates or {}
        sources = _sources_of(target)
        args: list[Any] = [target.value, repr(now_s or time.time()), by, reason, len(sources)]
        args += sources
        args += [len(expect), *[x for pair in expect.items() for x in pair]]
        args += [len(updates), *[x for pair in updates.items() for x in pair]]
        status, current = self._transition(
            keys=[self.job_key(job_id), self.events_key(job_id), ACTIVE_KEY, DONE_KEY], args=args
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

    def set_fields(self, job_id: str, **values: str) -> None:
        self.redis.hset(self.job_key(job_id), mapping=dict(values))  # type: ignore[arg-type]

    def read_stream(
        self, key: str, after_id: str = "0-0", count: int = 10_000
    ) -> list[tuple[str, dict[str, str]]]:
        """Entries of a stream after ``after_id`` (exclusive), decoded."""
        raw = cast(list[tuple[bytes, dict[bytes, bytes]]],
                   self.redis.xrange(key, min=f"({after_id}", max="+", count=count))
        return [(eid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for eid, f in raw]

    def request_cancel(self, job_id: str) -> JobState:
        """Cancel a job: at once unless a worker is running one of its chunks, in which case it
        stops at the next chunk (or block-group) boundary. Returns the state after the call."""
        self.redis.hset(self.job_key(job_id), "cancel", "1") if self.fields(job_id) else None
        for waiting in (JobState.PENDING, JobState.QUEUED, JobState.SUSPENDED, JobState.PREEMPTED):
            if self.try_transition(
                job_id, JobState.CANCELLED, by="client", reason="cancelled by client",
                expect={"state": waiting.value},
            ):
                break
        return self.state(job_id)

    def request_preempt(self, job_id: str) -> None:
        self.redis.hset(self.job_key(job_id), "preempt", "1")

    def preempt_requested(self, job_id: str) -> bool:
        key = self.job_key(job_id)
        flags = cast(list[bytes | None], self.redis.hmget(key, "preempt", "cancel"))
        return any(flag == b"1" for flag in flags)

    # chunks -----------------------------------------------------------------------------------
    def claim_chunk(
        self, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float
    ) -> Claim | str:
        """Fence a chunk message; returns a :class:`Claim` or the reason it is stale."""
        reply = self._claim(
            keys=[self.job_key(job_id), self.events_key(job_id)],
            args=[chunk, epoch, worker, repr(time.time()), lease_s],
        )
        if _text(reply[0]) != "ok":
            return " ".join(_text(x) for x in reply)
        return Claim(
            seq=int(reply[1]), ckpt_seq=int(reply[2]), ckpt_chunk=int(reply[3]),
            cancel_requested=_text(reply[4]) == "1",
        )

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
    ) -> Commit | None:
        """Compare-and-set the job's cursor; None if another delivery already moved it."""
        reply = self._commit(
            keys=[self.job_key(job_id), self.ckpt_key(job_id), self.events_key(job_id)],
            args=[
                chunk, epoch, seq, int(complete), int(checkpoint is not None),
                checkpoint or b"", repr(service_s), repr(time.time()), worker, task_id,
            ],
        )
        if _text(reply[0]) != "ok":
            return None
        return Commit(seq=int(reply[1]), next_chunk=int(reply[2]))

    def load_checkpoint(self, job_id: str) -> bytes | None:
        return cast(bytes | None, self.redis.get(self.ckpt_key(job_id)))

    def renew_lease(self, job_id: str, lease_s: float) -> None:
        self.redis.hset(self.job_key(job_id), "lease_until", repr(time.time() + lease_s))

    def record_timing(self, cost_key: str, device: str, seconds_per_unit: float) -> None:
        self.redis.xadd(
            TIMINGS_KEY,
            {"cost_key": cost_key, "device": device, "s_per_unit": repr(seconds_per_unit)},
            maxlen=10_000, approximate=True,
        )


def record_from_fields(f: Mapping[str, str], origin_id: str | None = None) -> JobRecord:
    """Build the public view of a job from its hash fields."""

    def opt_float(name: str) -> float | None:
        return float(f[name]) if f.get(name) else None

    return JobRecord(
        id=f["id"], kind=f["kind"], state=JobState(f["state"]), slo=SloClass(f["slo"]),  # type: ignore[arg-type]
        tenant=f["tenant"], tier=f.get("tier", "standard"),
        progress=int(f["next_chunk"]), total=int(f["num_chunks"]),
        submitted_at=float(f["submitted_at"]), deadline_at=float(f["deadline_at"]),
        started_at=opt_float("started_at"), finished_at=opt_float("finished_at"),
        queue=f.get("queue") or None, epoch=int(f["epoch"]),
        preemptions=int(f.get("preemptions", "0")), origin=f["id"] == origin_id,
        error=f.get("error") or None, artifact=f.get("artifact") or None,
        media_type=f.get("media_type") or None, params=json.loads(f.get("params", "{}")),
    )
