"""Simulated hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

One *bridge* namespace holds a Linux bridge (and whatever shared services run there: Redis,
the object store); every *host* namespace and the drill's *client* namespace has one veth end
with an address in the same /24 and its loopback, and no default route, so nothing started in
them can reach beyond the machine. Names carry a per-run prefix, so runs never collide, and
:meth:`Netns.destroy` removes everything this run made (the veth pairs go with their
namespaces).

Requires root (``CAP_SYS_ADMIN``) and iproute2's ``ip``; :func:`unavailable` says why not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"
BRIDGE_IP = f"{SUBNET}.1"
CLIENT_IP = f"{SUBNET}.200"
IP_TIMEOUT_S = 60.0
"""Every ``ip`` call is bounded (a loaded machine can take seconds to create a namespace)."""


def host_ip(index: int) -> str:
    """Host ``index``'s address on the bridge (``.10``, ``.11``, ...)."""
    return f"{SUBNET}.{10 + index}"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): not root, or no ``ip``."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"slprobe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S,
                   check=False)
    return None


def ip(*args: str) -> None:
    """Run ``ip args``; raises with its stderr when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Netns:
    """The namespaces of one run: ``<prefix>-br`` (the bridge), ``<prefix>-h<i>`` (hosts) and
    ``<prefix>-cl`` (the client)."""

    hosts: int
    prefix: str = field(default_factory=lambda: f"sl{secrets.token_hex(3)}")
    made: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def client(self) -> str:
        return f"{self.prefix}-cl"

    def host(self, index: int) -> str:
        return f"{self.prefix}-h{index}"

    def peer(self, index: int | None) -> str:
        """The bridge-side veth end of host ``index`` (None: the client's)."""
        return "vcl" if index is None else f"vh{index}"

    def create(self) -> None:
        """Make the bridge, then each host and the client joined to it; on any failure what was
        made is removed before the error propagates."""
        try:
            self._add(self.bridge)
            ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge, "addr", "add", f"{BRIDGE_IP}/24", "dev", "br0")
            ip("-n", self.bridge, "link", "set", "br0", "up")
            for index in range(self.hosts):
                self._join(self.host(index), host_ip(index), self.peer(index))
            self._join(self.client, CLIENT_IP, self.peer(None))
        except BaseException:
            self.destroy()
            raise

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _join(self, name: str, address: str, peer: str) -> None:
        self._add(name)
        ip("link", "add", "name", "eth0", "netns", name, "type", "veth", "peer", "name", peer,
           "netns", self.bridge)
        ip("-n", self.bridge, "link", "set", peer, "master", "br0")
        ip("-n", self.bridge, "link", "set", peer, "up")
        ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")

    def link(self, index: int, up: bool) -> None:
        """Take host ``index``'s link to the bridge down (or bring it back)."""
        ip("-n", self.bridge, "link", "set", self.peer(index), "up" if up else "down")

    def routes(self, name: str) -> str:
        """``ip route`` inside ``name`` (the drill checks there is no default route)."""
        done = subprocess.run(["ip", "-n", name, "route", "show"], capture_output=True,
                              text=True, timeout=IP_TIMEOUT_S, check=True)
        return done.stdout

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``name`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", name, *argv]

    def destroy(self) -> None:
        """Delete every namespace this run made (newest first), SIGKILLing first any process
        still inside one (a deleted namespace lives on while a process holds it, and so would
        its servers); tolerant of ones already gone."""
        for name in reversed(self.made):
            left = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                  timeout=IP_TIMEOUT_S, check=False)
            for pid in left.stdout.split():
                if pid != str(os.getpid()):
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True,
                           timeout=IP_TIMEOUT_S, check=False)
        self.made.clear()


@contextmanager
def inside(name: str) -> Iterator[None]:
    """Run this thread (and the threads it starts meanwhile) in namespace ``name``: its sockets
    are made there. Back in the original namespace on exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{name}") as target:
        if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")


class LoopIn:
    """An asyncio loop on a thread of its own, inside namespace ``name``, for fsspec's async
    file systems (s3fs). fsspec otherwise runs every sync call on one process-wide IO thread,
    made wherever its first user happened to be: if that was the root namespace (an earlier
    test), the drill's S3 calls would leave from there, to an address only the namespaces
    have. Pass ``loop=`` to the file system; :meth:`close` when done."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(name,), daemon=True,
                                        name=f"loop-in-{name}")
        self._thread.start()
        if not self._ready.wait(IP_TIMEOUT_S):
            raise RuntimeError(f"the IO loop did not start inside {name}")

    def _run(self, name: str) -> None:
        with inside(name):
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(self._ready.set)
            self.loop.run_forever()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
