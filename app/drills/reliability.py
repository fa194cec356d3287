"""``stepline reliability``: start a private embedded stack, run a mixed load of simulated jobs,
inject each fault in turn, try bad inputs, and report whether any accepted job was lost.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import redis
import yaml
from rich.console import Console
from rich.table import Table

from app.celery import app as celery_app
from app.celery import configure as configure_celery
from app.drills.faults import (
    MALFORMED_LOG,
    REFUSAL_LOG,
    CpuHogs,
    LoadSampler,
    MemorySampler,
    RetryPolicy,
    TransportFailure,
    api_burst,
    audit_job,
    publish_malformed,
    publish_pickle,
)
from app.drills.harness import Fault, recorded, wait_until
from app.schemas import JobSpec
from app.stack import Stack, beat_command, wait_for_api, worker_command
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.dispatch import publish_chunk
from tasks.routing import BATCH, CONTROL, INTERACTIVE, REALTIME
from tasks.runtime import current_settings
from tasks.settings import Settings
from tasks.store import JobStore
from tasks.submit import JobService

log = logging.getLogger(__name__)
console = Console()

OPS_KEY = "ops-" + secrets.token_hex(12)
FLOOD_KEY = "flood-" + secrets.token_hex(12)
FLOOD_TENANT = "flood"
BURST_RETRY = RetryPolicy(retries=1, backoff_s=0.5)
"""The client retry the burst's transport errors are judged by (see faults.RetryPolicy)."""
WORKERS = ("w1", "w2", "w3")
SCHEDULERS = ("scheduler", "scheduler2")
HANG_S = 4.0
"""How long a worker or scheduler stays SIGSTOPped: past the chunk lease (1.5 s here)."""
HUNG_BURST = 8
"""Interactive jobs submitted while a worker hangs: each must finish on another worker."""
# (class, steps, step_ms, block groups): urgent short jobs among long, splittable batch jobs.
LOAD_CYCLE = [
    (SloClass.REALTIME, 3, 10.0, 1), (SloClass.INTERACTIVE, 8, 40.0, 1),
    (SloClass.REALTIME, 3, 10.0, 1), (SloClass.BATCH, 30, 100.0, 1),
    (SloClass.REALTIME, 3, 10.0, 1), (SloClass.INTERACTIVE, 8, 40.0, 1),
    (SloClass.REALTIME, 3, 10.0, 1), (SloClass.BATCH, 20, 150.0, 3),
]


@dataclass
class BadInput:
    """One hostile or malformed request and how it was answered."""

    name: str
    expected: int
    status: int | None
    ok: bool
    detail: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Load(threading.Thread):
    """Submits the load cycle every ``period_s`` through the job service until stopped; a submit
    that fails (Redis down) is counted, not accepted."""

    def __init__(self, service: JobService, period_s: float = 0.3) -> None:
        super().__init__(daemon=True, name="load")
        self.service = service
        self.period_s = period_s
        self.accepted: dict[str, SloClass] = {}
        self.refused = 0
        self.halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        index = 0
        while not self.halt.wait(self.period_s):
            slo, steps, step_ms, groups = LOAD_CYCLE[index % len(LOAD_CYCLE)]
            index += 1
            spec = JobSpec(kind="simulated", slo=slo, deadline_s=None if slo is not
                           SloClass.BATCH else 600,
                           params={"steps": steps, "step_ms": step_ms, "block_groups": groups})
            try:
                job_id, _ = self.service.submit(spec)
            except (redis.ConnectionError, redis.TimeoutError):
                self.refused += 1
                continue
            with self._lock:
                self.accepted[job_id] = slo

    def ids(self) -> list[str]:
        with self._lock:
            return list(self.accepted)


