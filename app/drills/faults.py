"""Fault injection and the exactly-once ledger: how the reliability drill and tests break a
running stack, and how they prove no job was lost or run twice."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from app.bench.report import percentile
from app.celery import CHUNK_TASK
from scheduler.lifecycle import JobState
from tasks.artifacts import ArtifactStore
from tasks.store import JobStore

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
@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The standard client retry a burst holds the API to. ``app.client`` has no retry of its
    own, so this is the textbook one: a request that failed in transport is sent once more,
    after a jittered backoff, with the same idempotency key (so a retry of a request the server
    did process gets the first job back, 200, instead of a second job). A 429/503 answer to
    the retry is a definite answer: the client honours its Retry-After as for any 429."""

    retries: int = 1
    backoff_s: float = 0.5
    """The first retry waits backoff_s..2*backoff_s (uniform jitter), doubling per retry."""


#: Why a transport error of each kind is back-pressure a client retry covers, not a defect.
#: Only errors whose retry got a definite answer are called covered (see TransportFailure).
COVERED_BECAUSE = {
    "ConnectError": (
        "connection refused or reset while connecting: the API's listen backlog was full or "
        "its accept loop starved of CPU; the request never reached the handler, so nothing was "
        "created and the retry is always safe"),
    "ConnectTimeout": (
        "the connection was not accepted in time (accept loop starved of CPU); the request "
        "never reached the handler, so the retry is always safe"),
    "PoolTimeout": (
        "the client's own connection pool had no free connection in time; never sent"),
    "ReadTimeout": (
        "sent, but not answered within the client timeout while the API shared 2 cores with "
        "the hogs, the stack and the burst: slow, not wedged (the retry was answered); the "
        "idempotency key makes the retry safe"),
    "WriteTimeout": (
        "the request body could not be written in time (server not reading, CPU-starved); "
        "the idempotency key makes the retry safe"),
    "RemoteProtocolError": (
        "the server closed the connection without an answer: a kept-alive connection it "
        "closed at its keep-alive timeout just as the request went out (the standard HTTP/1.1 "
        "race every client retries); the idempotency key makes the retry safe"),
    "ReadError": (
        "the connection was reset under the request (keep-alive close race or a starved "
        "server); the idempotency key makes the retry safe"),
    "WriteError": (
        "the connection was reset as the request was written (keep-alive close race); the "
        "idempotency key makes the retry safe"),
}


@dataclass
class TransportFailure:
    """One request of a burst that got no HTTP answer, and what a client retry made of it."""

    index: int
    kind: str
    """The httpx exception class (ConnectError, ReadTimeout, RemoteProtocolError ...)."""
    message: str
    at_s: float
    """When it was sent, seconds into the burst."""
    after_s: float
    """How long the failed attempt took."""
    idempotency_key: str | None = None
    retry: str = "not retried"
    """The retry's outcome: an HTTP status, an exception class, or 'not retried'."""
    retry_after: str | None = None
    job_id: str | None = None
    """The job the retry returned (201 new, or 200 the first attempt's, replayed)."""
    covered: bool = False
    why: str = ""

    def judge(self) -> None:
        """Covered: the retry got a definite, well-formed answer (the job, or a 429 with
        Retry-After); anything else (a second transport error, a 5xx, a 4xx other than a
        429 with Retry-After) is not covered and fails the drill."""
        status = int(self.retry) if self.retry.isdigit() else None
        if status in (200, 201):
            self.covered = True
            replay = ("200, a replay: the first attempt had created the job, only its answer "
                      "was lost" if status == 200 else "201: the first attempt created nothing")
            self.why = f"{COVERED_BECAUSE.get(self.kind, self.kind)}; retry got {replay}"
        elif status == 429 and self.retry_after:
            self.covered = True
            self.why = (f"{COVERED_BECAUSE.get(self.kind, self.kind)}; retry got 429 "
                        f"Retry-After={self.retry_after} (a definite answer the client honours)")
        else:
            self.covered = False
            self.why = (f"retry after {self.kind} got {self.retry}"
                        + (f" Retry-After={self.retry_after}" if self.retry_after else "")
                        + ": no client retry covers this")


