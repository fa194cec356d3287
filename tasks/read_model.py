"""What the API reads from the store, as named queries: jobs and their owners, the index, events,
heartbeats, the admission status, queue contents, a checkpoint's header and the metrics counters.
The API calls no Redis command itself; every round trip it makes is one of these."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from scheduler.fairness import ServiceLedger
from scheduler.lifecycle import JobState, SloClass
from tasks import keys, scripts
from tasks.admission import PublishedAdmission
from tasks.errors import AdmissionStatusError, JobNotFound, RedisUnavailable
from tasks.fair_share import read_ledger
from tasks.heartbeat import Heartbeat
from tasks.live_counts import LiveByState
from tasks.record import JobRecord, UnreadableRecord, field_name
from tasks.store import JobStore

log = logging.getLogger(__name__)

STORE_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, RedisUnavailable)
"""What a call into the store raises while Redis cannot be reached (answered 503)."""

FIELDS_BATCH = 1000
"""Most records one ``read_fields`` call reads (Redis serves nothing else meanwhile)."""

Fields = dict[str, str]
"""One stream entry's fields, decoded."""


@dataclass(frozen=True, slots=True)
class FinishedCount:
    """How one ended job adds to the ``/metrics`` counters (``ReadModel.count_finished``)."""

    job_id: str
    finished_at_s: float
    counter_increments: tuple[tuple[str, str, int | float], ...]
    """(hash key, field, increment) to apply once for this job: an int counts, a float sums."""


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """The few fields of a job that SLO attainment and latency need: read with one ``HMGET``
    instead of the whole record, for the hundreds of jobs one /v1/stats or scrape counts."""

    job_id: str
    slo: SloClass
    state: JobState
    submitted_at_s: float
    deadline_at_s: float
    finished_at_s: float | None

    FIELDS = ("slo", "state", "submitted_at", "deadline_at", "finished_at")

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at_s is None else self.finished_at_s - self.submitted_at_s

    @classmethod
    def parse(cls, job_id: str, raw: Sequence[bytes | None]) -> JobOutcome:
        """From the ``FIELDS`` as read; raises ``ValueError``/``TypeError`` for a missing or
        malformed one."""
        slo, state, submitted, deadline, finished = raw
        if slo is None or state is None or submitted is None or deadline is None:
            raise ValueError("a required field is missing")
        return cls(job_id=job_id, slo=SloClass(slo.decode()), state=JobState(state.decode()),
                   submitted_at_s=float(submitted), deadline_at_s=float(deadline),
                   finished_at_s=None if finished is None else float(finished))


