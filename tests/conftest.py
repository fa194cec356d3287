"""Shared fixtures: a private redis-server per test session, real Celery worker processes.

Nothing here talks to a Redis the machine may already run: each session starts its own on a
unix socket in a temporary directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hypothesis
import pytest
import redis

from app.celery import configure as configure_celery
from app.drills.faults import JobAudit
from app.embedded_redis import EmbeddedRedis
from scheduler import CostModel, plan_tick
from tasks import keys
from tasks.adapter import LiveTarget, policy_config
from tasks.runtime import current_settings
from tasks.settings import Settings
from tasks.snapshot import read_snapshot
from tasks.store import JobStore
from tests.object_store import SeaweedS3

# Test workers build each model on its first job, as before warm start: a warm-up of every recipe
# in every worker a test starts would cost minutes (tests/e2e/test_readiness.py turns it on).
os.environ.setdefault("STEPLINE_WARM_START", "false")

# No property test holds an example to a time: Hypothesis's default 200 ms deadline per example
# is a timed assertion, and a busy machine is the normal case. A test's own settings() keep this.
hypothesis.settings.register_profile("stepline", deadline=None)
hypothesis.settings.load_profile("stepline")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture()
def broker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A second server of the test's own, for Celery's broker apart from the job store."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("broker"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def broker_redis(broker_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(broker_server.url)
    yield client
    client.close()


@pytest.fixture()
def stack_env(
    redis_server: EmbeddedRedis, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, str]:
    """Environment for this process and its worker children: one Redis, fast failure detection."""
    yield from use_stack_env({"REDIS_URL": redis_server.url}, tmp_path, monkeypatch)
    current_settings.cache_clear()


def use_stack_env(extra: dict[str, str], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Set the stack's environment (``extra`` over a run directory under ``tmp_path`` and fast
    failure detection) in this process, and point the in-process Celery app at it; yields it."""
    env = {
        "STEPLINE_RUN_DIR": str(tmp_path / "run"),
        "STEPLINE_BROKER__VISIBILITY_TIMEOUT": "4",
        "STEPLINE_BROKER__UNACKED_RESTORE_INTERVAL": "1",
        "STEPLINE_BROKER__CHUNK_LEASE": "1.5",
        **extra,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    current_settings.cache_clear()
    _reset_celery_app()
    yield env


def _reset_celery_app() -> None:
    """The in-process Celery app (used to publish) must see this test's broker."""
    configure_celery(current_settings())  # once per session: one redis-server


class Processes:
    """Real worker processes started by a test, all stopped at its end."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, command: list[str], extra_env: dict[str, str] | None = None) -> (
        subprocess.Popen[bytes]
    ):
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(command, cwd=ROOT, env={**self.env, **(extra_env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def worker(self, name: str, queues: tuple[str, ...] = ("realtime", "interactive", "batch",
                                                           "standby"),
               extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        from app.stack import worker_command

        return self.start(name, worker_command(f"{name}@test", queues), extra_env)

    def scheduler(self) -> None:
        """A control-queue worker and beat: the tick runs every 100 ms."""
        from app.stack import beat_command, worker_command

        self.start("scheduler", worker_command("scheduler@test", ("control",)))
        self.start("beat", beat_command(self.log_dir))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@pytest.fixture()
def processes(stack_env: dict[str, str], tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(stack_env, tmp_path / "logs")
    yield procs
    procs.stop_all()


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll until ``predicate()`` is truthy; fail the test saying what never happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def wait_for_workers(client: redis.Redis, names: list[str], timeout_s: float = 60) -> None:
    """Workers advertise themselves once ready (their heartbeat key)."""

    wait_for(lambda: all(client.exists(keys.WORKER_PREFIX + f"{n}@test") for n in names), timeout_s,
             f"workers {names} to start")


def done(store: JobStore, job_id: str) -> bool:
    """Whether the job is DONE; a job that FAILED or was CANCELLED fails the test at once
    (with its record), instead of a wait that runs out."""
    from scheduler.lifecycle import JobState

    state = store.state(job_id)
    assert state not in (JobState.FAILED, JobState.CANCELLED), store.fields(job_id)
    return state is JobState.DONE


def job_audit(store: JobStore, job_id: str) -> JobAudit:
    """The job's exactness audit against the configured artifact directory."""
    from app.drills.faults import audit_job
    from tasks.artifacts import ArtifactStore

    return audit_job(store, ArtifactStore(current_settings().artifacts_path), job_id)


def preempt_after(store: JobStore, job_id: str, chunks: int, timeout_s: float = 60) -> None:
    """Once ``chunks`` chunks of the job ran, raise its preempt flag (fenced on what it was)
    and wait until it yields (PREEMPTED)."""
    from scheduler.lifecycle import JobState

    wait_for(lambda: int(store.fields(job_id)["next_chunk"]) >= chunks, timeout_s,
             f"{chunks} chunks of {job_id} to run")
    wait_for(lambda: store.request_preempt(job_id, state=(r := store.record(job_id)).state,
                                           epoch=r.epoch), 10, "the preempt flag to be set")
    wait_for(lambda: store.state(job_id) is JobState.PREEMPTED, 30, "the job to yield")


PY = sys.executable


def recover_once(store: JobStore, settings: Settings, now_s: float,
                 cost: CostModel | None = None) -> list[str]:
    """The recovery part of one tick, as the tick runs it (snapshot, plan, apply its failures
    and recoveries), at ``now_s``; returns the ids of the jobs requeued."""
    policy = policy_config(settings, store)
    seen = read_snapshot(store, cost or policy.new_cost_model(), policy, now_s)
    plan = plan_tick(seen.snapshot, policy, now_s)
    target = LiveTarget(store, seen.records, settings)
    for failure in plan.failures:
        target.fail(failure)
    return [r.job_id for r in plan.recoveries if target.recover(r)]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3-compatible server (SeaweedFS) on loopback, one per test session."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()
