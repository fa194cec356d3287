"""The job store's reads: job records, their events and streams, the policy in force, the live
workers' heartbeats and the queue lengths a running chunk asks about. :class:`tasks.store.JobStore`
adds the writes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from scheduler.lifecycle import JobState
from tasks import keys
from tasks.errors import JobNotFound
from tasks.heartbeat import Heartbeat, decode_heartbeats
from tasks.record import JobRecord, UnreadableRecord
from tasks.store_calls import text


class JobReads:
    """Reads of jobs in Redis. All methods are safe to call from any process."""

    heartbeat_scan_s = 5.0
    """How often :meth:`heartbeats` scans the keyspace for workers that do not register."""

    def __init__(self, client: redis.Redis, *, broker: redis.Redis | None = None) -> None:
        self.redis = client
        # Celery's queue lists, only read here: another Redis with ``broker.url``, else this one
        self.broker = broker if broker is not None else client
        self._heartbeat_scan: tuple[float, list[str]] = (float("-inf"), [])
        """(when, heartbeat keys found) of the last scan of the keyspace (:meth:`heartbeats`)."""

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
        return JobState(text(raw))

    def origin_id(self) -> str | None:
        raw = self.redis.get(keys.ORIGIN)
        return None if raw is None else text(raw)

    def active_policy(self, default: str) -> str:
        """The policy in force: one set at run time (``set_policy``) outranks the settings."""
        raw = self.redis.get(keys.POLICY)
        return default if raw is None else text(raw)

    def active_ids(self) -> list[str]:
        return sorted(text(x) for x in cast(set[bytes], self.redis.smembers(keys.ACTIVE)))

    def list_ids(self, offset: int = 0, limit: int = 50) -> list[str]:
        raw = cast(list[bytes], self.redis.zrevrange(keys.INDEX, offset, offset + limit - 1))
        return [text(x) for x in raw]

    def events(self, job_id: str, count: int | None = None) -> list[dict[str, str]]:
        """The job's events, oldest first (all of them unless ``count`` is given)."""
        raw = cast(list[Any], self.redis.xrange(keys.job_events(job_id), count=count))
        return [{text(k): text(v) for k, v in fields.items()} for _, fields in raw]

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
        names = sorted({*scanned, *(keys.worker(text(n)) for n in registered)})
        bodies = cast(list[bytes | None], self.redis.mget(names)) if names else []
        return decode_heartbeats(names, bodies)

    def heartbeat_names(self) -> list[str]:
        """Every heartbeat key, found by a scan of the keyspace (what :meth:`heartbeats` reads;
        a worker that registers in ``sl:workers:live`` is also found without a scan)."""
        return sorted(text(k) for k in self.redis.scan_iter(keys.WORKER_PREFIX + "*",
                                                             count=1000))

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

    def load_checkpoint(self, job_id: str) -> bytes | None:
        """What Redis holds for the job's durable checkpoint: the checkpoint, or a reference
        to it in the object store (:meth:`tasks.checkpoint_objects.CheckpointObjects.resolve`
        reads either)."""
        return cast(bytes | None, self.redis.get(keys.job_checkpoint(job_id)))