@dataclass(frozen=True, slots=True)
class ReadModel:
    """Read-only queries over one store (plus the ``/metrics`` counters, kept exactly once, and
    the write a replayed submit WAITs on: see :meth:`replayed_job`)."""

    store: JobStore
    _read_fields: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_read_fields", scripts.register(self.store.redis,
                                                                  "read_fields"))

    # jobs ---------------------------------------------------------------------------------------
    def record(self, job_id: str) -> JobRecord:
        return self.store.record(job_id)

    def records(self, job_ids: Iterable[str]) -> list[JobRecord | UnreadableRecord]:
        return self.store.records(job_ids)

    def fair_ledger(self) -> ServiceLedger:
        """Each tenant's fair-share service per band (``tasks.fair_share``)."""
        return read_ledger(self.store.redis)

    def origin_id(self) -> str | None:
        return self.store.origin_id()

    def record_and_origin(self, job_id: str) -> tuple[JobRecord, str | None]:
        """The job's record and the origin's id, in one round trip (what a job's view needs);
        raises like :meth:`JobStore.record`."""
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.hgetall(keys.job(job_id))
        pipe.get(keys.ORIGIN)
        raw, origin = cast(tuple[dict[bytes, bytes], bytes | None], pipe.execute())
        if not raw:
            raise JobNotFound(f"no job {job_id}")
        return JobRecord.from_hash(raw), None if origin is None else origin.decode()

    def active_ids(self) -> list[str]:
        return self.store.active_ids()

    def newest_ids(self, count: int) -> list[str]:
        """The ``count`` most recently submitted job ids."""
        return self.store.list_ids(0, count)

    def outcomes(self, job_ids: Sequence[str]) -> list[JobOutcome]:
        """Each job's :class:`JobOutcome`, in one round trip; a job that is gone is left out,
        and so is one whose fields cannot be read (logged)."""
        out = []
        for job_id, raw in zip(job_ids, self.fields(job_ids, JobOutcome.FIELDS), strict=True):
            if all(v is None for v in raw):
                continue
            try:
                out.append(JobOutcome.parse(job_id, raw))
            except (ValueError, TypeError) as exc:
                log.warning("job %s left out of the figures: %s", job_id, exc)
        return out

    def live_by_state(self) -> LiveByState:
        """Unfinished jobs per (state, class), from the counters the state changes keep."""
        return LiveByState.parse(cast(dict[bytes, bytes],
                                      self.store.redis.hgetall(keys.LIVE_BY_STATE)))

    def ran_since(self, since_s: float) -> list[str]:
        """Jobs that held a worker at some point since ``since_s`` (running now included; the
        last hour at most)."""
        raw = cast(list[bytes], self.store.redis.zrangebyscore(keys.RAN, since_s, "+inf"))
        return [m.decode() for m in raw]

    def owners(self, job_ids: Iterable[str]) -> dict[str, str | None]:
        """The raw tenant field of each job (None for a job that is gone), read even from a
        record that does not parse."""
        ids = sorted(set(job_ids))
        pipe = self.store.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.job(job_id), "tenant")
        owners = cast(list[bytes | None], pipe.execute()) if ids else []
        return {job_id: o.decode() if o is not None else None
                for job_id, o in zip(ids, owners, strict=True)}

    def replayed_job(self, tenant: str, idempotency_key: str) -> str | None:
        """The job a tenant's earlier submit with this idempotency key created, if it still
        exists."""
        key = keys.idempotency(tenant, idempotency_key)
        raw = self.store.redis.get(key)
        existing = cast(bytes, raw).decode() if raw is not None else None
        if existing is not None and self.store.redis.exists(keys.job(existing)):
            self._replicated(key, existing)
            return existing
        return None

    def _replicated(self, key: str, job_id: str) -> None:
        """A replayed job is answered only once ``broker.commit_replicas`` replicas hold it, as
        a new one is: the retry that follows a 503 ("reached 0 of N replicas") may find the job
        on a master a failover is about to demote, which then drops it. The key is written
        again (same value, same TTL) and WAITed for; replication keeps order, so replicas that
        hold this write hold the job created before it. Raises :class:`RedisUnavailable` (503,
        retry with the same key) when they do not."""
        wanted = self.store.commit_replicas
        if not wanted:
            return
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.set(key, job_id, xx=True, keepttl=True)
        pipe.execute_command("WAIT", wanted, self.store.commit_replica_timeout_ms)
        _, reached = pipe.execute()
        if int(reached) < wanted:
            raise RedisUnavailable(
                f"job {job_id} reached {reached} of {wanted} replicas; submit again (with the "
                "same idempotency key, to get this job if it survived)")

    def index_before(self, high: str, count: int) -> list[tuple[float, str]]:
        """Up to ``count`` (score, id) of the submit index at or below score ``high`` (a number
        or ``+inf``), newest first."""
        rows = cast(list[tuple[bytes, float]], self.store.redis.zrevrangebyscore(
            keys.INDEX, high, "-inf", start=0, num=count, withscores=True))
        return [(score, member.decode()) for member, score in rows]

    def fields(self, job_ids: Sequence[str], names: Sequence[str]) -> list[list[bytes | None]]:
        """The named raw fields of each job's record, in one round trip: one script call per
        ``FIELDS_BATCH`` records (a pipeline of one ``HMGET`` each costs this process ten
        times the CPU to pack and parse)."""
        out: list[list[bytes | None]] = []
        for at in range(0, len(job_ids), FIELDS_BATCH):
            batch = [keys.job(job_id) for job_id in job_ids[at:at + FIELDS_BATCH]]
            out += cast(list[list[bytes | None]], self._read_fields(keys=batch, args=list(names)))
        return out

    # streams ------------------------------------------------------------------------------------
    def ended_ids_since(self, start_ms: int, limit: int) -> tuple[list[str], bool]:
        """Ids of the jobs that ended since ``start_ms`` (Redis clock), newest first, at most
        ``limit``; and whether more ended."""
        raw = cast(list[tuple[bytes, dict[bytes, bytes]]], self.store.redis.xrevrange(
            keys.DONE, max="+", min=f"{start_ms}-0", count=limit + 1))
        ids = list(dict.fromkeys(f[b"id"].decode() for _, f in raw[:limit] if b"id" in f))
        return ids, len(raw) > limit

    def events_since(self, job_ids: Sequence[str], start_ms: int,
                     count: int) -> list[list[Fields]]:
        """Each job's newest ``count`` events since ``start_ms``, oldest first."""
        pipe = self.store.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrevrange(keys.job_events(job_id), max="+", min=f"{start_ms}-0", count=count)
        streams = cast(list[list[tuple[bytes, dict[bytes, bytes]]]], pipe.execute())
        return [[{k.decode(): v.decode() for k, v in fields.items()}
                 for _, fields in reversed(stream)] for stream in streams]

    # workers and the scheduler ------------------------------------------------------------------
    def heartbeats(self) -> dict[str, Heartbeat]:
        return self.store.heartbeats()

    def admission(self) -> PublishedAdmission | None:
        """The last tick's admission status (None before the first tick, or if unreadable)."""
        raw = self.store.redis.get(keys.ADMISSION)
        if raw is None:
            return None
        try:
            return PublishedAdmission.decode(raw)
        except AdmissionStatusError as exc:
            log.warning("%s; reported as none", exc)
            return None

    def list_lengths(self, names: Sequence[str]) -> list[int]:
        """The length of each of kombu's queue lists (on the broker)."""
        return self.store.queue_lengths(names)

    def list_tails(self, names: Sequence[str], count: int) -> list[list[bytes]]:
        """The last ``count`` entries of each of kombu's queue lists (its oldest messages), read
        from the broker."""
        pipe = self.store.broker.pipeline(transaction=False)
        for name in names:
            pipe.lrange(name, -count, -1)
        return cast(list[list[bytes]], pipe.execute())

    def ping(self) -> None:
        """Raises if Redis does not answer."""
        self.store.redis.ping()

    # checkpoints --------------------------------------------------------------------------------
    def checkpoint_bytes(self, job_id: str, seq: int, start: int, end: int) -> bytes | None:
        """Bytes ``start..end`` of the job's checkpoint, if it is still the one of commit
        ``seq`` (the sequence number and the bytes read in one transaction)."""
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.hget(keys.job(job_id), field_name("ckpt_seq"))
        pipe.getrange(keys.job_checkpoint(job_id), start, end)
        stored_seq, data = cast(list[Any], pipe.execute())
        if not stored_seq or int(stored_seq) != seq:
            return None
        return bytes(data)

    # the /metrics counters ----------------------------------------------------------------------
    def count_finished(self, counts: Sequence[FinishedCount], keep: int) -> None:
        """Apply each ended job's increments exactly once across API processes (a ``ZADD NX``
        on a seen-set keeping the newest ``keep``)."""
        if not counts:
            return
        pipe = self.store.redis.pipeline(transaction=False)
        for c in counts:
            pipe.zadd(keys.METRICS_SEEN, {c.job_id: c.finished_at_s}, nx=True)
        added = pipe.execute()
        pipe = self.store.redis.pipeline(transaction=False)
        for c, new in zip(counts, added, strict=True):
            for key, name, amount in c.counter_increments if new else ():
                if isinstance(amount, int):
                    pipe.hincrby(key, name, amount)
                else:
                    pipe.hincrbyfloat(key, name, amount)
        pipe.zremrangebyrank(keys.METRICS_SEEN, 0, -keep - 1)
        pipe.execute()

    def counters(self, key: str) -> dict[str, float]:
        """One counter hash of ``/metrics``."""
        raw = cast(dict[bytes, bytes], self.store.redis.hgetall(key))
        return {k.decode(): float(v) for k, v in raw.items()}