@dataclass
class BurstResult:
    """What a burst of submissions at the API saw."""

    offered: int = 0
    """Requests the schedule called for (rate x duration)."""
    sent: int = 0
    skipped: int = 0
    """Requests not sent because ``concurrency`` were already in flight (the bound)."""
    statuses: Counter[int] = field(default_factory=Counter)
    """First attempts' answers (a retry's answer is in its TransportFailure)."""
    errors: int = 0
    """Transport errors of first attempts (refused, reset, timed out)."""
    failures: list[TransportFailure] = field(default_factory=list)
    """Each transport error, with its retry's outcome when the burst had a RetryPolicy."""
    unfinished: int = 0
    """Requests (or their retries) still unanswered when the burst gave up waiting."""
    latencies_s: list[float] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    """Ids of the jobs the API accepted (201, or a retry's 200 replay)."""
    retry_after_missing: int = 0
    """429 or 503 answers without a Retry-After header."""
    duration_s: float = 0.0

    @property
    def uncovered(self) -> list[TransportFailure]:
        """Transport errors no client retry covered (all of them without a RetryPolicy)."""
        return [f for f in self.failures if not f.covered]

    def percentile_s(self, q: float) -> float | None:

        return percentile(self.latencies_s, 100 * q)

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.percentile_s(0.5), self.percentile_s(0.99)
        covered = [f for f in self.failures if f.covered]
        return {
            "offered": self.offered, "sent": self.sent, "skipped_at_bound": self.skipped,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "transport_errors": self.errors,
            "transport_errors_covered": len(covered),
            "transport_errors_uncovered": len(self.uncovered),
            "transport_errors_by_kind": dict(Counter(f.kind for f in self.failures)),
            "retry_outcomes": dict(Counter(f.retry for f in self.failures)),
            "why_covered": sorted({f.why for f in covered}),
            "uncovered": [asdict(f) for f in self.uncovered[:20]],
            "transport_error_samples": [asdict(f) for f in self.failures[:10]],
            "unfinished": self.unfinished, "accepted": len(self.accepted),
            "p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "p99_ms": None if p99 is None else round(p99 * 1000, 1),
            "retry_after_missing": self.retry_after_missing,
            "duration_s": round(self.duration_s, 2),
        }


def api_burst(url: str, key: str, spec: dict[str, Any], *, rate_per_s: float,
              duration_s: float, concurrency: int = 64, timeout_s: float = 10.0,
              retry: RetryPolicy | None = None) -> BurstResult:
    """POST ``spec`` to ``url``/v1/jobs at ``rate_per_s`` for ``duration_s``, with at most
    ``concurrency`` requests in flight; stops by itself. Loopback addresses only. With
    ``retry``, each request carries its own idempotency key and a transport error is retried
    as ``retry`` says (the retry holds the request's slot, as a real client's would)."""
    host = url.split("//", 1)[-1].split(":", 1)[0].split("/", 1)[0]
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise ValueError(f"a burst is aimed at loopback only, not {host}")
    return asyncio.run(_burst(url, key, spec, rate_per_s, duration_s, concurrency, timeout_s,
                              retry))


async def _burst(url: str, key: str, spec: dict[str, Any], rate_per_s: float,
                 duration_s: float, concurrency: int, timeout_s: float,
                 retry: RetryPolicy | None) -> BurstResult:
    import httpx

    result = BurstResult(offered=int(rate_per_s * duration_s))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    in_flight: set[asyncio.Task[None]] = set()
    tag = f"burst-{uuid.uuid4().hex[:12]}"
    accepted: set[str] = set()
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, limits=limits,
                                 timeout=timeout_s) as client:

        def take(response: httpx.Response) -> str | None:
            if response.status_code in (200, 201):
                job_id = str(response.json()["id"])
                if job_id not in accepted:
                    accepted.add(job_id)
                    result.accepted.append(job_id)
                return job_id
            return None

        async def again(failure: TransportFailure, body: dict[str, Any]) -> None:
            assert retry is not None
            for attempt in range(retry.retries):
                await asyncio.sleep(retry.backoff_s * 2 ** attempt * (1 + random.random()))
                try:
                    response = await client.post("/v1/jobs", json=body)
                except httpx.HTTPError as exc:
                    failure.retry = exc.__class__.__name__
                    continue
                failure.retry = str(response.status_code)
                failure.retry_after = response.headers.get("Retry-After")
                failure.job_id = take(response)
                break
            failure.judge()

        async def one(index: int) -> None:
            body = spec
            if retry is not None:
                body = {**spec, "idempotency_key": f"{tag}-{index}"}
            started = time.perf_counter()
            try:
                response = await client.post("/v1/jobs", json=body)
            except httpx.HTTPError as exc:
                result.errors += 1
                failure = TransportFailure(
                    index=index, kind=exc.__class__.__name__, message=str(exc)[:160],
                    at_s=round(started - begun, 3),
                    after_s=round(time.perf_counter() - started, 3),
                    idempotency_key=body.get("idempotency_key"))
                result.failures.append(failure)
                if retry is not None:
                    await again(failure, body)
                else:
                    failure.judge()
                return
            result.latencies_s.append(time.perf_counter() - started)
            result.statuses[response.status_code] += 1
            if response.status_code == 201:
                take(response)
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
            task = asyncio.create_task(one(i))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            result.sent += 1
        if in_flight:
            await _drain(in_flight, result, timeout_s, retry)
        result.duration_s = time.perf_counter() - begun
    return result


