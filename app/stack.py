"""``stepline up``: the embedded Redis, N workers (or MIN..MAX, autoscaled), beat, a scheduler
worker, the API and Flower.

Every process it starts is its child; SIGINT or SIGTERM stops them all, newest first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from app.api.dashboard import TOKEN_FILE as DASHBOARD_TOKEN_FILE
from app.api.dashboard import dashboard_token
from app.api.server import api_command
from app.autoscale import (
    Cause,
    PoolView,
    ScaleAction,
    ScalingDecision,
    ScalingMemory,
    ScalingPolicy,
    ScalingSignals,
    WorkerRange,
    check_decision_invariants,
    decide,
    decision_event,
    read_signals,
    record_event,
)
from app.embedded_redis import EmbeddedRedis
from app.run_files import API_KEY_FILE, API_URL_FILE, write_run_file
from app.tenants import ensure_dev_key, read_or_create_secret
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.errors import StackNotRunning
from tasks.record import UnreadableRecord
from tasks.redact import mask_url
from tasks.routing import CONTROL, WORK_QUEUES
from tasks.runtime import SOCKET_NAME, connect
from tasks.settings import Settings
from tasks.store import JobStore

FLOWER_AUTH_FILE = "flower-auth"

log = logging.getLogger(__name__)


def worker_command(
    name: str, queues: Sequence[str] = WORK_QUEUES, loglevel: str = "INFO"
) -> list[str]:
    """One solo-pool worker: one process per device, strict queue order, prefetch 1."""
    return [
        sys.executable, "-m", "celery", "-A", "app", "worker", "-P", "solo",
        "-Q", ",".join(queues), "-n", name, "--loglevel", loglevel,
        "--without-mingle", "--without-gossip",
    ]


def beat_command(run_dir: Path) -> list[str]:
    # The in-memory scheduler: no shelve file (which would pickle) and nothing to go stale.
    return [sys.executable, "-m", "celery", "-A", "app", "beat", "-S", "celery.beat:Scheduler",
            "--loglevel", "WARNING", "--pidfile", str(run_dir / "beat.pid")]


def flower_command(settings: Settings) -> list[str]:
    """Flower on the broker; its basic-auth login travels in ``FLOWER_BASIC_AUTH`` (Flower reads
    any option from ``FLOWER_<OPTION>``), so the password never shows in the process list."""
    return [sys.executable, "-m", "celery", "-A", "app", "flower",
            f"--port={settings.service.flower_port}", f"--address={settings.api.flower_host}"]


def flower_credentials(settings: Settings, run_dir: Path) -> str:
    """``user:password`` for Flower: the configured password, else one generated once into
    ``<run_dir>/flower-auth`` (mode 0600)."""
    user = settings.api.flower_user
    if settings.api.flower_password:
        return f"{user}:{settings.api.flower_password}"
    return read_or_create_secret(run_dir / FLOWER_AUTH_FILE,
                                 lambda: f"{user}:{secrets.token_urlsafe(18)}")


def wait_for_api(url: str, timeout_s: float = 30.0) -> bool:
    """Poll ``/healthz`` until the API answers 200; False if it never did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def wait_for_ready(url: str, timeout_s: float = 600.0) -> bool:
    """Poll ``/readyz`` until every chunk worker is warm; False if that took over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    return False


@dataclass
class PoolWorker:
    """One worker process of the stack's pool."""

    node: str
    """Its Celery node name (``w3@host``), spelled as heartbeats and job records spell it."""
    proc: subprocess.Popen[bytes]
    drain_since_s: float | None = None
    """When it was told to stop (None while active)."""
    asked_to_yield: bool = False
    killed: bool = False

    @property
    def label(self) -> str:
        """``w3``: its process name in the stack and its log file's."""
        return self.node.split("@", 1)[0]


