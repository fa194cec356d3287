"""``stepline up``: the embedded Redis, N workers, beat, a scheduler worker, the API and Flower.

Every process it starts is its child; SIGINT or SIGTERM stops them all, newest first.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.api.server import api_command
from app.embedded_redis import EmbeddedRedis
from app.tenants import ensure_dev_key, read_or_create_secret
from tasks.routing import CONTROL, WORK_QUEUES
from tasks.settings import Settings

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


@dataclass
class Stack:
    """The processes of one running Stepline, owned by this object."""

    settings: Settings
    run_dir: Path
    workers: int = 2
    with_beat: bool = True
    with_api: bool = True
    with_flower: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    redis: EmbeddedRedis | None = None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.service.api_host}:{self.settings.service.api_port}"

    @property
    def flower_url(self) -> str:
        return f"http://{self.settings.api.flower_host}:{self.settings.service.flower_port}"

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
        for i in range(self.workers):
            self.spawn(f"w{i + 1}", worker_command(f"w{i + 1}@%h"))
        if self.with_beat:
            self.spawn("scheduler", worker_command("scheduler@%h", queues=(CONTROL,),
                                                   loglevel="WARNING"))
            self.spawn("beat", beat_command(self.run_dir))
        if self.with_api:
            if not self.settings.api.keys:
                ensure_dev_key(self.run_dir)  # before the API starts, so clients find it at once
            self.spawn("api", api_command(self.settings))
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

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs if proc.poll() is not None]

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
        if self.redis is not None:
            self.redis.stop()
        (self.run_dir / "stack.pid").unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
        time.sleep(0.2)
        if dead := stack.dead():
            log.error("stopping: %s exited; see %s", ", ".join(dead), stack.run_dir / "logs")
            code = 1
            break
    stack.stop()
    return code
