"""What a worker process holds between tasks: its store client, checkpoint cache and heartbeat.

The heartbeat thread advertises the worker (``sl:worker:<name>``) and renews the lease of the
chunk it is running, so the scheduler can tell a slow step from a dead worker.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import cache

from app.artifacts import ArtifactStore
from app.runtime import connect, current_settings, redis_url
from app.settings import Settings
from app.store import PREFIX, JobStore
from workers.kinds import RunnerOptions, get_runner, limit_threads
from workers.local_cache import LocalCheckpointCache
from workers.runner import JobRunner

log = logging.getLogger(__name__)

WORKER_KEY = PREFIX + "worker:"


@dataclass
class WorkerContext:
    """Process-wide state of one worker."""

    settings: Settings
    store: JobStore
    artifacts: ArtifactStore
    cache: LocalCheckpointCache = field(default_factory=LocalCheckpointCache)
    name: str = "worker"
    queues: tuple[str, ...] = ()
    busy_job: str | None = None
    chunks_run: int = 0
    _beat: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def runner(self, kind: str) -> JobRunner:
        """The runner for ``kind``, built with this worker's device settings."""
        s = self.settings
        if kind == "text":
            from workers import moe

            limit_threads(s.torch_threads)
            return moe.get_runner(s.moe, device=s.device)
        return get_runner(kind, RunnerOptions(
            device=s.device, block_groups=s.diffusion.block_groups,
            video_fps=s.diffusion.video_fps, torch_threads=s.torch_threads,
        ))

    def start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="hb")
            self._beat.start()

    def heartbeat_once(self) -> None:
        lease_s = self.settings.broker.chunk_lease
        body = {
            "name": self.name, "busy_job": self.busy_job, "queues": list(self.queues),
            "device": self.settings.device, "ts": time.time(), "chunks_run": self.chunks_run,
            "ckpt_cache": {"hits": self.cache.hits, "misses": self.cache.misses},
        }
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.set(WORKER_KEY + self.name, json.dumps(body), px=int(lease_s * 1000))
        if self.busy_job is not None:
            pipe.hset(JobStore.job_key(self.busy_job), "lease_until", repr(time.time() + lease_s))
        pipe.execute()

    def _heartbeat_loop(self) -> None:
        period_s = self.settings.broker.chunk_lease / 3
        while not self._stop.wait(period_s):
            try:
                self.heartbeat_once()
            except Exception:  # a Redis outage must not kill the thread
                log.warning("heartbeat of %s failed", self.name, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.redis.delete(WORKER_KEY + self.name)
        except Exception:
            log.debug("could not remove worker key of %s", self.name, exc_info=True)


@cache
def worker_context() -> WorkerContext:
    """The context of this process (built on first use)."""
    settings = current_settings()
    store = JobStore(connect(redis_url(settings)))
    artifacts = ArtifactStore(settings.artifacts_path)
    return WorkerContext(settings=settings, store=store, artifacts=artifacts)
