"""The simulated hosts of ``stepline reliability --hosts N``, built and torn down: the shared
services in the bridge namespace (:class:`RedisHA`: a master, two replicas and three sentinels,
password protected; :class:`ObjectStore`: SeaweedFS's S3 gateway), and on each host namespace
the processes an operator would start on a machine of its own (:class:`Hosts`: a chunk worker
everywhere, the API, the scheduler and beat on host 0, a standby scheduler on the last host),
each a :class:`Child` restartable with the same command. The namespaces themselves come from
:mod:`app.drills.netns`; the faults injected into all this live in :mod:`app.drills.hosts`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis

from app.api.server import api_command
from app.drills.harness import wait_until
from app.drills.netns import BRIDGE_IP, LoopIn, Netns, host_ip
from app.drills.seaweed import weed_server
from app.embedded_redis import redis_server_binary
from app.stack import beat_command, worker_command
from tasks.routing import CONTROL
from tasks.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MASTER_NAME = "stepline"
REDIS_PORTS = (6379, 6380, 6381)
"""The master (first) and two replicas: after one failover a commit still has a replica."""
SENTINEL_PORTS = (26379, 26380, 26381)
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 3000
API_PORT = 8080
S3_PORTS = {"master": 9333, "master_grpc": 19333, "volume": 8081, "volume_grpc": 18081,
            "filer": 8888, "filer_grpc": 18888, "s3": 8333, "s3_grpc": 18333}
BUCKET = "stepline-artifacts"
S3_ACCESS_KEY = "stepline-drill"


def _tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log (for an error message CI shows whole)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error})"


# processes -----------------------------------------------------------------------------------
@dataclass
class Child:
    """One process started inside a namespace, restartable with the same command."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as handle:
            self.proc = subprocess.Popen([*self.argv, *extra], env=self.env, stdout=handle,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=ROOT)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


