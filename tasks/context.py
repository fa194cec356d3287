"""What a worker process holds between tasks: its store client, checkpoint cache and heartbeat.

The heartbeat thread advertises the worker (``sl:worker:<name>``) and renews the lease of the
chunk it is running, so the scheduler can tell a slow step from a dead worker. A worker with a
host-memory tier also runs a stager thread: it pops the tick's requests to read a model into
host memory ahead of its queued jobs (``keys.stage``) and reads it there beside the chunks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.checkpoint_objects import CheckpointObjects, CheckpointSweeper
from tasks.heartbeat import Heartbeat, write_heartbeat
from tasks.holdings import StageRequest, model_need, resident_model
from tasks.runtime import broker_client, current_settings, store_client
from tasks.settings import Settings
from tasks.settings.moe import cache_config, router_config
from tasks.store import JobStore, queue_lease_renewal
from workers.kinds import RunnerOptions, get_runner
from workers.local_cache import LocalCheckpointCache
from workers.residency import ModelResidency, configure, process_residency
from workers.runner import JobRunner

if TYPE_CHECKING:
    from tasks.experts import VersionSync
    from workers.moe.runner import TextRunner

log = logging.getLogger(__name__)



@dataclass
class HopProfile:
    """Where a worker's time between chunks goes: seconds and counts per phase of a hop
    (claim, state load, checkpoint encode, commit, publish, bookkeeping), cumulative, published in
    the heartbeat for `tests/bench/bench_hop.py`. Two clock reads per phase: always on."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, started: float) -> float:
        """Charge the time since ``started`` (``perf_counter``) to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - started
        self.counts[phase] = self.counts.get(phase, 0) + 1
        return now

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {phase: {"s": round(self.seconds[phase], 6), "n": self.counts[phase]}
                for phase in self.seconds}


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
    batch_jobs: tuple[str, ...] = ()
    """The other jobs of the batch the worker runs now (``busy_job`` is its first)."""
    chunks_run: int = 0
    chunk_since: float | None = None
    """When the chunk (or batch) it runs now began (Unix seconds); None while idle."""
    left_s: float | None = None
    """The expected seconds of its running job's remaining work from ``chunk_since`` (its
    remaining cost units at this worker's measured seconds per unit); None while idle or
    before it measured any."""
    s_per_unit: float | None = None
    """Its chunks' seconds per cost unit, an exponentially weighted mean."""
    idle_since: float | None = None
    """Since when it has been idle consuming the queues its last heartbeat listed (Unix
    seconds; None while a chunk runs and before its first): the heartbeat's ``idle_since``."""
    _beat_queues: tuple[str, ...] = ()
    consumer: Any = None
    """Celery's consumer of this worker (set once ready): what it consumes right now."""
    experts: dict[str, dict[str, object]] = field(default_factory=dict)
    """Residency summary of each loaded MoE model, refreshed after every text chunk."""
    expert_cache: dict[str, float] = field(default_factory=dict)
    """Hits, misses, stall time and prefetch outcomes of the expert caches (same refresh)."""
    profile: HopProfile = field(default_factory=HopProfile)
    warm: bool = False
    """No warm-up is pending: every recipe's warm-up job ran, or warm start is off."""
    warmed: tuple[str, ...] = ()
    """The recipes whose warm-up job ran (the heartbeat's ``warmed``)."""
    _kinds_run: set[str] = field(default_factory=set)
    _options: dict[str, RunnerOptions] = field(default_factory=dict)
    _runner_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the worker runs a task's chunks: the heartbeat's idle unload waits them out."""
    _models_set: bool = False
    _versions: VersionSync | None = None
    _beat: threading.Thread | None = None
    _stager: threading.Thread | None = None
    _staging: str | None = None
    """The model the stager thread has popped a request for and reads now (advertised at
    once, before the residency starts the read)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    """Set to beat now rather than at the period's end (the models held changed)."""
    _checkpoint_objects: CheckpointObjects | None = None
    _checkpoint_sweeper: CheckpointSweeper | None = None

    @property
    def checkpoint_objects(self) -> CheckpointObjects:
        """Where this worker's commits put checkpoints too large for Redis (the artifact
        store, above ``artifacts.checkpoint_offload_bytes``), and where its claims read them."""
        if self._checkpoint_objects is None:
            self._checkpoint_objects = CheckpointObjects.from_settings(self.settings,
                                                                       self.artifacts)
        return self._checkpoint_objects

    @property
    def checkpoint_sweeper(self) -> CheckpointSweeper:
        """The scheduler's periodic removal of ended jobs' checkpoint objects."""
        if self._checkpoint_sweeper is None:
            self._checkpoint_sweeper = CheckpointSweeper(
                self.checkpoint_objects, self.store.redis,
                self.settings.artifacts.checkpoint_sweep_interval)
        return self._checkpoint_sweeper

    def runner(self, kind: str) -> JobRunner:
        """The runner for ``kind``, built with this worker's device and model settings."""
        self.models()
        self._kinds_run.add(kind)
        if kind not in self._options:
            self._options[kind] = runner_options(self.settings, kind)
        return get_runner(kind, self._options[kind])

    def text_runner(self) -> TextRunner:
        """The MoE runner of this worker, with its expert-version sync thread running."""
        from tasks.experts import VersionSync  # deferred: loads torch
        from workers.moe.runner import TextRunner as Runner  # deferred: loads torch

        runner = self.runner("text")
        assert isinstance(runner, Runner)
        if self._versions is None:
            self._versions = VersionSync(self.store, self.settings, runner)
            self._versions.start(period_s=min(1.0, self.settings.broker.chunk_lease / 3))
        return runner

    def runner_loaded(self, kind: str) -> bool:
        return kind in self._kinds_run

    def models(self) -> ModelResidency:
        """This process's model residency, set to this worker's ``residency`` settings."""
        r = self.settings.residency
        if not self._models_set:
            configure(r.memory_budget_bytes, r.host_memory_budget_bytes, r.policy,
                      r.reuse_half_life)
            # a load a chunk waits for is in the heartbeat as it begins and as it ends: the
            # tick counts the rest of it into when this worker is free
            process_residency().on_load = self._wake.set
            self._models_set = True
        return process_residency()

    def load_wait_s(self) -> float:
        """Seconds this worker's chunks have waited for model loads so far (the residency's
        announced loads): a chunk's work, and the cost model's sample of it, is timed without
        them, as the simulator times a chunk from its load's end."""
        return process_residency().load_wait_s if self._models_set else 0.0

    def consuming(self) -> tuple[str, ...]:
        """The queues this worker consumes now (remote control may have changed them)."""
        try:
            return tuple(q.name for q in self.consumer.task_consumer.queues)
        except AttributeError:  # not a Celery worker (tests), or reconnecting
            return self.queues

    def refresh_residency(self) -> None:
        """Re-read what the expert caches hold (never while a chunk runs)."""
        from workers import moe  # deferred: loads torch

        self.experts = moe.residency()
        self.expert_cache = moe.cache_totals()

    def warm_up(self) -> None:
        """Run one tiny job of every recipe in this process (see ``workers.warm``), then report
        the worker warm; a recipe whose warm-up fails is logged and left cold."""
        from workers.warm import run_to_end, warm_jobs  # deferred: loads torch

        if not self.settings.warm_start:
            self.warm = True
            return
        started_s = time.perf_counter()
        for job in warm_jobs():
            try:
                runner = self.text_runner() if job.kind == "text" else self.runner(job.kind)
                seconds = run_to_end(runner, job.chunk_params)
            except Exception:
                log.warning("worker %s: warm-up of %s failed; its first job builds it",
                            self.name, job.recipe, exc_info=True)
                continue
            self.warmed = (*self.warmed, job.recipe)
            log.info("worker %s: %s warm in %.2fs", self.name, job.recipe, seconds)
        self.warm = True
        log.info("worker %s warm (%s) in %.2fs", self.name, ", ".join(self.warmed),
                 time.perf_counter() - started_s)

    @contextmanager
    def running(self, job_ids: Sequence[str], units_left: float = 0.0,
                chunk_units: float = 0.0) -> Iterator[None]:
        """The worker runs chunks of ``job_ids`` (the first one the task's own): the heartbeat
        renews their leases, and the idle unload waits; after them, the expert residency the
        heartbeat advertises is re-read."""
        models = self.models()
        loads_before = _loads_and_evictions(models)
        with self._runner_lock, models.in_use():  # its models are never evicted meanwhile
            self.busy_job, self.batch_jobs = job_ids[0], tuple(job_ids[1:])
            self.chunk_since = began = time.time()
            self.idle_since = None
            waited = self.load_wait_s()
            rate = self.s_per_unit
            self.left_s = None if rate is None else units_left * rate
            try:
                yield
            finally:
                self.busy_job, self.batch_jobs = None, ()
                self.chunk_since = self.left_s = None
                self.idle_since = time.time()
                if chunk_units > 0:  # its work's pace: the loads it waited for left out
                    took = max(time.time() - began - (self.load_wait_s() - waited),
                               0.0) / chunk_units
                    self.s_per_unit = took if rate is None else rate + 0.3 * (took - rate)
                if self.runner_loaded("text"):
                    self.refresh_residency()
        if _loads_and_evictions(models) != loads_before:
            self._wake.set()  # placement reads what it holds from the heartbeat: beat now

    def unload_idle_experts(self, now_s: float) -> int:
        """Unload the experts no chunk used for ``moe.cache.idle_unload`` (``now_s`` on the
        runners' clock, ``time.monotonic()``) and re-read the residency; from the heartbeat
        thread, so a worker that gets no text work unloads them too. Skipped while chunks run
        (they tick the caches themselves). Returns how many were unloaded."""
        if not self.runner_loaded("text") or not self._runner_lock.acquire(blocking=False):
            return 0
        try:
            from workers import moe  # deferred: loads torch (loaded already: a text job ran)

            unloaded = moe.unload_idle(now_s)
            if unloaded:
                self.refresh_residency()
            return unloaded
        finally:
            self._runner_lock.release()

    def start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="hb")
            self._beat.start()

    def start_stager(self) -> None:
        """Start popping the tick's staging requests, where this worker has a host tier and
        staging is on (``residency.stage_min_queued``)."""
        r = self.settings.residency
        if self._stager is None and r.host_memory_budget_bytes != 0 and r.stage_min_queued > 0:
            self._stager = threading.Thread(target=self._stager_loop, daemon=True,
                                            name="stager")
            self._stager.start()

    def _stager_loop(self) -> None:
        key = keys.stage(self.name)
        while not self._stop.is_set():
            try:
                got = self.store.redis.blpop([key], timeout=1)
            except Exception:  # a Redis outage: staging is advisory, try again shortly
                log.debug("reading staging requests of %s failed", self.name, exc_info=True)
                self._stop.wait(1.0)
                continue
            if got is not None:
                self.stage(got[1])

    def stage(self, raw: bytes | str) -> bool:
        """Carry out one staging request: read its model into this worker's host memory (the
        runner's ``stage``), beside whatever chunk runs; the heartbeat says it is staging from
        the start, and what it holds once done. False when nothing was staged."""
        try:
            request = StageRequest.model_validate_json(raw)
        except ValidationError as e:
            log.warning("worker %s: a staging request is not valid, dropped: %s", self.name, e)
            return False
        need = model_need(request.kind, request.params)
        if need is None:  # a kind placement does not route by model: nothing to stage
            return False
        stage = getattr(self.runner(request.kind.value), "stage", None)
        if stage is None:
            return False
        model = need.model
        self._staging = model
        try:
            self.heartbeat_once()  # the tick counts it as held from now: asked once
        except Exception:
            log.debug("heartbeat of %s failed", self.name, exc_info=True)
        started_s = time.perf_counter()
        try:
            staged = bool(stage(request.params))
        except Exception:  # e.g. a recipe this worker does not have: its chunk will say so
            log.warning("worker %s: staging %s failed", self.name, model, exc_info=True)
            staged = False
        finally:
            self._staging = None
            self._wake.set()  # placement reads the host tier from the heartbeat: beat now
        if staged:
            log.info("worker %s staged %s into host memory in %.2fs", self.name, model,
                     time.perf_counter() - started_s)
        return staged

    def heartbeat_once(self) -> None:
        lease_s = self.settings.broker.chunk_lease
        queues, now = self.consuming(), time.time()
        if queues != self._beat_queues:  # idle on these queues only from now
            self._beat_queues = queues
            self.idle_since = None if self.idle_since is None else now
        if self.idle_since is None and self.busy_job is None and self.chunk_since is None:
            self.idle_since = now  # its first beat, or its first after a queue change
        consuming = self.consumer is not None and self.warm and self.busy_job is None
        beat = Heartbeat(
            name=self.name, busy_job=self.busy_job, queues=queues,
            batch=len(self.batch_jobs) + 1 if self.batch_jobs else (1 if self.busy_job else 0),
            device=self.settings.device, ts=now, chunks_run=self.chunks_run,
            ckpt_cache={"hits": self.cache.hits, "misses": self.cache.misses,
                        "hit_rate": round(self.cache.hit_rate, 4)},
            experts=self.experts, hop_profile=self.profile.as_dict(),
            expert_cache=self.expert_cache, warm=self.warm, warmed=tuple(self.warmed),
            residency=self._residency_summary(),
            chunk_since=self.chunk_since, left_s=self.left_s,
            idle_since=self.idle_since if consuming else None,
        )
        pipe = self.store.redis.pipeline(transaction=False)
        write_heartbeat(pipe, beat, lease_s)
        if self.busy_job is not None:
            queue_lease_renewal(pipe, {self.busy_job, *self.batch_jobs}, lease_s)
        pipe.execute()

    def _residency_summary(self) -> dict[str, Any]:
        """The heartbeat's ``residency``: what the models' residency holds, and whether this
        worker stages (``stager``) and what (``staging``, residency keys' model part)."""
        if not self._models_set:
            return {}
        summary = self.models().summary()
        if self._stager is not None:
            summary["stager"] = True
            summary["staging"] = staging_list(summary["staging"], self._staging)
        return summary

    def _heartbeat_loop(self) -> None:
        period_s = self.settings.broker.chunk_lease / 3
        while True:
            self._wake.wait(period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.unload_idle_experts(time.monotonic())
            except Exception:  # the residency is advisory: never stop the heartbeat over it
                log.warning("idle unload of %s failed", self.name, exc_info=True)
            try:
                self.heartbeat_once()
            except Exception:  # a Redis outage must not kill the thread
                log.warning("heartbeat of %s failed", self.name, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._versions is not None:
            self._versions.stop()
        try:
            self.store.redis.delete(keys.worker(self.name))
            self.store.redis.zrem(keys.WORKERS_LIVE, self.name)
        except Exception:
            log.debug("could not remove worker key of %s", self.name, exc_info=True)


def _loads_and_evictions(models: ModelResidency) -> tuple[int, ...]:
    """What changes when the models a worker holds change: its load and eviction counts."""
    c = models.counters
    return (*c.loads.values(), *c.evictions.values(), c.adapter_loads)


def runner_options(settings: Settings, kind: str) -> RunnerOptions:
    """What the runner of ``kind`` is built with on this worker (a text runner's router and
    expert cache from the ``moe`` settings)."""
    s = settings
    text = kind == "text"
    return RunnerOptions(
        device=s.device, block_groups=s.diffusion.block_groups,
        video_fps=s.diffusion.video_fps, torch_threads=s.torch_threads,
        router=router_config(s.moe) if text else None,
        cache=cache_config(s.moe, s.device) if text else None,
        adapters_dir=None if s.diffusion.adapters_dir is None else str(s.diffusion.adapters_dir),
    )


@cache
def worker_context() -> WorkerContext:
    """The context of this process (built on first use)."""
    settings = current_settings()
    store = JobStore(store_client(settings), commit_replicas=settings.broker.commit_replicas,
                     commit_replica_timeout_s=settings.broker.commit_replica_timeout,
                     broker=broker_client(settings))
    artifacts = ArtifactStore.from_settings(settings)
    return WorkerContext(settings=settings, store=store, artifacts=artifacts)


def staging_list(keys_: list[str], asked: str | None) -> list[str]:
    """The heartbeat's ``staging``: the residency keys being read into host memory, and the
    model the stager was asked for (``asked``, as placement names it) until a key of it is
    among them: each model once, from the request until its build ends."""
    if asked is None or any((resident_model(k) or k) == asked for k in keys_):
        return keys_
    return [*keys_, asked]