async def _drain(in_flight: set[asyncio.Task[None]], result: BurstResult, timeout_s: float,
                 retry: RetryPolicy | None) -> None:
    """Wait for the burst's requests still in flight, then cancel and count those left."""
    # an attempt may take connect + write + read timeouts; a retry as long again
    attempts = 1 + (retry.retries if retry is not None else 0)
    backoff_s = 0.0 if retry is None else 2 * retry.backoff_s * 2 ** retry.retries
    _, pending = await asyncio.wait(in_flight, timeout=3 * timeout_s * attempts
                                    + backoff_s + 1)
    result.unfinished = len(pending)
    for task in pending:
        task.cancel()
    for failure in result.failures:
        if not failure.why:  # its retry was still in flight
            failure.why = "still retrying when the burst stopped waiting"


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


# CPU contention ---------------------------------------------------------------------------
HOG_CODE = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:  # a hog orphaned by a killed drill stops by itself\n"
    "    for _ in range(1_000_000):\n"
    "        pass\n"
)


class CpuHogs:
    """``count`` busy OS processes (pure-CPU Python loops at the default priority) competing
    with the stack for the cores while this context is open; killed and reaped on exit, also
    on an error or KeyboardInterrupt. Records the CPU time they got.

    Each hog is a session of its own, like each process of the stack: with Linux's scheduler
    autogroups (``kernel.sched_autogroup_enabled``), hogs sharing the drill's session would
    share one CPU share among them all and compete as a single process."""

    def __init__(self, count: int) -> None:
        if not 0 <= count <= 64:
            raise ValueError(f"cpu hogs must be 0..64, not {count}")
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self._started = 0.0
        self._stopped = False

    def __enter__(self) -> CpuHogs:
        self._started = time.monotonic()
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", HOG_CODE, str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Kill every hog, then reap each one, adding up the CPU time it consumed."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            self.cpu_s += _reap(proc)
        if self.procs:
            self.wall_s = time.monotonic() - self._started
            self._stopped = True
        self.procs.clear()

    def alive(self) -> int:
        return sum(1 for proc in self.procs if proc.poll() is None)

    def summary(self) -> dict[str, Any]:
        running = self._started and not self._stopped
        wall = time.monotonic() - self._started if running else self.wall_s
        return {"count": self.count, "cpu_s": round(self.cpu_s, 1), "wall_s": round(wall, 1),
                "cores_used": round(self.cpu_s / wall, 2) if wall else 0.0,
                "cores": os.cpu_count()}


def _reap(proc: subprocess.Popen[bytes]) -> float:
    """Wait for a killed child; its user + system CPU seconds (0 if someone reaped it first)."""
    if proc.returncode is not None:
        return 0.0
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        proc.wait()
        return 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return float(usage.ru_utime + usage.ru_stime)


class LoadSampler:
    """Samples the 1-minute load average, and how busy the cores were, on a background
    thread while this context is open."""

    def __init__(self, period_s: float = 2.0) -> None:
        self.period_s = period_s
        self.samples: list[float] = []
        self._cpu_start = _cpu_times()
        self._cpu_end = self._cpu_start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="loadavg")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._cpu_start = _cpu_times()
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append(os.getloadavg()[0])
        self._cpu_end = _cpu_times()

    def summary(self) -> dict[str, Any]:
        s = self.samples or [0.0]
        busy = idle = 0
        if self._cpu_start and self._cpu_end:
            busy = self._cpu_end[0] - self._cpu_start[0]
            idle = self._cpu_end[1] - self._cpu_start[1]
        return {"loadavg_1m": {"start": round(s[0], 2), "mean": round(sum(s) / len(s), 2),
                               "max": round(max(s), 2), "end": round(s[-1], 2),
                               "samples": len(s)},
                "cpu_busy_pct": round(100 * busy / (busy + idle), 1) if busy + idle else None}


def _cpu_times() -> tuple[int, int] | None:
    """(busy, idle) jiffies of all cores together, from /proc/stat (None where absent)."""
    try:
        with open("/proc/stat") as handle:
            cols = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = cols[3] + (cols[4] if len(cols) > 4 else 0)  # idle + iowait
    return sum(cols[:8]) - idle, idle