class Autoscaler:
    """The decision loop's state: the policy, its memory between decisions, when the next
    decision is due (drift-corrected: a late pass is skipped, never made up in a burst), and
    what was last reported."""

    def __init__(self, policy: ScalingPolicy, interval_s: float) -> None:
        self.policy, self.interval_s = policy, interval_s
        self.memory = ScalingMemory()
        self.next_at_s: float | None = None
        self.reported: tuple[ScaleAction, Cause] | None = None

    def due(self, now_s: float) -> bool:
        if self.next_at_s is None:
            self.next_at_s = now_s
        if now_s < self.next_at_s:
            return False
        self.next_at_s += self.interval_s
        if self.next_at_s <= now_s:
            log.debug("autoscale: a decision is late; skipping to the next interval")
            self.next_at_s = now_s + self.interval_s
        return True

    def step(self, signals: ScalingSignals | None, pool: PoolView,
             now_s: float) -> ScalingDecision:
        decision = decide(signals, pool, self.policy, self.memory, now_s)
        check_decision_invariants(decision, pool, self.policy)
        self.memory = decision.memory
        return decision

    def worth_reporting(self, decision: ScalingDecision) -> bool:
        """Every change; a hold only when its cause differs from the last one reported, so the
        event stream reads as transitions rather than a sample per interval."""
        key = (decision.action, decision.cause)
        if decision.action is ScaleAction.HOLD and key == self.reported:
            return False
        self.reported = key
        return True