class Drill:
    """The stack under test, the load on it, and the faults injected into it."""

    def __init__(self, stack: Stack, settings: Settings) -> None:
        self.stack = stack
        self.settings = settings
        assert stack.redis is not None
        self.client = redis.Redis.from_url(stack.redis.url, socket_timeout=10)
        self.store = JobStore(self.client)
        self.service = JobService(self.store, settings)
        self.artifacts = ArtifactStore.from_settings(settings)
        self.load = Load(self.service)
        self.cancelled: set[str] = set()
        self.extra_jobs: list[str] = []
        self.faults: list[Fault] = []

    # processes --------------------------------------------------------------------------------
    def proc(self, name: str) -> subprocess.Popen[bytes]:
        return next(p for n, p in self.stack.procs if n == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.proc(name)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        self.stack.procs.remove((name, proc))

    def respawn(self, name: str) -> None:
        if name in WORKERS:
            self.stack.spawn(name, worker_command(f"{name}@%h"))
        elif name in SCHEDULERS:
            self.stack.spawn(name, worker_command(f"{name}@%h", queues=(CONTROL,),
                                                  loglevel="WARNING"))
        elif name == "beat":
            self.stack.spawn(name, beat_command(self.stack.run_dir))

    def log_text(self, name: str) -> str:
        return (self.stack.run_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def workers_ready(self, names: tuple[str, ...] = WORKERS + SCHEDULERS) -> bool:

        live = {name.split("@")[0] for name in self.store.heartbeats()}
        return set(names) <= live

    def consumers_ready(self, timeout_s: float,
                        names: tuple[str, ...] = WORKERS + SCHEDULERS) -> float | None:
        """Seconds until every worker's Celery consumer answered a broadcast ping, or None.
        A heartbeat is renewed by its own thread and comes back as soon as Redis does; the
        consumer reconnects on Celery's backoff, and only then does the worker take chunks."""
        started = time.monotonic()
        answered: set[str] = set()
        while time.monotonic() - started < timeout_s:
            try:
                replies = celery_app.control.ping(timeout=1.0)
            except Exception:  # the broker connection is itself coming back
                log.debug("ping", exc_info=True)
                time.sleep(0.2)
                continue
            answered |= {name.split("@")[0] for reply in replies for name in reply}
            if set(names) <= answered:
                return time.monotonic() - started
        return None

    # picking victims --------------------------------------------------------------------------
    def running_job(self, groups: int, lo_s: float, hi_s: float) -> dict[str, str] | None:
        """A running job with ``groups`` block groups whose chunk started lo_s..hi_s ago."""
        now = time.time()
        for fields in self.store.many_fields(self.store.active_ids()):
            params = json.loads(fields["params"])
            if (fields["state"] == JobState.RUNNING.value and fields.get("chunk_started_at")
                    and int(params.get("block_groups", 1)) == groups
                    and int(fields["next_chunk"]) >= 1
                    and lo_s <= now - float(fields["chunk_started_at"]) <= hi_s):
                return fields
        return None

    @contextmanager
    def fault(self, kind: str) -> Iterator[Fault]:
        """Drive one fault (recorded by :func:`~app.drills.harness.recorded`); its recovery
        is the whole block's time."""
        started = time.monotonic()
        console.print(f"[bold]fault[/bold] {kind} …")
        with recorded(kind, self.faults) as fault:
            yield fault
        fault.recovery_s = round(time.monotonic() - started, 2)
        console.print(f"  → {fault.detail}")

    # the faults -------------------------------------------------------------------------------
    def kill_worker_mid_chunk(self, kind: str, groups: int, lo_s: float, hi_s: float) -> None:
        with self.fault(kind) as fault:
            victim = wait_until(lambda: self.running_job(groups, lo_s, hi_s), 30, 0.01)
            if victim is None:
                fault.detail = "no running job of that shape appeared in 30 s"
                return
            worker = victim["running_on"].split("@")[0]
            chunk, epoch = victim["next_chunk"], int(victim["epoch"])
            into_s = time.time() - float(victim["chunk_started_at"])
            self.kill(worker)
            fault.injected, fault.victims = True, [victim["id"]]
            killed = time.monotonic()
            requeued = wait_until(lambda: int(self.store.fields(victim["id"])["epoch"]) > epoch, 30)
            requeue_s = time.monotonic() - killed
            self.respawn(worker)
            fault.survived = bool(requeued)
            fault.detail = (f"SIGKILLed {worker} {into_s:.2f}s into chunk {chunk} of job "
                            f"{victim['id']}; requeued under a new epoch after {requeue_s:.1f}s")

    def hang_worker_mid_chunk(self, hold_s: float = HANG_S) -> None:
        """SIGSTOP the worker running a chunk (alive, its connections open, no heartbeat) while
        interactive jobs keep arriving: its chunk and every new job finish on the others within
        the heartbeat timeout; thawed, its late commit is fenced and it serves again."""
        with self.fault("worker_sigstop_mid_step") as fault:
            victim = wait_until(lambda: self.running_job(1, 0.0, 0.05), 30, 0.01)
            if victim is None:
                fault.detail = "no running job appeared in 30 s"
                return
            worker = victim["running_on"].split("@")[0]
            proc = self.proc(worker)
            os.killpg(proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            fault.injected = True
            try:
                spec = JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                               params={"steps": 4, "step_ms": 60.0, "block_groups": 1})
                burst = [self.service.submit(spec)[0] for _ in range(HUNG_BURST)]
                fault.victims = [victim["id"], *burst]
                moved = wait_until(lambda: int(self.store.fields(victim["id"])["epoch"])
                                   > int(victim["epoch"]), 30)
                moved_s = time.monotonic() - stopped
                finished = wait_until(lambda: all(self.store.state(j) is JobState.DONE
                                             for j in burst), 30)
                finished_s = time.monotonic() - stopped
                time.sleep(max(0.0, hold_s - (time.monotonic() - stopped)))
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
            thawed = time.time()
            node = f"{worker}@{socket.gethostname()}"
            back = wait_until(lambda: (b := self.store.heartbeats().get(node)) is not None
                              and (b.ts or 0) > thawed, 30)
            fault.survived = bool(moved and finished and back) and proc.poll() is None
            fault.detail = (f"SIGSTOPped {worker} in chunk {victim['next_chunk']} of job "
                            f"{victim['id']}; requeued under a new epoch after {moved_s:.2f}s; "
                            f"{len(burst)} interactive jobs submitted while it hung "
                            f"{'all' if finished else 'NOT all'} done after {finished_s:.2f}s; "
                            f"thawed after {hold_s:.0f}s, "
                            f"{'serving again' if back else 'NOT back'}")

    def hang_tick_holder(self, hold_s: float = HANG_S) -> None:
        """SIGSTOP the scheduler holding the tick lease: the other one takes the lease over;
        thawed, the hung one finds it taken and stands by."""
        with self.fault("scheduler_sigstop") as fault:
            holder = wait_until(lambda: self.client.get(keys.TICK_LEASE), 10)
            if holder is None:
                fault.detail = "no scheduler held the tick lease"
                return
            name = holder.decode().split("@")[0]
            proc = self.proc(name)
            os.killpg(proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            fault.injected = True

            def new_holder() -> str | None:
                raw = cast(bytes | None, self.client.get(keys.TICK_LEASE))
                other = raw.decode() if raw is not None else None
                return other if other and other.split("@")[0] != name else None

            try:
                other = wait_until(new_holder, 15)
                takeover_s = time.monotonic() - stopped
                time.sleep(max(0.0, hold_s - (time.monotonic() - stopped)))
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(1.0)
            kept = new_holder()  # the thawed one stands by
            fault.survived = bool(other and kept) and proc.poll() is None
            fault.detail = (f"SIGSTOPped the tick lease holder {name}; "
                            + (f"{other} took the lease after {takeover_s:.2f}s"
                               if other else "no scheduler took the lease in 15 s")
                            + f"; thawed after {hold_s:.0f}s, the lease "
                            + ("stayed with the other" if kept else "came back to it"))

    def kill_tick_holder(self) -> None:

        with self.fault("scheduler_kill") as fault:
            holder = wait_until(lambda: self.client.get(keys.TICK_LEASE), 10)
            if holder is None:
                fault.detail = "no scheduler held the tick lease"
                return
            name = holder.decode().split("@")[0]
            self.kill(name)
            fault.injected = True
            killed = time.monotonic()
            def new_holder() -> str | None:
                raw = cast(bytes | None, self.client.get(keys.TICK_LEASE))
                holder = raw.decode() if raw is not None else None
                return holder if holder and holder.split("@")[0] != name else None

            other = wait_until(new_holder, 15)
            takeover_s = time.monotonic() - killed
            self.respawn(name)
            fault.survived = bool(other)
            fault.detail = (f"SIGKILLed the tick lease holder {name}; "
                            + (f"{other} took the lease after {takeover_s:.2f}s"
                               if other else "no scheduler took the lease in 15 s"))

    def kill_beat(self) -> None:

        def ticks_since(since: float) -> int:
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]],
                           self.client.xrevrange(keys.TICK_STATS, count=200))
            return sum(1 for _, f in entries if float(f[b"ts"]) > since)

        with self.fault("beat_kill") as fault:
            self.kill("beat")
            fault.injected = True
            time.sleep(0.3)
            silent_from = time.time()
            time.sleep(1.5)
            silent = ticks_since(silent_from) == 0
            restarted = time.monotonic()
            self.respawn("beat")
            resumed = wait_until(lambda: ticks_since(silent_from) >= 3, 30)
            fault.survived = silent and bool(resumed)
            fault.detail = (f"SIGKILLed beat: {'no' if silent else 'still'} ticks while down; "
                            f"restarted, ticks resumed after {time.monotonic() - restarted:.1f}s")

    def restart_redis(self, sig: int) -> None:
        assert self.stack.redis is not None
        kind = "redis_restart_sigterm" if sig == signal.SIGTERM else "redis_restart_sigkill"
        with self.fault(kind) as fault:
            pid = int(self.client.info("server")["process_id"])
            os.kill(pid, sig)
            fault.injected = True
            down = time.monotonic()
            time.sleep(0.3)
            answers = self.outage_answers()
            time.sleep(1.0)
            self.stack.redis.stop()
            self.stack.redis.start()
            back = wait_until(lambda: httpx.get(self.stack.api_url + "/healthz",
                                           timeout=2).status_code == 200, 20)
            down_s = time.monotonic() - down
            ready = wait_until(self.workers_ready, 30)
            consuming_s = self.consumers_ready(30)
            fault.survived = bool(back and ready and consuming_s is not None and answers["ok"])
            consuming = ("no" if consuming_s is None
                         else f"{time.monotonic() - down:.1f}s after the kill")
            fault.detail = (f"redis-server {'SIGTERM' if sig == signal.SIGTERM else 'SIGKILL'}, "
                            f"down {down_s:.1f}s; API during outage: "
                            f"{answers['seen']}; workers back: {bool(ready)} (heartbeats), "
                            f"consuming again {consuming}")

    def outage_answers(self) -> dict[str, Any]:
        seen, ok = [], True
        headers = {"X-API-Key": OPS_KEY}
        for method, path in (("GET", "/healthz"), ("POST", "/v1/jobs")):
            try:
                response = httpx.request(method, self.stack.api_url + path, headers=headers,
                                         json={"kind": "simulated", "params": {}}, timeout=10)
            except httpx.HTTPError as exc:
                seen.append(f"{path}: {exc.__class__.__name__}")
                ok = False
                continue
            good = (response.status_code == 503 and "Retry-After" in response.headers
                    and "Traceback" not in response.text)
            ok = ok and good
            seen.append(f"{path} {response.status_code} Retry-After="
                        f"{response.headers.get('Retry-After')}")
        return {"ok": ok, "seen": ", ".join(seen)}

    def duplicate_delivery(self) -> None:

        with self.fault("duplicate_delivery") as fault:
            victim = wait_until(lambda: self.running_job(1, 0.0, 0.05), 30, 0.01)
            if victim is None:
                fault.detail = "no running job to duplicate"
                return
            job_id, chunk, epoch = victim["id"], int(victim["next_chunk"]), int(victim["epoch"])
            queue = victim["queue"]
            publish_chunk(self.store, self.store.record(job_id), chunk=chunk, epoch=epoch,
                          queue=queue)
            wait_until(lambda: int(self.store.fields(job_id)["next_chunk"]) > chunk, 30)
            publish_chunk(self.store, self.store.record(job_id), chunk=chunk, epoch=epoch,
                          queue=queue)
            fault.injected, fault.victims, fault.survived = True, [job_id], True
            fault.detail = (f"chunk {chunk} of job {job_id} published twice while running, "
                            "and once more after it committed")

    def poison_messages(self) -> None:

        with self.fault("poison_messages") as fault:
            canary = self.stack.run_dir / "unpickled-canary"
            for queue in (REALTIME, BATCH, CONTROL):
                publish_pickle(celery_app, queue, canary=canary)
            sent = publish_malformed(celery_app, INTERACTIVE)
            fault.injected = True
            names = WORKERS + SCHEDULERS
            refused = wait_until(lambda: sum(REFUSAL_LOG in self.log_text(n) for n in names) >= 2
                                 and any(MALFORMED_LOG in self.log_text(n) for n in WORKERS), 20)
            alive = not set(self.stack.dead()) & set(names)
            fault.survived = bool(refused) and alive and not canary.exists()
            fault.detail = (f"3 pickle + {len(sent)} malformed messages: refusals logged "
                            f"{bool(refused)}, nothing unpickled {not canary.exists()}, "
                            f"every consumer alive {alive}")

    def cancel_some(self, count: int = 2) -> None:
        """Intentional cancellations: these jobs may end CANCELLED without counting as lost."""
        spec = JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=600,
                       params={"steps": 40, "step_ms": 100})
        for _ in range(count):
            job_id, _ = self.service.submit(spec)
            self.cancelled.add(job_id)
            self.extra_jobs.append(job_id)
        time.sleep(0.5)
        for job_id in self.cancelled:
            self.store.request_cancel(job_id)

    def burst(self, rate_per_s: int, duration_s: float) -> dict[str, Any]:
        with self.fault("api_burst") as fault:
            redis_pid = int(self.client.info("server")["process_id"])
            pids = {"redis": redis_pid, "api": self.proc("api").pid}
            before = set(self.load.ids())
            with MemorySampler(pids) as memory:
                result = api_burst(self.stack.api_url, FLOOD_KEY,
                                   {"kind": "simulated", "slo": "batch",
                                    "params": {"steps": 1, "step_ms": 5}},
                                   rate_per_s=rate_per_s, duration_s=duration_s, concurrency=32,
                                   retry=BURST_RETRY)
            self.extra_jobs.extend(result.accepted)
            # A request that failed in transport may still have created its job: its
            # idempotency key says which. Those jobs are audited like any other.
            unknown = self.created_unknown(result.failures, set(result.accepted))
            self.extra_jobs.extend(unknown)
            during = [j for j in self.load.ids() if j not in before]
            summary = {**result.summary(), "memory": memory.summary_mb(),
                       "realtime_during_burst": during,
                       "created_by_failed_requests_unknown_to_client": unknown,
                       "retry_policy": asdict(BURST_RETRY)}
            server_errors = sum(n for s, n in result.statuses.items() if s >= 500)
            uncovered = len(result.uncovered)
            fault.injected = True
            # Transport errors a standard client retry covers are back-pressure (each one's
            # reason is in the report); only uncovered ones, or requests never answered, fail.
            fault.survived = server_errors == 0 and uncovered == 0 and result.unfinished == 0
            errors = f"transport errors {result.errors}"
            if result.errors:
                kinds = ", ".join(f"{k} {n}" for k, n in
                                  summary["transport_errors_by_kind"].items())
                errors += (f" ({kinds}; {result.errors - uncovered} covered by one client "
                           f"retry, {uncovered} uncovered; retries got "
                           f"{summary['retry_outcomes']})")
            if result.unfinished:
                errors += f", {result.unfinished} requests never answered"
            fault.detail = (f"{result.sent}/{result.offered} sent (bound 32 in flight), "
                            f"statuses {dict(result.statuses)}, {errors}, p99 "
                            f"{summary['p99_ms']} ms, RSS max api "
                            f"{summary['memory'].get('api', {}).get('max_mb')} MB / redis "
                            f"{summary['memory'].get('redis', {}).get('max_mb')} MB")
        return summary

    def created_unknown(self, failures: list[TransportFailure], known: set[str]) -> list[str]:
        """Jobs created by burst requests that failed in transport whose retry did not
        return them (the idempotency key maps each request to the job it created)."""
        found = []
        for failure in failures:
            if failure.idempotency_key:
                raw = self.client.get(keys.idempotency(FLOOD_TENANT, failure.idempotency_key))
                if raw is not None and (job_id := cast(bytes, raw).decode()) not in known:
                    found.append(job_id)
        return found


