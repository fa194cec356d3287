"""``stepline reliability --hosts N``: the failure drill across hosts.

N simulated hosts (network namespaces, :mod:`app.drills.netns`; the services and processes on
them built by :mod:`app.drills.host_setup`) joined by a bridge namespace that holds the shared
services: Redis (a master, two replicas and three sentinels, password protected) and an S3
object store (SeaweedFS). Each host runs what an operator would start on a machine of its own:
a chunk worker, and on host 0 also the API, the scheduler and beat, each with its own run
directory (its own disk), Redis through the sentinels and artifacts in the bucket. The drill's
own client (the load, the checks) runs in a client namespace: nothing in the machine's own
namespace talks to the hosts.

Faults, one at a time under a steady load, each timed to its recovery: a host SIGKILLed
mid-step, a host's link down and up, a host's chunk worker SIGSTOPped mid-step (hung: alive,
its connections open, no heartbeat) while interactive jobs arrive, the scheduler holding the
tick lease SIGSTOPped (a standby scheduler on the last host takes over), the Redis master
SIGSTOPped past the sentinels' timeout, the master SIGKILLed, a ``SENTINEL FAILOVER``, the
object store restarted. Every accepted job
must end DONE, each chunk committed once, its artifact byte-identical to an uninterrupted run
of the same parameters (reference jobs run before the first fault).
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import yaml

from app.drills.faults import audit_job
from app.drills.harness import Fault, recorded, wait_until
from app.drills.host_setup import (
    API_PORT,
    BUCKET,
    DOWN_AFTER_MS,
    MASTER_NAME,
    REDIS_PORTS,
    Hosts,
    ObjectStore,
    RedisHA,
    scheduler_node,
    worker_node,
)
from app.drills.netns import BRIDGE_IP, Netns, host_ip, inside, unavailable
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.runtime import connect
from tasks.store import JobStore

LINK_DOWN_S = 6.0
STOP_S = 6.0
"""How long the master (or a worker, a scheduler) stays SIGSTOPped: well past the sentinels'
down-after and the chunk lease."""
HUNG_BURST = 8
"""Interactive jobs submitted while a worker hangs: each must finish on another host."""

FAULTS = ("host_kill_mid_step", "link_down_up", "worker_sigstop", "scheduler_sigstop",
          "redis_master_sigstop", "redis_master_sigkill", "sentinel_failover",
          "object_store_restart")
TERMINAL = frozenset(s.value for s in JobState if s.is_terminal) | {"MISSING"}
SHORT_FAULTS = ("host_kill_mid_step", "link_down_up", "worker_sigstop", "sentinel_failover")

# The load: simulated jobs of a few shapes (steps, step_ms, block groups), cheap and with a
# deterministic artifact; each shape's reference is run once before any fault.
SHAPES: dict[str, dict[str, Any]] = {
    "s6x120": {"slo": "batch", "deadline_s": 600,
               "params": {"steps": 6, "step_ms": 120.0, "block_groups": 1}},
    "s8x90g2": {"slo": "batch", "deadline_s": 600,
                "params": {"steps": 8, "step_ms": 90.0, "block_groups": 2}},
    "s4x60i": {"slo": "interactive", "params": {"steps": 4, "step_ms": 60.0, "block_groups": 1}},
}


# the load, from the client namespace ---------------------------------------------------------
@dataclass
class Submitted:
    """A job the API accepted: its shape (which reference it must match) and when."""

    job_id: str
    shape: str
    accepted_at: float


class Load(threading.Thread):
    """Submits one job of the next shape every ``period_s`` through the API on host 0. A
    submission is retried with its idempotency key (bounded: ``give_up_s``) while the API is
    unreachable or answers 503/429; a job counts as accepted once the API answered 200/201."""

    def __init__(self, api_url: str, key: str, period_s: float = 0.4,
                 give_up_s: float = 60.0) -> None:
        super().__init__(daemon=True, name="hosts-load")
        self.client = httpx.Client(base_url=api_url, headers={"X-API-Key": key}, timeout=10)
        self.period_s, self.give_up_s = period_s, give_up_s
        self.tag = secrets.token_hex(6)
        self.accepted: list[Submitted] = []
        self.refused = 0
        self.retried = 0
        self.halt = threading.Event()
        self._lock = threading.Lock()
        self._count = 0

    def submit(self, shape: str) -> str | None:
        """Submit one job of ``shape``; its id once accepted, None if never (within bounds)."""
        self._count += 1
        body = {"kind": "simulated", **SHAPES[shape],
                "idempotency_key": f"drill-{self.tag}-{self._count}"}
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            try:
                response = self.client.post("/v1/jobs", json=body)
                if response.status_code in (200, 201):
                    job_id = str(response.json()["id"])
                    with self._lock:
                        self.accepted.append(Submitted(job_id, shape, round(time.time(), 3)))
                    return job_id
                if response.status_code not in (429, 503):
                    raise RuntimeError(f"the API refused a valid job: {response.status_code} "
                                       f"{response.text[:200]}")
            except httpx.HTTPError:
                pass
            self.retried += 1
            time.sleep(0.5)
        self.refused += 1
        return None

    def run(self) -> None:
        shapes = list(SHAPES)
        index = 0
        while not self.halt.wait(self.period_s):
            self.submit(shapes[index % len(shapes)])
            index += 1

    def jobs(self) -> list[Submitted]:
        with self._lock:
            return list(self.accepted)


# the drill -----------------------------------------------------------------------------------
class HostsDrill:
    """The topology, the services, the hosts and the load; the faults injected into them."""

    def __init__(self, net: Netns, run_dir: Path) -> None:
        self.net, self.run_dir = net, run_dir
        self.redis = RedisHA(net, run_dir / "redis")
        self.objects = ObjectStore(net, run_dir / "s3")
        self.key = "ops-" + secrets.token_hex(12)
        self.config = run_dir / "stepline.yaml"
        self.hosts = Hosts(net, run_dir / "hosts", self.redis.url, self.config)
        self.faults: list[Fault] = []
        self.references: dict[str, bytes] = {}
        self.store: JobStore | None = None
        self.artifacts: ArtifactStore | None = None
        self.load: Load | None = None

    # setting up -------------------------------------------------------------------------------
    def write_config(self) -> None:
        self.config.write_text(yaml.safe_dump({
            "warm_start": False,
            "broker": {"visibility_timeout": "4s", "unacked_restore_interval": "1s",
                       "chunk_lease": "1.5s", "stuck_min_s": "2s",
                       # every replica: a write WAIT saw on one replica only can still be
                       # lost when the sentinels promote the other one
                       "sentinel_master": MASTER_NAME, "commit_replicas": len(REDIS_PORTS) - 1},
            "service": {"api_host": host_ip(0), "api_port": API_PORT},
            "api": {"keys": [{"key": self.key, "tenant": "ops", "tier": "gold",
                              "rate_limit_per_s": 1000, "burst": 1000, "max_queued": 100000}]},
            "artifacts": self.objects.settings("jobs"),
        }))
        self.config.chmod(0o600)  # it holds the API key and the bucket's secret

    def start(self) -> None:
        names = [*map(self.net.host, range(self.net.hosts)), self.net.client, self.net.bridge]
        for name in names:  # the drill's promise: nothing leaves the machine
            routes = self.net.routes(name)
            if "default" in routes:
                raise RuntimeError(f"namespace {name} has a default route: {routes}")
        self.redis.start()
        self.objects.start()
        self.write_config()
        self.store = JobStore(connect(self.redis.url, sentinel_master=MASTER_NAME))
        self.artifacts = ArtifactStore(f"s3://{BUCKET}/jobs", self.objects.client_options())
        for index in range(self.net.hosts):
            self.hosts.start(index)
        every = [worker_node(i) for i in range(self.net.hosts)] + [
            scheduler_node(i) for i in sorted({0, self.net.hosts - 1})]
        if not wait_until(lambda: set(every) <= set(self.db.heartbeats()), 240, 0.5):
            raise RuntimeError(f"the hosts' workers did not start; see {self.hosts.root}")
        api_url = f"http://{host_ip(0)}:{API_PORT}"
        if not wait_until(lambda: httpx.get(api_url + "/healthz", timeout=2).status_code == 200,
                          120, 0.5):
            raise RuntimeError(f"the API on host 0 did not answer; see {self.hosts.root}")
        self.load = Load(api_url, self.key)

    @property
    def db(self) -> JobStore:
        assert self.store is not None
        return self.store

    def run_references(self, timeout_s: float = 120.0) -> None:
        """One uninterrupted job of each shape, before any fault: the bytes every later job of
        that shape must reproduce."""
        assert self.load is not None and self.artifacts is not None
        ids = {shape: self.load.submit(shape) for shape in SHAPES}
        self.load.accepted.clear()  # references are not part of the audited load
        if not wait_until(lambda: all(j and self.db.state(j) is JobState.DONE
                                      for j in ids.values()), timeout_s, 0.2):
            raise RuntimeError("the reference jobs did not finish")
        for shape, job_id in ids.items():
            assert job_id is not None
            self.references[shape] = self.artifacts.read(self.db.fields(job_id)["artifact"])

    # picking a victim -------------------------------------------------------------------------
    def running_on(self, index: int) -> dict[str, str] | None:
        """A job running a chunk on host ``index``'s worker now, with chunks still to come."""
        prefix = f"h{index}-"
        for fields in self.db.many_fields(self.db.active_ids()):
            if (fields["state"] == JobState.RUNNING.value
                    and fields.get("running_on", "").startswith(prefix)
                    and fields.get("chunk_started_at")
                    and int(fields["next_chunk"]) + 1 < int(fields["num_chunks"])):
                return fields
        return None

    def moved_on(self, victim: dict[str, str]) -> bool:
        """The victim's chunk was requeued (a new epoch) or committed by someone."""
        now = self.db.fields(victim["id"])
        return (int(now["epoch"]) > int(victim["epoch"])
                or int(now["next_chunk"]) > int(victim["next_chunk"])
                or now["state"] == JobState.DONE.value)

    def rejoined(self, index: int, since: float) -> bool:
        beat = self.db.heartbeats().get(worker_node(index))
        return beat is not None and (beat.ts or 0) > since

    @contextmanager
    def fault(self, kind: str) -> Iterator[Fault]:
        """Drive one fault (recorded by :func:`~app.drills.harness.recorded`); its recovery
        is what the fault method itself timed."""
        _say(f"fault {kind} …")
        with recorded(kind, self.faults) as fault:
            yield fault
        _say(f"  -> {'survived' if fault.survived else 'NOT survived'} "
             f"(recovery {fault.recovery_s}s): {fault.detail}")

    # the faults -------------------------------------------------------------------------------
    def host_kill_mid_step(self) -> None:
        index = 1 if self.net.hosts > 1 else 0
        with self.fault("host_kill_mid_step") as fault:
            victim = wait_until(lambda: self.running_on(index), 60, 0.02)
            if victim is None:
                fault.detail = f"no job ran on host {index} within 60 s"
                return
            into_s = time.time() - float(victim["chunk_started_at"])
            self.hosts.kill(index)
            killed = time.monotonic()
            fault.injected, fault.victims = True, [victim["id"]]
            moved = wait_until(lambda: self.moved_on(victim), 60, 0.05)
            fault.recovery_s = round(time.monotonic() - killed, 2)
            restarted = time.time()
            self.hosts.start(index)
            back = wait_until(lambda: self.rejoined(index, restarted), 180, 0.5)
            fault.survived = bool(moved and back)
            fault.detail = (f"SIGKILLed every process of host {index} {into_s:.2f}s into chunk "
                            f"{victim['next_chunk']} of job {victim['id']}; the chunk moved on "
                            f"after {fault.recovery_s}s; host restarted, its worker "
                            f"{'rejoined' if back else 'did NOT rejoin'} after "
                            f"{time.time() - restarted:.1f}s")

    def link_down_up(self) -> None:
        index = 1 if self.net.hosts > 1 else 0
        with self.fault("link_down_up") as fault:
            victim = wait_until(lambda: self.running_on(index), 60, 0.02)
            if victim is None:
                fault.detail = f"no job ran on host {index} within 60 s"
                return
            self.net.link(index, up=False)
            down = time.monotonic()
            fault.injected, fault.victims = True, [victim["id"]]
            moved = wait_until(lambda: self.moved_on(victim), LINK_DOWN_S + 30, 0.05)
            moved_s = time.monotonic() - down
            time.sleep(max(0.0, LINK_DOWN_S - (time.monotonic() - down)))
            self.net.link(index, up=True)
            up = time.time()
            back = wait_until(lambda: self.rejoined(index, up), 120, 0.2)
            fault.recovery_s = round(moved_s, 2)
            fault.survived = bool(moved and back)
            fault.detail = (f"host {index}'s link down {LINK_DOWN_S:.0f}s while it ran chunk "
                            f"{victim['next_chunk']} of job {victim['id']}; the chunk moved on "
                            f"after {moved_s:.2f}s; link up, the worker "
                            f"{'rejoined' if back else 'did NOT rejoin'} after "
                            f"{time.time() - up:.1f}s")

    def worker_sigstop(self) -> None:
        """Host 1's chunk worker hangs (SIGSTOP: alive, its connections open, no heartbeat)
        mid-step while jobs keep coming: the chunk it held and every job submitted meanwhile
        finish on the other hosts; thawed, its late commit is fenced off and it serves again."""
        index = 1 if self.net.hosts > 1 else 0
        with self.fault("worker_sigstop") as fault:
            assert self.load is not None
            victim = wait_until(lambda: self.running_on(index), 60, 0.02)
            if victim is None:
                fault.detail = f"no job ran on host {index} within 60 s"
                return
            worker = self.hosts.child(index, "worker")
            worker.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            fault.injected = True
            try:
                burst = [j for j in (self.load.submit("s4x60i") for _ in range(HUNG_BURST)) if j]
                fault.victims = [victim["id"], *burst]
                moved = wait_until(lambda: self.moved_on(victim), 60, 0.05)
                moved_s = time.monotonic() - stopped
                finished = wait_until(lambda: all(self.state(j) == JobState.DONE.value
                                             for j in burst), 60, 0.1)
                finished_s = time.monotonic() - stopped
                time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))
            finally:
                worker.signal(signal.SIGCONT)
            thawed = time.time()
            back = wait_until(lambda: self.rejoined(index, thawed), 60, 0.2)
            fault.recovery_s = round(moved_s, 2)
            fault.survived = bool(moved and finished and back and worker.alive())
            fault.detail = (f"SIGSTOPped host {index}'s worker in chunk {victim['next_chunk']} of "
                            f"job {victim['id']}; the chunk moved on after {moved_s:.2f}s; "
                            f"{len(burst)} interactive jobs submitted while it hung "
                            f"{'all' if finished else 'NOT all'} done after {finished_s:.2f}s; "
                            f"thawed after {time.monotonic() - stopped:.1f}s, the worker "
                            f"{'rejoined' if back else 'did NOT rejoin'}")

    def scheduler_sigstop(self) -> None:
        """The scheduler holding the tick lease hangs (SIGSTOP): the lease lapses and the
        standby scheduler (on another host when there is one) takes the tick over; the hung
        one, thawed, finds the lease taken and ticks nothing."""
        with self.fault("scheduler_sigstop") as fault:
            holder = wait_until(lambda: self.db.redis.get(keys.TICK_LEASE), 30, 0.1)
            child = self.hosts.scheduler_holding(holder)
            if child is None:
                fault.detail = f"no known scheduler holds the tick lease ({holder!r})"
                return
            child.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            fault.injected = True
            try:
                other = wait_until(lambda: self.tick_holder_other_than(child.name), 30, 0.05)
                took_s = time.monotonic() - stopped
                probe = self.load.submit("s4x60i") if self.load is not None else None
                served = probe is not None and wait_until(
                    lambda: self.state(probe) == JobState.DONE.value, 30, 0.1)
                time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))
            finally:
                child.signal(signal.SIGCONT)
            if probe is not None:
                fault.victims = [probe]
            fault.recovery_s = round(took_s, 2)
            fault.survived = bool(other and served and child.alive())
            fault.detail = (f"SIGSTOPped the tick lease holder {child.name}; "
                            + (f"{other} took the lease after {took_s:.2f}s" if other
                               else "no scheduler took the lease in 30 s")
                            + f"; a job submitted meanwhile {'ran' if served else 'did NOT run'}"
                            f"; thawed after {time.monotonic() - stopped:.1f}s")

    def tick_holder_other_than(self, name: str) -> str | None:
        raw = cast(bytes | None, self.db.redis.get(keys.TICK_LEASE))
        holder = raw.decode() if raw is not None else ""
        return holder if holder and not holder.startswith(name) else None

    def _writable(self) -> bool:
        """A fresh Sentinel client reaches a master that takes a write."""
        client = connect(self.redis.url, sentinel_master=MASTER_NAME)
        try:
            return bool(client.set(f"drill:probe:{secrets.token_hex(4)}", "1", ex=60))
        finally:
            client.close()

    def redis_master_sigstop(self) -> None:
        with self.fault("redis_master_sigstop") as fault:
            old = self.redis.master_port()
            server = self.redis.servers[old]
            server.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            fault.injected = True
            new = self.redis.new_master(old, 60)
            writable = new is not None and wait_until(self._writable, 30, 0.1)
            fault.recovery_s = round(time.monotonic() - stopped, 2)
            time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))
            server.signal(signal.SIGCONT)
            stopped_s = time.monotonic() - stopped
            demoted = wait_until(lambda: self.redis.role(old) == "slave", 60, 0.2)
            synced = self.redis.settle()
            fault.survived = synced is not None and bool(new and writable and demoted)
            fault.detail = (f"SIGSTOPped master :{old} for {stopped_s:.1f}s "
                            f"(down-after {DOWN_AFTER_MS} ms); :{new} promoted and taking writes "
                            f"after {fault.recovery_s}s; the old master "
                            f"{'rejoined as a replica' if demoted else 'did NOT rejoin'}"
                            f"; {_in_sync(synced)}")

    def redis_master_sigkill(self) -> None:
        with self.fault("redis_master_sigkill") as fault:
            old = self.redis.master_port()
            server = self.redis.servers[old]
            server.kill()
            killed = time.monotonic()
            fault.injected = True
            new = self.redis.new_master(old, 60)
            writable = new is not None and wait_until(self._writable, 30, 0.1)
            fault.recovery_s = round(time.monotonic() - killed, 2)
            if new is not None:  # back as the new master's replica (it kept no data)
                server.start("--replicaof", BRIDGE_IP, str(new))
            rejoined = wait_until(lambda: self.redis.role(old) == "slave"
                                  and self.redis.server(old).info("replication")[
                                 "master_link_status"] == "up", 60, 0.2)
            synced = self.redis.settle()
            fault.survived = synced is not None and bool(new and writable and rejoined)
            fault.detail = (f"SIGKILLed master :{old}; :{new} promoted and taking writes after "
                            f"{fault.recovery_s}s; restarted, the old master "
                            f"{'synced as a replica' if rejoined else 'did NOT rejoin'}"
                            f"; {_in_sync(synced)}")

    def sentinel_failover(self) -> None:
        with self.fault("sentinel_failover") as fault:
            old = self.redis.master_port()
            self.redis.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
            began = time.monotonic()
            fault.injected = True
            new = self.redis.new_master(old, 60)
            writable = new is not None and wait_until(self._writable, 30, 0.1)
            fault.recovery_s = round(time.monotonic() - began, 2)
            demoted = new is not None and wait_until(
                lambda: self.redis.role(old) == "slave", 60, 0.1)
            synced = self.redis.settle()
            fault.survived = synced is not None and bool(new and demoted and writable)
            fault.detail = (f"SENTINEL FAILOVER: :{old} -> :{new}, the new master taking writes "
                            f"after {fault.recovery_s}s; the old one "
                            f"{'a replica' if demoted else 'NOT a replica'} after "
                            f"{time.monotonic() - began:.1f}s"
                            f"; {_in_sync(synced)}")

    def object_store_restart(self) -> None:
        with self.fault("object_store_restart") as fault:
            assert self.objects.child is not None
            self.objects.child.stop()
            stopped = time.monotonic()
            fault.injected = True
            self.objects.start()
            fault.recovery_s = round(time.monotonic() - stopped, 2)
            fault.survived = True  # and, at the audit, every job's artifact readable and exact
            fault.detail = (f"weed server stopped (SIGTERM) and started again on the same data; "
                            f"S3 answering after {fault.recovery_s}s")

    # the end ----------------------------------------------------------------------------------
    def settle(self, timeout_s: float) -> dict[str, Any]:
        """Wait for every accepted job to end; audit each one against its reference."""
        assert self.load is not None and self.artifacts is not None
        jobs = self.load.jobs()
        _say(f"waiting for {len(jobs)} accepted jobs to end …")
        wait_until(lambda: all(self.state(j.job_id) in TERMINAL for j in jobs), timeout_s, 0.5)
        lost, inexact = [], []
        for job in jobs:
            state = self.state(job.job_id)
            if state != JobState.DONE.value:
                lost.append({"id": job.job_id, "state": state, "accepted_at": job.accepted_at})
                continue
            audit = audit_job(self.db, self.artifacts, job.job_id)
            data = self.artifacts.read(self.db.fields(job.job_id)["artifact"])
            if not audit.exact or data != self.references[job.shape]:
                inexact.append({"id": job.job_id, "problem": audit.problem()
                                or "artifact differs from the uninterrupted run's"})
        bad = {row["id"] for row in lost + inexact}
        for fault in self.faults:
            if fault.survived and bad & set(fault.victims):
                fault.survived = False
                fault.detail += "; a victim job did not end exact"
        states = Counter(self.state(j.job_id) for j in jobs)
        return {"jobs_submitted": len(jobs), "jobs_completed": states.get("DONE", 0),
                "jobs_lost": len(lost), "lost": lost[:50], "jobs_inexact": len(inexact),
                "inexact": inexact[:50], "exact": not lost and not inexact,
                "submits_refused": self.load.refused, "submit_retries": self.load.retried,
                "processes_dead_at_end": self.hosts.dead()}

    def state(self, job_id: str) -> str:
        """The job's state, or MISSING: an accepted job whose record is gone (a write the
        store acknowledged and then lost) is lost like any other."""
        raw = self.db.redis.hget(keys.job(job_id), "state")
        return "MISSING" if raw is None else cast(bytes, raw).decode()

    def stop(self) -> None:
        """Stop the load, the hosts and the services; each is stopped whatever the others do."""
        try:
            if self.load is not None and self.load.is_alive():
                self.load.halt.set()
                self.load.join(timeout=90)
        finally:
            try:
                self.hosts.stop()
            finally:
                try:
                    self.objects.stop(*([self.artifacts.fs] if self.artifacts else []))
                finally:
                    self.redis.stop()


