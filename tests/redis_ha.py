"""Redis high availability for the tests: one master, one replica and three sentinels (the
embedded server's binary run with ``--sentinel``), all on loopback ports, owned by the caller."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from app.embedded_redis import redis_server_binary
from tests.object_store import free_ports

MASTER_NAME = "stepline"


class SentinelGroup:
    """A master, a replica and three sentinels watching them (down after 1 s), under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.master_port, self.replica_port, *self.sentinel_ports = free_ports(5)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """kombu's Sentinel URL: every sentinel, ``;``-separated."""
        return ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports)

    def start(self, timeout_s: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._server("master", self.master_port)
        self._server("replica", self.replica_port,
                     "--replicaof", "127.0.0.1", str(self.master_port))
        for i, port in enumerate(self.sentinel_ports):
            self._sentinel(f"sentinel{i}", port)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the sentinel group did not form; see {self.root}")
            time.sleep(0.2)

    def _server(self, name: str, port: int, *extra: str) -> None:
        directory = self.root / name
        directory.mkdir(exist_ok=True)
        self._spawn(name, [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                           "--dir", str(directory), "--save", "", "--appendonly", "no",
                           "--logfile", str(directory / "server.log"), *extra])

    def _sentinel(self, name: str, port: int) -> None:
        config = self.root / f"{name}.conf"  # a sentinel rewrites its own config file
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.root}\nlogfile {self.root / name}.log\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n")
        self._spawn(name, [redis_server_binary(), str(config), "--sentinel"])

    def _spawn(self, name: str, command: list[str]) -> None:
        self.procs[name] = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, start_new_session=True)

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], socket_timeout=2,
                           decode_responses=True)

    def master_port_now(self) -> int:
        """The master's port as the first sentinel sees it."""
        _, port = self.sentinel().sentinel_get_master_addr_by_name(MASTER_NAME)
        return int(port)

    def _ready(self) -> bool:
        try:
            for index in range(len(self.sentinel_ports)):
                sentinel = self.sentinel(index)
                master = sentinel.sentinel_master(MASTER_NAME)
                if master["num-slaves"] < 1 or master["num-other-sentinels"] < 2:
                    return False
            replica = redis.Redis(port=self.replica_port, socket_timeout=2)
            return replica.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def failover(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER``; returns the new master's port once the failover is over: the
        sentinels name it, it accepts writes, and the old master replicates from it (until
        then the old master may still accept a write, which its demotion discards)."""
        before = self.master_port_now()
        self.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.master_port_now()
                if port != before and self._role(port) == "master" and self._role(before) in (
                        "slave", "replica"):
                    return port
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no failover within {timeout_s}s")

    @staticmethod
    def _role(port: int) -> str:
        return str(redis.Redis(port=port, socket_timeout=2).info("replication")["role"])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