# bad inputs ----------------------------------------------------------------------------------
def try_bad_inputs(api_url: str, flower_url: str) -> list[BadInput]:
    """Hostile and malformed requests: each must get a clear 4xx, never a 5xx or a trace."""
    good = {"Authorization": f"Bearer {OPS_KEY}"}
    cases: list[tuple[str, int, str, str, dict[str, str], Any]] = [
        ("no API key", 401, "POST", "/v1/jobs", {}, {"kind": "simulated"}),
        ("unknown API key", 401, "GET", "/v1/jobs", {"X-API-Key": "x" * 32}, None),
        ("unknown kind", 422, "POST", "/v1/jobs", good, {"kind": "shell", "params": {}}),
        ("negative steps", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {"steps": -1}}),
        ("absurd steps", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {"steps": 10**12}}),
        ("unknown field", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {}, "exec": "rm -rf /"}),
        ("params of the wrong type", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {"steps": "many"}}),
        ("path in idempotency key", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {}, "idempotency_key": "../../x"}),
        ("unknown dependency", 422, "POST", "/v1/jobs", good,
         {"kind": "simulated", "params": {}, "depends_on": ["0123456789abcdef"]}),
        ("traversal in job id", 404, "GET", "/v1/jobs/..%2F..%2Fetc%2Fpasswd/result", good, None),
        ("unknown job", 404, "GET", "/v1/jobs/ffffffffffffffff", good, None),
    ]
    results = []
    with httpx.Client(base_url=api_url, timeout=10) as client:
        for name, expected, method, path, headers, body in cases:
            results.append(_probe(client, name, expected, method, path, headers, body))
        results.append(_probe(client, "malformed JSON body", 422, "POST", "/v1/jobs",
                              {**good, "Content-Type": "application/json"}, b"{nope"))
    with httpx.Client(base_url=flower_url, timeout=10) as client:
        results.append(_probe(client, "Flower API without login", 401, "GET", "/api/workers",
                              {}, None))
        results.append(_probe(client, "Flower API with a wrong login", 401, "GET",
                              "/api/workers", {"Authorization": "Basic c3RlcGxpbmU6bm9wZQ=="},
                              None))
    return results