# the shared services, in the bridge namespace ------------------------------------------------
class RedisHA:
    """A master, two replicas and three sentinels on the bridge's address, one password."""

    def __init__(self, net: Netns, root: Path) -> None:
        self.net, self.root = net, root
        self.password = secrets.token_urlsafe(18)
        self.servers: dict[int, Child] = {}
        self.sentinels: list[Child] = []

    @property
    def url(self) -> str:
        """kombu's Sentinel URL; the password is the master's (the sentinels ask none)."""
        return ";".join(f"sentinel://:{self.password}@{BRIDGE_IP}:{port}"
                        for port in SENTINEL_PORTS)

    def start(self, timeout_s: float = 90.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for port in REDIS_PORTS:
            self._server(port)
        for index, port in enumerate(SENTINEL_PORTS):
            self._sentinel(index, port)
        if not wait_until(self.ready, timeout_s, 0.3):
            raise RuntimeError(f"the sentinel group did not form in {timeout_s}s; see {self.root}")

    def _config(self, name: str, lines: list[str]) -> Path:
        path = self.root / f"{name}.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)  # it holds the password
        return path

    def _server(self, port: int) -> None:
        directory = self.root / f"redis-{port}"
        directory.mkdir(exist_ok=True)
        lines = [f"port {port}", f"bind {BRIDGE_IP}", f"dir {directory}", 'save ""',
                 "appendonly no", f"logfile {directory / 'server.log'}",
                 f"requirepass {self.password}", f"masterauth {self.password}"]
        if port != REDIS_PORTS[0]:
            lines.append(f"replicaof {BRIDGE_IP} {REDIS_PORTS[0]}")
        config = self._config(f"redis-{port}", lines)
        child = Child(f"redis-{port}", self.net.command(self.net.bridge, [
            redis_server_binary(), str(config)]), dict(os.environ), directory / "stdout.log")
        child.start()
        self.servers[port] = child

    def _sentinel(self, index: int, port: int) -> None:
        config = self._config(f"sentinel{index}", [  # a sentinel rewrites its own file
            f"port {port}", f"bind {BRIDGE_IP}", f"dir {self.root}",
            f"logfile {self.root / f'sentinel{index}.log'}",
            f"sentinel monitor {MASTER_NAME} {BRIDGE_IP} {REDIS_PORTS[0]} 2",
            f"sentinel auth-pass {MASTER_NAME} {self.password}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 2"])
        child = Child(f"sentinel{index}", self.net.command(self.net.bridge, [
            redis_server_binary(), str(config), "--sentinel"]), dict(os.environ),
            self.root / f"sentinel{index}.stdout.log")
        child.start()
        self.sentinels.append(child)

    # seen from the client namespace
    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(host=BRIDGE_IP, port=SENTINEL_PORTS[index], socket_timeout=2,
                           socket_connect_timeout=2, decode_responses=True)

    def server(self, port: int) -> redis.Redis:
        return redis.Redis(host=BRIDGE_IP, port=port, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2)

    def ready(self) -> bool:
        for index in range(len(SENTINEL_PORTS)):
            master = cast(dict[str, Any], self.sentinel(index).sentinel_master(MASTER_NAME))
            if master["num-slaves"] < 2 or master["num-other-sentinels"] < 2:
                return False
        return True

    def master_port(self) -> int:
        """The master's port as the sentinels agree on it (the first that answers)."""
        for index in range(len(SENTINEL_PORTS)):
            try:
                address = cast(tuple[str, int] | None,
                               self.sentinel(index).sentinel_get_master_addr_by_name(MASTER_NAME))
                if address is not None:
                    return int(address[1])
            except redis.RedisError:
                continue
        raise redis.ConnectionError("no sentinel answered")

    def role(self, port: int) -> str:
        return str(self.server(port).info("replication")["role"])

    def new_master(self, old: int, timeout_s: float) -> int | None:
        """The promoted master's port once the sentinels name one other than ``old`` and it
        says it is master; None if that took over ``timeout_s``."""
        def promoted() -> int | None:
            port = self.master_port()
            return port if port != old and self.role(port) == "master" else None
        result: int | None = wait_until(promoted, timeout_s, 0.05)
        return result

    def in_sync(self) -> bool:
        """The sentinels' master is a master and every other server its replica, linked and
        not mid-resync: the next fault starts from a whole group (one fault at a time)."""
        master = self.master_port()
        if self.role(master) != "master":
            return False
        for port in REDIS_PORTS:
            if port == master:
                continue
            info = cast(dict[str, Any], self.server(port).info("replication"))
            if (info["role"] != "slave" or int(info["master_port"]) != master
                    or info["master_link_status"] != "up"
                    or int(info["master_sync_in_progress"])):
                return False
        return True

    def settle(self, timeout_s: float = 90.0) -> float | None:
        """Seconds until :meth:`in_sync`, or None if it was not within ``timeout_s``."""
        began = time.monotonic()
        return time.monotonic() - began if wait_until(self.in_sync, timeout_s, 0.2) else None

    def stop(self) -> None:
        for child in [*self.sentinels, *self.servers.values()]:
            child.stop()


class ObjectStore:
    """SeaweedFS (``weed server``: master, volume, filer, S3 gateway) on the bridge's address;
    its data under ``root`` outlives a restart."""

    def __init__(self, net: Netns, root: Path) -> None:
        self.net, self.root = net, root
        self.secret = secrets.token_urlsafe(24)
        self.child: Child | None = None
        self.io: LoopIn | None = None
        self._made: list[Any] = []
        """The s3fs file systems made on ``io`` (their sessions are closed before it is)."""

    @property
    def endpoint_url(self) -> str:
        return f"http://{BRIDGE_IP}:{S3_PORTS['s3']}"

    def start(self, timeout_s: float = 120.0) -> None:
        argv = weed_server(self.root, BRIDGE_IP, S3_PORTS, S3_ACCESS_KEY, self.secret)
        if self.child is None:
            self.child = Child("weed", self.net.command(self.net.bridge, argv), dict(os.environ),
                               self.root / "weed.log")
        self.child.start()
        if not wait_until(self.answers, timeout_s, 0.5):
            raise RuntimeError(f"the object store did not answer in {timeout_s}s; the end of "
                               f"{self.root / 'weed.log'}:\n{_tail(self.root / 'weed.log')}")

    def client_options(self) -> dict[str, Any]:
        """s3fs options for the drill's own calls: its keys, and an IO loop in the client
        namespace (never fsspec's shared one, which may live in the root namespace)."""
        if self.io is None:
            self.io = LoopIn(self.net.client)
        return {"endpoint_url": self.endpoint_url, "key": S3_ACCESS_KEY, "secret": self.secret,
                "skip_instance_cache": True, "loop": self.io.loop}

    def filesystem(self) -> Any:
        import s3fs

        fs = s3fs.S3FileSystem(**self.client_options())
        self._made.append(fs)
        return fs

    def answers(self) -> bool:
        """Whether the S3 gateway serves the bucket (made on first answer); not listening yet
        (a refused connection, however botocore words it) counts as no."""
        from botocore.exceptions import BotoCoreError

        assert self.child is not None
        if not self.child.alive():
            raise RuntimeError(f"weed exited; see {self.root / 'weed.log'}")
        fs = self.filesystem()
        try:
            if not fs.exists(BUCKET):
                fs.mkdir(BUCKET)
            fs.ls(BUCKET, refresh=True)
        except BotoCoreError:
            return False
        return True

    def settings(self, prefix: str) -> dict[str, Any]:
        return {"url": f"s3://{BUCKET}/{prefix}", "endpoint_url": self.endpoint_url,
                "access_key_id": S3_ACCESS_KEY, "secret_access_key": self.secret}

    def stop(self, *also: Any) -> None:
        """Stop weed, then close the HTTP sessions of the file systems made on the IO loop
        (and of ``also``, others made on it) and the loop itself."""
        try:
            if self.child is not None:
                self.child.stop()
        finally:
            if self.io is not None:
                for fs in [*self._made, *also]:
                    if (session := getattr(fs, "_s3", None)) is not None:
                        with contextlib.suppress(Exception):  # best effort: the loop goes next
                            type(fs).close_session(self.io.loop, session)
                self._made.clear()
                self.io.close()
                self.io = None


# the hosts -----------------------------------------------------------------------------------
def worker_node(index: int) -> str:
    """Host ``index``'s chunk worker, as heartbeats and job records name it."""
    return f"h{index}-worker@h{index}"


def scheduler_node(index: int) -> str:
    """Host ``index``'s scheduler (a control-queue worker), as the tick lease names it."""
    return f"h{index}-scheduler@h{index}"


class Hosts:
    """What runs on each simulated host: a chunk worker everywhere; the API, the scheduler
    (a control-queue worker) and beat on host 0, a standby scheduler on the last host (when
    there are two or more). Each host has its own run directory."""

    def __init__(self, net: Netns, root: Path, redis_url: str, config: Path) -> None:
        self.net, self.root = net, root
        self.redis_url, self.config = redis_url, config
        self.children: dict[int, list[Child]] = {}

    def env(self, index: int) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("STEPLINE_") and k != "REDIS_URL"}
        path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
        return {**base, "PYTHONPATH": path, "REDIS_URL": self.redis_url,
                "STEPLINE_CONFIG": str(self.config),
                "STEPLINE_RUN_DIR": str(self.run_dir(index))}

    def run_dir(self, index: int) -> Path:
        return self.root / f"h{index}"

    def roles(self, index: int) -> list[tuple[str, list[str]]]:
        """(name, command) of each process host ``index`` runs."""
        run_dir = self.run_dir(index)
        roles = [("worker", worker_command(worker_node(index)))]
        if index == 0:
            roles += [("scheduler", worker_command(scheduler_node(index), queues=(CONTROL,),
                                                   loglevel="WARNING")),
                      ("beat", beat_command(run_dir)),
                      ("api", _api_command())]
        elif index == self.net.hosts - 1:  # a standby scheduler: the tick is leased
            roles += [("scheduler", worker_command(scheduler_node(index), queues=(CONTROL,),
                                                   loglevel="WARNING"))]
        return roles

    def child(self, index: int, role: str) -> Child:
        """Host ``index``'s process of ``role`` (``worker``, ``scheduler`` ...)."""
        return next(c for c in self.children[index] if c.name == f"h{index}-{role}")

    def scheduler_holding(self, holder: bytes | str | None) -> Child | None:
        """The scheduler process whose node name ``holder`` (the tick lease's value) is."""
        name = holder.decode() if isinstance(holder, bytes) else holder
        for index in self.children:
            if name == scheduler_node(index):
                return self.child(index, "scheduler")
        return None

    def start(self, index: int) -> None:
        run_dir = self.run_dir(index)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        children = []
        for name, argv in self.roles(index):
            child = Child(f"h{index}-{name}", self.net.command(self.net.host(index), argv),
                          self.env(index), run_dir / "logs" / f"{name}.log")
            child.start()
            children.append(child)
        self.children[index] = children

    def kill(self, index: int) -> None:
        """SIGKILL every process of host ``index`` (a machine that lost power)."""
        for child in self.children.get(index, []):
            child.signal(signal.SIGKILL)
        for child in self.children.get(index, []):
            child.kill()

    def dead(self) -> list[str]:
        return [c.name for children in self.children.values() for c in children if not c.alive()]

    def stop(self) -> None:
        for children in self.children.values():
            for child in children:
                child.signal(signal.SIGTERM)
        for children in self.children.values():
            for child in children:
                child.stop()


def _api_command() -> list[str]:
    """The API on host 0's address, as ``stepline up`` starts it there."""
    settings = Settings.model_validate({"service": {"api_host": host_ip(0),
                                                    "api_port": API_PORT}})
    return api_command(settings)
