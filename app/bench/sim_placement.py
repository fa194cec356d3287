"""The residency side of the simulated cluster (with a models trace and a ``ResidencyConfig``):
each worker's memory and own queues, the placement's view of the workers (:class:`Holding`),
the loads a chunk pays when it starts and what they teach the load estimates, and the tick's
pass before the plan: the queued demand, each waiting job's expected load, the moves marked on
parked chunks and the models staged into host memory.

:class:`SimPlacement` is the base of ``app.bench.simulate.ClusterSim``: it reads the cluster
state that class builds (declared below) and keeps its own counters.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from app.bench.sim_records import SimJob, SimWorker
from app.bench.sim_residency import ResidencyConfig, WorkerMemory
from app.bench.sim_workload import SimArrival, SimConfig
from scheduler import CostModel, JobState, PolicyConfig
from scheduler.placement import (
    Holding,
    LoadEstimates,
    LoadPriors,
    ModelNeed,
    PlacementPolicy,
    QueuedChunk,
    cold_load_s,
    expected_load_s,
    mark_moves,
    stage,
)
from tasks.routing import (
    OWN_QUEUE_CLASSES,
    affinity_queue,
    class_queue_of,
    hop_worker,
    placed_queue,
    replaced_from,
    with_affinity,
)


class SimPlacement:
    """Model residency and placement on the simulated cluster's workers (none when ``res`` is
    None: every model counts as held)."""

    config: SimConfig
    policy: PolicyConfig
    cost: CostModel
    now: float
    workers: list[SimWorker]
    by_name: dict[str, SimWorker]
    idle: dict[str, SimWorker]
    queues: dict[str, deque[tuple[SimJob, int]]]
    live: dict[str, SimJob]

    def _start_residency(self, res: ResidencyConfig | None, trace: Sequence[SimArrival]) -> None:
        """The residency counters; with ``res`` and a trace whose jobs name models, each
        worker's memory and own queues (:meth:`_model_residency`)."""
        self.res = res if res is not None and any(a.model for a in trace) else None
        self.estimates = LoadEstimates()
        self.demand: dict[str, int] = {}
        self.staging: set[tuple[str, str]] = set()
        self.counts = {"base_loads": 0, "host_loads": 0, "adapter_loads": 0, "staged": 0,
                       "first_starts": 0, "warm_starts": 0, "placed_on_worker": 0,
                       "parked_recovered": 0, "resume_loads": 0, "model_left": 0,
                       "idle_holder": 0}
        self.per_job: dict[str, list[float]] = {
            key: [0.0] * len(trace)
            for key in ("base_loads", "host_loads", "adapter_loads", "resume_loads", "load_s")}
        if self.res is not None:
            self._model_residency(self.res)

    def _model_residency(self, res: ResidencyConfig) -> None:
        """Each worker gets its memory and its own queues; the placement's load estimates start
        from the production priors on the catalog's clock; a chunk parked on a busy worker's
        own queue waits up to ``park_max_wait_s`` before the tick moves it back."""
        scale = res.catalog.time_scale
        defaults = LoadPriors()
        self.estimates = LoadEstimates(LoadPriors(defaults.disk_s * scale,
                                                  defaults.host_s * scale,
                                                  defaults.adapter_s * scale))
        self.policy = replace(self.policy, recovery=replace(
            self.policy.recovery, affinity_max_wait_s=res.park_max_wait_s,
            wait_within_slack=res.placement is PlacementPolicy.STEPLINE))
        for k, w in enumerate(self.workers):
            w.mem = WorkerMemory(res, random.Random(f"{res.seed}-{k}"))
            w.consumes = with_affinity(w.name, w.queues)
            for q in w.consumes:
                self.queues.setdefault(q, deque())

    def _need(self, job: SimJob) -> ModelNeed:
        model = job.arrival.model or ""
        size = self.res.catalog.by_name[model].bytes if self.res is not None else 0
        return ModelNeed(model, frozenset(job.arrival.adapters), size)

    def _holdings(self, queue: str | None, need: ModelNeed | None = None
                  ) -> tuple[Holding, ...]:
        """The alive workers with a placement queue for ``queue`` as placement sees them: when
        each is free (the estimated remaining work and load of its running job and of every
        job parked on its own queues: those jobs stay on it, and as the planner moves them
        between levels they share it chunk by chunk with whatever it takes next) and what it
        holds; models being staged count as in host memory."""
        out: list[Holding] = []
        for w in self.workers:
            mem = w.mem
            if not w.alive or mem is None or (
                    queue is not None and placed_queue(w.name, queue) not in w.consumes):
                continue
            free_in_s = 0.0
            running = w.job
            if running is not None:
                free_in_s += max(w.run_start_s - self.now, 0.0) + max(
                    self._remaining_est_s(running) - max(self.now - w.run_start_s, 0.0), 0.0)
            prefix = f"{w.name}."
            for own in w.consumes:
                if not own.startswith(prefix):
                    continue
                for job, epoch in self.queues[own]:
                    if epoch == job.epoch and job.state is JobState.QUEUED \
                            and job.parked_q == own:
                        free_in_s += self._remaining_est_s(job)
            staging = frozenset(m for name, m in self.staging if name == w.name)
            out.append(Holding(w.name, free_in_s, frozenset(mem.device),
                               frozenset(mem.host) | staging,
                               frozenset(mem.adapters) | frozenset(mem.host_adapters),
                               free_bytes=mem.free_device_bytes()))
        return tuple(out)

    def _remaining_est_s(self, job: SimJob) -> float:
        """The job's remaining work as the cost model estimates it (what a live placement
        reads from the job's record), plus a hop per chunk."""
        key = job.arrival.shape.cost_key
        chunks_left = job.arrival.shape.chunks - job.next_chunk
        return (job.units_left * self.cost.seconds_per_unit(key, "cuda")
                + chunks_left * self.config.dispatch_overhead_s)

    def _load(self, w: SimWorker, job: SimJob) -> float:
        """What ``w`` pays before ``job``'s chunk can run: its base model and adapters made
        resident, each measured load taught to the placement's estimates."""
        assert w.mem is not None and job.arrival.model is not None
        model = job.arrival.model
        load = w.mem.acquire(model, job.arrival.adapters, self.now, self._parked_models(w))
        if job.started_warm is None:
            job.started_warm = load.base_tier is None
            self.counts["first_starts"] += 1
            self.counts["warm_starts"] += load.base_tier is None
        k = job.arrival.index
        per_job = self.per_job
        per_job["load_s"][k] += load.seconds
        if load.base_tier is not None:
            self.counts["base_loads"] += 1
            self.counts["resume_loads"] += job.service_s > 0
            self.counts["host_loads"] += load.base_tier == "host"
            per_job["base_loads"][k] += 1
            per_job["resume_loads"][k] += job.service_s > 0
            per_job["host_loads"][k] += load.base_tier == "host"
            self.estimates.observe(model, "host" if load.base_tier == "host" else "disk",
                                   load.base_s)
        if load.adapters:
            self.counts["adapter_loads"] += load.adapters
            per_job["adapter_loads"][k] += load.adapters
            self.estimates.observe(f"{model}/*", "adapter", load.adapter_s / load.adapters)
        if job.load_s:
            job.load_s = 0.0
        w.load_s += load.seconds
        return load.seconds

    def _parked_models(self, w: SimWorker) -> frozenset[str]:
        """Models of the jobs in progress whose next chunk waits on ``w``'s own queues."""
        held: set[str] = set()
        prefix = f"{w.name}."
        for own in w.consumes:
            if not own.startswith(prefix):
                continue
            for job, epoch in self.queues[own]:
                if epoch == job.epoch and job.parked_q == own and job.service_s > 0 \
                        and job.arrival.model is not None:
                    held.add(job.arrival.model)
        return frozenset(held)

    def _staged(self, payload: tuple[SimWorker, str]) -> None:
        """A model read into a worker's host memory ahead of its jobs."""
        w, model = payload
        self.staging.discard((w.name, model))
        if w.alive and w.mem is not None and w.mem.stage(model, self.now):
            self.counts["staged"] += 1

    def _mark_moves(self, waiting: Sequence[SimJob]) -> None:
        """``model_left`` and ``idle_holder`` of each waiting job by the live tick's rule
        (:func:`scheduler.placement.mark_moves`), read from the simulated workers' state
        (always current, as a heartbeat written since the chunk was queued)."""
        queued: list[QueuedChunk] = []
        for job in waiting:
            w = self.by_name.get(job.parked_on or "")
            own = job.parked_q if job.state is JobState.QUEUED else None
            if w is None or w.mem is None or own is None:
                continue
            queue = class_queue_of(own)
            queued.append(QueuedChunk(job.id, self._need(job), job.arrival.deadline_s, w.name,
                                      hop_worker(own) is not None,
                                      queue if queue in OWN_QUEUE_CLASSES else None))
        busy = {w.name for w in self.workers if w.job is not None}
        device = {w.name: frozenset(w.mem.device) for w in self.workers if w.mem is not None}
        idle = self._idle_holdings(waiting) \
            if any(c.worker in busy and c.class_queue for c in queued) else {}
        moves = mark_moves(queued, device, busy, idle)
        for job in waiting:
            left, moved = job.id in moves.model_left, job.id in moves.idle_holder
            if left != job.model_left:
                job.model_left, job.view = left, None
            if moved != job.idle_holder:
                job.idle_holder, job.view = moved, None

    def _idle_holdings(self, waiting: Sequence[SimJob]) -> dict[str, list[Holding]]:
        """Per class queue with own queues, the idle workers that would take a chunk placed
        anew from it (through their placement queue, or the shared standby queue) with nothing
        parked on them, as placement sees them."""
        parked_on = {job.parked_on for job in waiting if job.parked_on is not None}
        out: dict[str, list[Holding]] = {}
        for w in self.idle.values():
            mem = w.mem
            if not w.alive or mem is None or w.job is not None or w.name in parked_on:
                continue
            held = Holding(w.name, 0.0, frozenset(mem.device), frozenset(mem.host),
                           frozenset(mem.adapters))
            for queue in OWN_QUEUE_CLASSES:
                if replaced_from(w.name, queue) in w.consumes:
                    out.setdefault(queue, []).append(held)
        return out

    def _residency_tick(self, res: ResidencyConfig) -> list[tuple[float, SimWorker, str]]:
        """Before the plan: the queued demand per model; each waiting job's expected load
        (:func:`scheduler.placement.expected_load_s`, told to the planner as ``load_s``); and,
        under staging, the models to read into host memory (in the background: a read from
        disk into host memory does not hold the device), returned in order as (when the read
        ends, the worker, the model)."""
        demand: dict[str, int] = {}
        waiting: list[SimJob] = []
        for job in self.live.values():
            model = job.arrival.model
            if model is None or job.state is JobState.RUNNING:
                continue
            demand[model] = demand.get(model, 0) + 1
            waiting.append(job)
        self.demand = demand
        workers = self._holdings(None)
        if res.placement is PlacementPolicy.STEPLINE:
            self._mark_moves(waiting)
        cold: dict[tuple[str, tuple[str, ...]], float] = {}
        for job in waiting:  # what moving a parked chunk would cost: its parked wait
            key = (job.arrival.model or "", job.arrival.adapters)
            reload_s = cold.get(key)
            if reload_s is None:
                reload_s = cold[key] = cold_load_s(self._need(job), self.estimates)
            if reload_s != job.reload_s:
                job.reload_s, job.view = reload_s, None
        if res.loads_in_plan and not res.free_loads:
            expected: dict[tuple[str, tuple[str, ...]], float] = {}
            for job in waiting:
                key = (job.arrival.model or "", job.arrival.adapters)
                load_s = expected.get(key)
                if load_s is None:
                    load_s = expected[key] = expected_load_s(self._need(job), workers,
                                                             self.estimates)
                if load_s != job.load_s:
                    job.load_s, job.view = load_s, None
        reads: list[tuple[float, SimWorker, str]] = []
        if res.stage and res.host_budget_bytes > 0:
            catalog = res.catalog
            mean_bytes = sum(m.bytes for m in catalog.models) / len(catalog.models)
            slots = {w.name: int(w.mem.free_host_bytes() // mean_bytes)
                     for w in self.workers if w.alive and w.mem is not None}
            for name, model in stage(demand, workers, self.estimates, res.stage_min_queued,
                                     slots):
                w = self.by_name[name]
                assert w.mem is not None
                self.staging.add((name, model))
                reads.append((self.now + w.mem.read_into_host_s(model), w, model))
        return reads

    def _keeps(self, job: SimJob, to_queue: str) -> str | None:
        """With residency, the worker a queued chunk moved to ``to_queue`` stays parked on: the
        one it is parked on, when that worker has its own queue for ``to_queue``."""
        w = self.by_name.get(job.parked_on or "")
        if w is None or w.mem is None or to_queue not in OWN_QUEUE_CLASSES \
                or affinity_queue(w.name, to_queue) not in w.consumes:
            return None
        return w.name