def _probe(client: httpx.Client, name: str, expected: int, method: str, path: str,
           headers: dict[str, str], body: Any) -> BadInput:
    try:
        if isinstance(body, bytes):
            response = client.request(method, path, headers=headers, content=body)
        else:
            response = client.request(method, path, headers=headers, json=body)
    except httpx.HTTPError as exc:
        return BadInput(name, expected, None, False, exc.__class__.__name__)
    text = response.text
    ok = response.status_code == expected and "Traceback" not in text
    return BadInput(name, expected, response.status_code, ok, text[:160])


# the run -------------------------------------------------------------------------------------
def _configure(run_dir: Path) -> Settings:
    """Settings for the drill's private stack: fast failure detection, free ports, two
    tenants (an operator, and a flood tenant with the default-ish rate limit)."""

    config = run_dir / "reliability.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "broker": {"visibility_timeout": "4s", "unacked_restore_interval": "1s",
                   "chunk_lease": "1.5s", "stuck_min_s": "2s"},
        "service": {"api_port": _free_port(), "flower_port": _free_port()},
        "api": {"keys": [
            {"key": OPS_KEY, "tenant": "ops", "tier": "gold", "rate_limit_per_s": 1000,
             "burst": 1000, "max_queued": 100000},
            {"key": FLOOD_KEY, "tenant": FLOOD_TENANT, "rate_limit_per_s": 20, "burst": 40,
             "max_queued": 200},
        ], "flower_password": secrets.token_urlsafe(16)},
    }))
    os.environ.pop("REDIS_URL", None)  # always a private embedded Redis
    os.environ["STEPLINE_RUN_DIR"] = str(run_dir)
    os.environ["STEPLINE_CONFIG"] = str(config)
    current_settings.cache_clear()
    settings = current_settings()
    configure_celery(settings)
    return settings