def _in_sync(synced: float | None) -> str:
    return ("all replicas in sync NOT within 90 s" if synced is None
            else f"all replicas in sync {synced:.1f}s later")


def _say(line: str) -> None:
    print(line, flush=True)


class HostsUnavailable(RuntimeError):
    """Raised when this machine cannot make network namespaces (not root, no iproute2)."""


# the run -------------------------------------------------------------------------------------
def run_hosts_drill(out_dir: Path, hosts: int, faults: tuple[str, ...] = FAULTS,
                    settle_s: float = 180.0) -> int:
    """The drill across ``hosts`` namespaces; writes ``out_dir/reliability.json``; the exit
    code (0: every job exact, every fault survived). Everything it started is stopped and every
    namespace deleted however it ends."""
    if not 1 <= hosts <= 16:
        raise ValueError(f"hosts must be 1..16, not {hosts}")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if (why := unavailable()) is not None:
        raise HostsUnavailable(f"the drill across hosts cannot run here: {why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="hosts-", dir=out_dir)).resolve()
    net = Netns(hosts)
    began = time.monotonic()
    previous = _terminate_as_exit()
    try:
        net.create()
        with inside(net.client):
            report = _drill(net, run_dir, faults, settle_s)
    finally:
        net.destroy()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    report.update(hosts=hosts, namespaces_prefix=net.prefix, run_dir=str(run_dir),
                  duration_s=round(time.monotonic() - began, 1))
    (out_dir / "reliability.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    failed = (report["jobs_lost"] or not report["exact"]
              or any(f["survived"] is not True for f in report["faults"]))
    return 1 if failed else 0


def _terminate_as_exit() -> Any:
    """SIGTERM raises SystemExit (so the cleanup runs); the previous handler, or None off the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def _drill(net: Netns, run_dir: Path, faults: tuple[str, ...], settle_s: float) -> dict[str, Any]:
    drill = HostsDrill(net, run_dir)
    try:
        drill.start()
        _say(f"{net.hosts} hosts up (namespaces {net.prefix}-*), Redis master + 2 replicas + 3 "
             f"sentinels and S3 on the bridge; run dir {run_dir}")
        drill.run_references()
        assert drill.load is not None
        drill.load.start()
        time.sleep(3)
        for kind in faults:
            getattr(drill, kind)()
            time.sleep(3)  # steady load between faults
        drill.load.halt.set()
        drill.load.join(timeout=90)
        report = drill.settle(settle_s)
        report["faults"] = [asdict(f) for f in drill.faults]
        return report
    finally:
        drill.stop()


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table("fault", "injected", "survived", "recovery s", "detail",
                  title=f"Faults across {report.get('hosts')} hosts")
    for f in report["faults"]:
        mark = {True: "[green]yes", False: "[red]NO", None: "[yellow]?"}[f["survived"]]
        table.add_row(f["kind"], "yes" if f["injected"] else "no", mark,
                      str(f["recovery_s"]), f["detail"])
    console.print(table)
    colour = "green" if report["exact"] else "red"
    console.print(f"[bold {colour}]jobs submitted {report['jobs_submitted']}, completed "
                  f"{report['jobs_completed']}, lost {report['jobs_lost']}, inexact "
                  f"{report['jobs_inexact']} (exact: {report['exact']})[/] in "
                  f"{report.get('duration_s')}s")
    for row in report["lost"] + report["inexact"]:
        console.print(f"  [red]{row}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--out", type=Path, default=Path("reliability-out"))
    args = parser.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    return run_hosts_drill(args.out.resolve(), args.hosts, faults)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
