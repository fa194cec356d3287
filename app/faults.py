"""Fault injection and the exactly-once ledger: how the reliability drill and tests break a
running stack, and how they prove no job was lost or run twice."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from app.artifacts import ArtifactStore
from app.store import JobStore
from scheduler.lifecycle import JobState

PICKLE_CONTENT_TYPE = "application/x-python-serialize"
REFUSAL_LOG = "Refusing to deserialize untrusted content of type pickle"
"""What a worker logs when a pickle message reaches it (kombu's ContentDisallowed)."""
MALFORMED_LOG = "rejected malformed chunk message"
FENCED_LOG = "another delivery committed it first"
"""What a worker logs when its chunk commit lost to another delivery (or a newer epoch)."""


@dataclass(frozen=True, slots=True)
class JobAudit:
    """A job's ledger: how often each chunk committed complete, and what the artifact says."""

    job_id: str
    state: JobState
    num_chunks: int
    commits: dict[int, int]
    """Chunk index → complete commits (a partial, block-group commit is not counted)."""
    workers: frozenset[str]
    """Workers that committed at least one chunk."""
    applied: list[int] | None
    """A simulated job's artifact: the chunks applied to its state, in order."""

    @property
    def each_chunk_once(self) -> bool:
        return self.commits == {i: 1 for i in range(self.num_chunks)}

    @property
    def exact(self) -> bool:
        """DONE, every chunk committed exactly once, and (if known) applied in order once."""
        applied_ok = self.applied is None or self.applied == list(range(self.num_chunks))
        return self.state is JobState.DONE and self.each_chunk_once and applied_ok

    def problem(self) -> str:
        """What is wrong, for reports ('' when exact)."""
        if self.exact:
            return ""
        twice = sorted(c for c, n in self.commits.items() if n > 1)
        missing = sorted(set(range(self.num_chunks)) - set(self.commits))
        return (f"job {self.job_id} {self.state.value}: chunks committed twice {twice}, "
                f"missing {missing}, applied {self.applied}")


def tolerant(predicate: Callable[[], bool]) -> Callable[[], bool]:
    """A wait predicate that reads a Redis which may still be coming back: an unreachable
    Redis answers False instead of raising."""

    def check() -> bool:
        try:
            return predicate()
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    return check


def audit_job(store: JobStore, artifacts: ArtifactStore, job_id: str) -> JobAudit:
    """Read a job's commit events and (for simulated jobs) its artifact."""
    fields = store.fields(job_id)
    commits: Counter[int] = Counter()
    workers = set()
    for event in store.events(job_id):
        if event.get("kind") == "commit":
            workers.add(event.get("by", ""))
            if event.get("complete") == "1":
                commits[int(event["chunk"])] += 1
    applied = None
    if fields["kind"] == "simulated" and fields.get("artifact"):
        body = json.loads(artifacts.read(fields["artifact"]))
        applied = [int(x) for x in body["applied"]]
    return JobAudit(job_id=job_id, state=JobState(fields["state"]),
                    num_chunks=int(fields["num_chunks"]), commits=dict(commits),
                    workers=frozenset(workers), applied=applied)


# messages nobody should be able to run ---------------------------------------------------
def publish_pickle(celery_app: Any, queue: str, canary: Path | None = None) -> str:
    """Put a pickle-serialized chunk message on ``queue`` (kombu directly, bypassing the app's
    JSON-only serializer). Unpickling it would create ``canary``: that file must never appear."""
    from kombu import Producer

    from app.celery import CHUNK_TASK

    payload: Any = (uuid.uuid4().hex[:16], 0, 0)
    if canary is not None:
        payload = (_Canary(canary), 0, 0)
    task_id = f"pickle-{uuid.uuid4().hex[:8]}"
    target = celery_app.amqp.queues[queue]
    # A hostile producer: the bytes are pickled here and sent raw with pickle's content type;
    # every Stepline consumer accepts JSON only and must refuse them unread.
    hostile = pickle.dumps((payload, {}, {}))
    with celery_app.connection_for_write() as conn:
        Producer(conn).publish(
            hostile, content_type="application/x-python-serialize", content_encoding="binary",
            exchange=target.exchange, routing_key=target.routing_key,
            headers={"task": CHUNK_TASK, "id": task_id, "lang": "py"},
        )
    return task_id


class _Canary:
    """Pickles to a call that creates a file: proof, if the file appears, that a consumer
    unpickled a message."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.path,))


def publish_malformed(celery_app: Any, queue: str) -> list[str]:
    """Messages a worker must reject without crashing: wrong argument types, missing
    arguments, an unregistered task name, and a body that is not JSON."""
    from kombu import Producer

    from app.celery import CHUNK_TASK

    sent = []
    for args in (["../../etc/passwd", "zero", -1], [], [{"job": 1}, [0], None]):
        sent.append(celery_app.send_task(CHUNK_TASK, args=args, queue=queue).id)
    sent.append(celery_app.send_task("os.system", args=["true"], queue=queue).id)
    target = celery_app.amqp.queues[queue]
    with celery_app.connection_for_write() as conn:
        task_id = f"garbage-{uuid.uuid4().hex[:8]}"
        Producer(conn).publish(b"{not json", content_type="application/json",
                               content_encoding="utf-8", exchange=target.exchange,
                               routing_key=target.routing_key,
                               headers={"task": CHUNK_TASK, "id": task_id, "lang": "py"})
        sent.append(task_id)
    return sent


# processes ------------------------------------------------------------------------------
def tcp_listen_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on (Linux /proc; [] where /proc is absent)."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        }
    except OSError:
        return []
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (0 if it is gone or /proc is absent)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# load -----------------------------------------------------------------------------------
@dataclass
class BurstResult:
    """What a burst of submissions at the API saw."""

    offered: int = 0
    """Requests the schedule called for (rate x duration)."""
    sent: int = 0
    skipped: int = 0
    """Requests not sent because ``concurrency`` were already in flight (the bound)."""
    statuses: Counter[int] = field(default_factory=Counter)
    errors: int = 0
    """Transport errors (refused, reset, timed out)."""
    latencies_s: list[float] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    """Ids of the jobs the API accepted (201)."""
    retry_after_missing: int = 0
    """429 or 503 answers without a Retry-After header."""
    duration_s: float = 0.0

    def percentile_s(self, q: float) -> float | None:
        from app.bench.report import percentile

        return percentile(self.latencies_s, 100 * q)

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.percentile_s(0.5), self.percentile_s(0.99)
        return {
            "offered": self.offered, "sent": self.sent, "skipped_at_bound": self.skipped,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "transport_errors": self.errors, "accepted": len(self.accepted),
            "p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "p99_ms": None if p99 is None else round(p99 * 1000, 1),
            "retry_after_missing": self.retry_after_missing,
            "duration_s": round(self.duration_s, 2),
        }


def api_burst(url: str, key: str, spec: dict[str, Any], *, rate_per_s: float,
              duration_s: float, concurrency: int = 64, timeout_s: float = 10.0) -> BurstResult:
    """POST ``spec`` to ``url``/v1/jobs at ``rate_per_s`` for ``duration_s``, with at most
    ``concurrency`` requests in flight; stops by itself. Loopback addresses only."""
    host = url.split("//", 1)[-1].split(":", 1)[0].split("/", 1)[0]
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise ValueError(f"a burst is aimed at loopback only, not {host}")
    return asyncio.run(_burst(url, key, spec, rate_per_s, duration_s, concurrency, timeout_s))


async def _burst(url: str, key: str, spec: dict[str, Any], rate_per_s: float,
                 duration_s: float, concurrency: int, timeout_s: float) -> BurstResult:
    import httpx

    result = BurstResult(offered=int(rate_per_s * duration_s))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    in_flight: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, limits=limits,
                                 timeout=timeout_s) as client:

        async def one() -> None:
            started = time.perf_counter()
            try:
                response = await client.post("/v1/jobs", json=spec)
            except httpx.HTTPError:
                result.errors += 1
                return
            result.latencies_s.append(time.perf_counter() - started)
            result.statuses[response.status_code] += 1
            if response.status_code == 201:
                result.accepted.append(response.json()["id"])
            elif response.status_code in (429, 503) and "Retry-After" not in response.headers:
                result.retry_after_missing += 1

        begun = time.perf_counter()
        for i in range(result.offered):
            delay_s = begun + i / rate_per_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if len(in_flight) >= concurrency:
                result.skipped += 1
                continue
            task = asyncio.create_task(one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            result.sent += 1
        if in_flight:
            await asyncio.wait(in_flight, timeout=timeout_s + 1)
        result.duration_s = time.perf_counter() - begun
    return result


class MemorySampler:
    """Samples the resident memory of some processes on a background thread."""

    def __init__(self, pids: dict[str, int], period_s: float = 0.25) -> None:
        self.pids = pids
        self.period_s = period_s
        self.samples: dict[str, list[int]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, pid in self.pids.items():
                self.samples[name].append(rss_bytes(pid))

    def __enter__(self) -> MemorySampler:
        for name, pid in self.pids.items():
            self.samples[name].append(rss_bytes(pid))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def summary_mb(self) -> dict[str, dict[str, float]]:
        mb = 1024 * 1024
        return {name: {"start_mb": round(s[0] / mb, 1), "max_mb": round(max(s) / mb, 1),
                       "end_mb": round(s[-1] / mb, 1)}
                for name, s in self.samples.items() if s}