@dataclass
class Stack:
    """The processes of one running Stepline, owned by this object."""

    settings: Settings
    run_dir: Path
    workers: int = 2
    """Worker processes at start: the whole pool, or its minimum when ``max_workers`` is more."""
    with_beat: bool = True
    with_api: bool = True
    with_flower: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    max_workers: int | None = None
    """Autoscale between ``workers`` and this (``stepline up --workers MIN:MAX``)."""
    on_autoscale: Callable[[str], None] | None = None
    """Called with one line per autoscaler event (``stepline up`` prints them)."""
    redis: EmbeddedRedis | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    pool: list[PoolWorker] = field(default_factory=list)
    """The worker processes, oldest first (draining ones until they exit)."""
    autoscaler: Autoscaler | None = field(default=None, init=False)
    _store: JobStore | None = field(default=None, init=False, repr=False)
    _workers_spawned: int = field(default=0, init=False, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.service.api_host}:{self.settings.service.api_port}"

    @property
    def flower_url(self) -> str:
        return f"http://{self.settings.api.flower_host}:{self.settings.service.flower_port}"

    @property
    def worker_range(self) -> WorkerRange:
        return WorkerRange(self.workers, max(self.max_workers or self.workers, self.workers))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["STEPLINE_RUN_DIR"] = str(self.run_dir.resolve())
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if not self.settings.redis_url:
            self.redis = EmbeddedRedis(
                self.run_dir, appendfsync=self.settings.broker.redis_appendfsync)
            self.redis.start()
        if self.settings.broker.url is not None:  # the broker given: no second embedded server
            store_url = self.redis.url if self.redis is not None else self.settings.redis_url
            log.info("job store %s, broker %s", mask_url(store_url or ""),
                     mask_url(self.settings.broker.url))
        for _ in range(self.workers):
            self.start_worker()
        if not self.worker_range.fixed:
            scaling = self.settings.service.autoscale
            self.autoscaler = Autoscaler(
                ScalingPolicy.from_settings(scaling, self.worker_range), scaling.interval)
        if self.with_beat:
            self.spawn("scheduler", worker_command("scheduler@%h", queues=(CONTROL,),
                                                   loglevel="WARNING"))
            self.spawn("beat", beat_command(self.run_dir))
        if self.with_api:
            if not self.settings.api.keys:
                ensure_dev_key(self.run_dir)  # before the API starts, so clients find it at once
            self.spawn("api", api_command(self.settings))
            write_run_file(self.run_dir, API_URL_FILE, self.api_url)  # for the command line
        if self.with_flower:
            auth = flower_credentials(self.settings, self.run_dir)
            self.spawn("flower", flower_command(self.settings), {"FLOWER_BASIC_AUTH": auth})
        (self.run_dir / "stack.pid").write_text(str(os.getpid()))

    def spawn(
        self, name: str, command: list[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log_file = open(self.run_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (child owns it)
        proc = subprocess.Popen(command, env={**self.env(), **(extra_env or {})}, stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log_file.close()
        self.procs.append((name, proc))
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def start_worker(self) -> PoolWorker:
        """One more chunk worker, ``w<n>``; a name is never reused within a stack, so nothing
        keyed by a drained worker's name (its queue assignment) can mislead a new one."""
        self._workers_spawned += 1
        node = f"w{self._workers_spawned}@{socket.gethostname()}"  # what Celery's %h expands to
        worker = PoolWorker(node, self.spawn(node.split("@")[0], worker_command(node)))
        self.pool.append(worker)
        return worker

    def store(self) -> JobStore:
        """The stack's own store client (for the autoscaler)."""
        if self._store is None:
            url = self.redis.url if self.redis is not None else self.settings.redis_url
            if url is None:
                raise StackNotRunning("the stack has not started: no Redis to read")
            master = self.settings.broker.sentinel_master
            self._store = JobStore(connect(url, sentinel_master=master))
        return self._store

    def dead(self) -> list[str]:
        """Children that exited without being told to (a draining worker's exit is expected)."""
        draining = {w.proc.pid for w in self.pool if w.drain_since_s is not None}
        return [name for name, proc in self.procs
                if proc.poll() is not None and proc.pid not in draining]

    def supervise(self, now_s: float) -> list[str]:
        """One pass of the supervisor loop: follow the drains, and scale when a decision is
        due; returns the children that exited unexpectedly (the caller stops the stack)."""
        self.follow_drains(now_s)
        if dead := self.dead():
            return dead
        if self.autoscaler is not None and self.autoscaler.due(now_s):
            self.scale(now_s)
        return []

    def pool_view(self) -> PoolView:
        live = [w for w in self.pool if w.proc.poll() is None]
        return PoolView(active=tuple(w.node for w in live if w.drain_since_s is None),
                        draining=tuple(w.node for w in live if w.drain_since_s is not None))

    def scale(self, now_s: float) -> ScalingDecision:
        """Read the signals, decide, apply: start workers, or drain the ones named."""
        assert self.autoscaler is not None
        pool = self.pool_view()
        try:
            signals: ScalingSignals | None = read_signals(
                self.store(), now_s, self.settings.scheduler.admission_status_ttl)
        except redis.RedisError as exc:
            log.warning("autoscale: cannot read the signals (%s); holding", exc)
            signals = None
        decision = self.autoscaler.step(signals, pool, now_s)
        for _ in range(decision.workers_to - decision.workers_from):
            self.start_worker()
        for node in decision.retire:
            self.drain(node, now_s)
        if self.autoscaler.worth_reporting(decision):
            self._report(decision.describe(), decision_event(decision, signals, pool, now_s))
        return decision

    def drain(self, node: str, now_s: float) -> None:
        """Stop a worker gracefully. SIGTERM is Celery's warm shutdown: the worker stops
        consuming at once, finishes the chunk it is running (acked late, so only once it has
        committed) and exits. The commit has already published the job's next chunk, fenced by
        epoch and sequence number, for whichever worker takes it."""
        worker = next(w for w in self.pool if w.node == node)
        worker.drain_since_s = now_s
        log.info("draining %s (pid %d)", node, worker.proc.pid)
        _signal_group(worker.proc, signal.SIGTERM)

    def follow_drains(self, now_s: float) -> None:
        """Reap the drained workers; a drain that takes too long first asks the worker's job to
        yield at its next block-group boundary, then kills the worker."""
        scaling = self.settings.service.autoscale
        for worker in list(self.pool):
            if worker.drain_since_s is None:
                continue
            waited_s = now_s - worker.drain_since_s
            code = worker.proc.poll()
            if code is not None:
                self._reap(worker, code, waited_s, now_s)
            elif waited_s >= scaling.drain_timeout and not worker.killed:
                worker.killed = True
                _signal_group(worker.proc, signal.SIGKILL)
                log.warning("%s still running %.1fs after SIGTERM: killed; the lease watchdog "
                            "requeues its chunk from the checkpoint", worker.node, waited_s)
            elif waited_s >= scaling.drain_preempt_after and not worker.asked_to_yield:
                worker.asked_to_yield = True
                self._ask_to_yield(worker.node)

    def _reap(self, worker: PoolWorker, code: int, waited_s: float, now_s: float) -> None:
        self.pool.remove(worker)
        self.procs[:] = [(name, proc) for name, proc in self.procs if proc is not worker.proc]
        how = "killed" if worker.killed else "drained"
        try:  # its queue assignment, kept by the tick's adapter, names a worker gone for good
            self.store().redis.hdel(keys.WORKER_QUEUES, worker.node)
        except redis.RedisError:
            log.debug("could not forget the queues of %s", worker.node, exc_info=True)
        self._report(f"{worker.label} {how} in {waited_s:.1f}s (exit code {code})", {
            "kind": how, "ts": repr(now_s), "worker": worker.node,
            "drain_s": f"{waited_s:.3f}", "exit_code": str(code),
        })

    def _ask_to_yield(self, node: str) -> None:
        """Flag the job running on ``node`` to stop at its next boundary (a durable checkpoint;
        the tick releases it to another worker). Fenced on the state and epoch seen here."""
        try:
            store = self.store()
            for job in store.records(store.active_ids()):
                if (isinstance(job, UnreadableRecord) or job.state is not JobState.RUNNING
                        or job.running_on != node):
                    continue
                if store.request_preempt(job.job_id, state=job.state, epoch=job.epoch):
                    log.warning("job %s: asked to yield: its worker %s is draining",
                                job.job_id, node)
        except redis.RedisError:
            log.warning("could not ask the job on %s to yield", node, exc_info=True)

    def _report(self, line: str, event: dict[str, str]) -> None:
        log.info("autoscale: %s", line)
        try:
            record_event(self.store().redis, event)
        except redis.RedisError:
            log.warning("autoscale: could not record the event %r", line, exc_info=True)
        if self.on_autoscale is not None:
            self.on_autoscale(line)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every child (warm shutdown: running chunks finish), then SIGKILL stragglers."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        self.pool.clear()
        if self._store is not None:
            self._store.redis.close()
            self._store = None
        if self.redis is not None:
            self.redis.stop()
        (self.run_dir / "stack.pid").unlink(missing_ok=True)
        (self.run_dir / API_URL_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile; the next pass reaps it
        os.killpg(proc.pid, sig)


def up_banner(stack: Stack, pool: WorkerRange) -> str:
    """What ``stepline up`` prints once the stack runs: where each part is and where its
    credentials are kept — never a credential itself (the Redis URL's password is masked)."""
    settings, run_dir = stack.settings, stack.run_dir
    where = (mask_url(settings.redis_url) if settings.redis_url
             else f"embedded, {run_dir / SOCKET_NAME}")
    if settings.broker.url is not None:
        where += f", broker {mask_url(settings.broker.url)}"
    key = "configured keys (api.keys)" if settings.api.keys else run_dir / API_KEY_FILE
    login = ("api.flower_password" if settings.api.flower_password
             else run_dir / FLOWER_AUTH_FILE)
    dashboard_token(settings)  # made now, so the line below names a file that exists
    dashboard = ("api.dashboard_token" if settings.api.dashboard_token
                 else run_dir / DASHBOARD_TOKEN_FILE)
    scaling = "" if pool.fixed else (
        f" (autoscaled; decisions below and in the Redis stream {keys.AUTOSCALE_EVENTS})")
    return (f"stepline up: {pool} workers{scaling}, redis {where}\n"
            f"  API     {stack.api_url}  (docs {stack.api_url}/docs, key: {key})\n"
            f"  Flower  {stack.flower_url}  (login: {login})\n"
            f"  SLOs    {stack.api_url}/dashboard?token=TOKEN  (TOKEN: {dashboard})\n"
            f"  logs    {run_dir / 'logs'}")


def run_until_signalled(stack: Stack, on_ready: str = "") -> int:
    """Block until SIGINT/SIGTERM (or a child dies unexpectedly), then stop everything."""
    stopping = False

    def _handler(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    if on_ready:
        print(on_ready, flush=True)
    code = 0
    while not stopping:
        time.sleep(0.1)
        if dead := stack.supervise(time.time()):
            log.error("stopping: %s exited; see %s", ", ".join(dead), stack.run_dir / "logs")
            code = 1
            break
    stack.stop()
    return code