def run_reliability(out_dir: Path, burst_s: float = 10.0, burst_rate_per_s: int = 1000,
                    cpu_hogs: int = 0) -> int:
    """The whole drill; writes ``out_dir/reliability.json``; returns the exit code. With
    ``cpu_hogs``, that many busy processes compete for the cores from before the stack starts
    until the drill ends (they are killed and reaped however it ends)."""
    import tempfile

    if not 0 <= cpu_hogs <= 64:
        raise ValueError(f"cpu_hogs must be 0..64, not {cpu_hogs}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out_dir)).resolve()
    settings = _configure(run_dir)
    began = time.monotonic()
    with LoadSampler() as host_load, CpuHogs(cpu_hogs) as hogs:
        if cpu_hogs:
            console.print(f"{cpu_hogs} CPU hogs running (pids "
                          f"{', '.join(str(p.pid) for p in hogs.procs)}) on "
                          f"{os.cpu_count()} cores")
        report = _drill(settings, run_dir, burst_s, burst_rate_per_s)
        hogs_alive = hogs.alive()
    if report is None:
        return 2
    report["cpu_hogs"] = {**hogs.summary(), "alive_at_end": hogs_alive}
    report["host_load"] = host_load.summary()
    report["duration_s"] = round(time.monotonic() - began, 1)
    report["run_dir"] = str(run_dir)
    (out_dir / "reliability.json").write_text(json.dumps(report, indent=2))
    _print_summary(report, out_dir)
    failed = (report["jobs_lost"] or report["jobs_inexact"]
              or any(f["survived"] is not True for f in report["faults"]))
    return 1 if failed else 0


def _drill(settings: Settings, run_dir: Path, burst_s: float,
           burst_rate_per_s: int) -> dict[str, Any] | None:
    """Start the stack, run the load, inject the faults and the burst, try bad inputs, audit;
    the report, or None if the stack did not start."""
    stack = Stack(settings=settings, run_dir=run_dir, workers=len(WORKERS))
    with stack:
        stack.spawn("scheduler2", worker_command("scheduler2@%h", queues=(CONTROL,),
                                                 loglevel="WARNING"))
        drill = Drill(stack, settings)
        if not (wait_until(drill.workers_ready, 90, 0.2) and wait_for_api(stack.api_url, 60)):
            console.print(f"[red]the stack did not start; see {run_dir / 'logs'}")
            return None
        console.print(f"[bold]Stepline reliability drill[/bold]: {len(WORKERS)} workers, 2 "
                      f"schedulers, beat, API, Flower; run dir {run_dir}")
        drill.load.start()
        try:
            time.sleep(4)
            drill.cancel_some()
            for inject in (
                lambda: drill.kill_worker_mid_chunk("worker_sigkill_mid_step", 1, 0.02, 0.06),
                lambda: drill.kill_worker_mid_chunk("worker_sigkill_mid_block_group", 3, 0.06,
                                                    0.09),
                drill.hang_worker_mid_chunk, drill.kill_tick_holder, drill.hang_tick_holder,
                drill.kill_beat, drill.duplicate_delivery,
                drill.poison_messages, lambda: drill.restart_redis(signal.SIGTERM),
                lambda: drill.restart_redis(signal.SIGKILL),
            ):
                inject()
                time.sleep(3)  # steady load between faults: recovery must not need a quiet system
            burst = drill.burst(burst_rate_per_s, burst_s) if burst_s > 0 else {}
        finally:
            drill.load.halt.set()
            drill.load.join(timeout=5)
        bad_inputs = try_bad_inputs(stack.api_url, stack.flower_url)
        return _settle(drill, burst, bad_inputs)


def _settle(drill: Drill, burst: dict[str, Any], bad_inputs: list[BadInput]) -> dict[str, Any]:
    """Wait for every accepted job to end, then audit each one."""
    every = drill.load.ids() + drill.extra_jobs
    console.print(f"waiting for {len(every)} accepted jobs to end …")
    wait_until(lambda: all(drill.store.state(j).is_terminal for j in every), 120, 0.5)
    audits = {j: audit_job(drill.store, drill.artifacts, j) for j in every}
    lost = [j for j, a in audits.items() if a.state is not JobState.DONE
            and not (j in drill.cancelled and a.state is JobState.CANCELLED)]
    inexact = [a.problem() for j, a in audits.items()
               if a.state is JobState.DONE and not a.exact]
    lost_detail = [_ending(drill.store, j) for j in lost[:50]]
    for fault in drill.faults:
        if fault.survived and any(not audits[v].exact for v in fault.victims if v in audits):
            fault.survived = False
            fault.detail += "; a victim job did not end exact"
    by_class: dict[str, Counter[str]] = {}
    for job_id, slo in drill.load.accepted.items():
        record = drill.store.record(job_id)
        counts = by_class.setdefault(slo.value, Counter())
        counts["submitted"] += 1
        counts["done"] += record.state is JobState.DONE
        finished_s = record.finished_at_s
        counts["slo_met"] += bool(finished_s and finished_s <= record.deadline_at_s)
    rt_burst = [drill.store.record(j) for j in burst.get("realtime_during_burst", [])
                if drill.load.accepted.get(j) is SloClass.REALTIME]
    if burst:
        met = sum(1 for r in rt_burst if r.finished_at_s and r.finished_at_s <= r.deadline_at_s)
        burst["realtime_during_burst"] = {"jobs": len(rt_burst), "slo_met": met}
    states = Counter(a.state.value for a in audits.values())
    return {
        "jobs_submitted": len(every), "jobs_completed": states.get("DONE", 0),
        "jobs_cancelled": states.get("CANCELLED", 0), "jobs_lost": len(lost),
        "lost_ids": lost, "lost_by_state": dict(Counter(d["state"] for d in lost_detail)),
        "lost_detail": lost_detail, "jobs_inexact": len(inexact), "inexact": inexact[:20],
        "faults": [asdict(f) for f in drill.faults],
        "bad_inputs": [asdict(b) for b in bad_inputs],
        "load": {"by_class": {k: dict(v) for k, v in by_class.items()},
                 "submits_refused_while_redis_down": drill.load.refused, "burst": burst},
    }


def _ending(store: JobStore, job_id: str) -> dict[str, Any]:
    """How a lost job ended: its state, class, age and the last transition on its stream."""
    fields = store.fields(job_id)
    last = next((e for e in reversed(store.events(job_id)) if e.get("kind") == "state"), {})
    submitted = float(fields.get("submitted_at") or 0)
    return {"id": job_id, "state": fields["state"], "slo": fields.get("slo"),
            "chunks_done": f"{fields.get('next_chunk')}/{fields.get('num_chunks')}",
            "by": last.get("by"), "reason": last.get("reason"),
            "after_s": round(float(last.get("ts") or submitted) - submitted, 2)}


def _print_summary(report: dict[str, Any], out_dir: Path) -> None:
    faults = Table("fault", "injected", "survived", "s", "detail", title="Faults")
    for f in report["faults"]:
        mark = {True: "[green]yes", False: "[red]NO", None: "[yellow]?"}[f["survived"]]
        faults.add_row(f["kind"], "yes" if f["injected"] else "no", mark, str(f["recovery_s"]),
                       f["detail"])
    console.print(faults)
    bad = Table("bad input", "expected", "got", "ok", title="Bad inputs")
    for b in report["bad_inputs"]:
        bad.add_row(b["name"], str(b["expected"]), str(b["status"]),
                    "[green]yes" if b["ok"] else "[red]NO")
    console.print(bad)
    load = Table("class", "submitted", "done", "SLO met", title="Load")
    for slo, c in sorted(report["load"]["by_class"].items()):
        load.add_row(slo, str(c.get("submitted", 0)), str(c.get("done", 0)),
                     str(c.get("slo_met", 0)))
    console.print(load)
    hogs, host = report.get("cpu_hogs", {}), report.get("host_load", {})
    avg = host.get("loadavg_1m", {})
    console.print(
        f"CPU hogs {hogs.get('count', 0)} (they used {hogs.get('cores_used', 0)} of "
        f"{hogs.get('cores')} cores, {hogs.get('cpu_s', 0)} CPU-s in {hogs.get('wall_s', 0)} s); "
        f"load average (1 min) mean {avg.get('mean')}, max {avg.get('max')}; cores busy "
        f"{host.get('cpu_busy_pct')}%")
    burst = report["load"].get("burst") or {}
    if burst:
        console.print(
            f"API burst: transport errors {burst['transport_errors']} "
            f"({burst['transport_errors_covered']} covered by one client retry, "
            f"{burst['transport_errors_uncovered']} uncovered), "
            f"{burst['unfinished']} never answered")
        for why in burst["why_covered"]:
            console.print(f"  covered: {why}")
        for failure in burst["uncovered"]:
            console.print(f"  [red]uncovered[/]: request {failure['index']}: {failure['kind']} "
                          f"({failure['message']}); {failure['why']}")
    for lost in report.get("lost_detail", []):
        console.print(f"  [red]lost[/] {lost['id']} {lost['slo']} {lost['state']} after "
                      f"{lost['after_s']}s ({lost['chunks_done']} chunks) by {lost['by']}: "
                      f"{lost['reason']}")
    colour = "green" if report["jobs_lost"] == 0 and report["jobs_inexact"] == 0 else "red"
    console.print(
        f"[bold {colour}]jobs submitted {report['jobs_submitted']}, completed "
        f"{report['jobs_completed']}, cancelled on purpose {report['jobs_cancelled']}, lost "
        f"{report['jobs_lost']}, inexact {report['jobs_inexact']}[/] in {report['duration_s']}s; "
        f"report: {out_dir / 'reliability.json'}")
