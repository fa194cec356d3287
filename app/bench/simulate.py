"""Discrete-event simulation of Stepline at scale: the live tick's planner on a virtual clock.

No Celery, no Redis, no devices: N simulated workers consume simulated queues the way the real
ones do (strict queue order, the reserve's realtime-only workers, one chunk at a time, a
dispatch overhead per hop), and every ``tick_s`` the planner the live tick holds
(:class:`scheduler.IncrementalPlanner`, held across ticks as ``tasks.tick`` holds it; its
plans equal ``plan_tick``'s) plans the cluster; its plan goes through the live tick's own
apply loop (``tasks.apply.apply_plan``) with the simulated cluster as the target, recoveries
included. Chunk durations are the published GPU step figures of the cost model's priors, with
jitter. Everything it reports is labelled as simulation.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.bench.oracle import Discipline, OracleJob, mean_response_lower_bound_s, run_oracle
from app.bench.report import percentile
from app.bench.sim_residency import ResidencyConfig, WorkerMemory
from app.bench.workload import Arrivals, arrival_times
from scheduler import (
    AdmissionStatus,
    ClusterSnapshot,
    IncrementalPlanner,
    JobKind,
    JobState,
    JobView,
    LevelMark,
    PolicyConfig,
    PolicyKind,
    PolicyState,
    ResourceProfile,
    SloClass,
    SubmitAction,
    SubmitDecision,
    TickPlan,
    Tier,
    WorkerView,
    check_plan_invariants,
    decide_submit,
)
from scheduler.degradation import Degradation, QualityLadder, choose_steps
from scheduler.fairness import ServiceLedger
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
    place,
    slack_s,
    stage,
)
from scheduler.plan import Release
from scheduler.queues import CLASS_QUEUE, NORMAL_WORKER_QUEUES, STANDBY_QUEUE
from scheduler.recovery import Failure, Recovery, RecoveryCause
from tasks.apply import apply_plan
from tasks.routing import (
    AFFINITY_CLASSES,
    OWN_QUEUE_CLASSES,
    affinity_queue,
    class_queue_of,
    hop_worker,
    placed_queue,
    replaced_from,
    with_affinity,
)

NOTE = ("simulated: a discrete-event model of the adapter, the workers and the Celery queues "
        "driving the live tick's planner on a virtual clock; chunk times are published H100 step "
        "figures (cost-model priors) with jitter, not measurements of this machine")
SIM_POLICIES = ("fifo", "priority", "edf", "srpt", "least_slack", "stepline")
ORACLES = ("oracle-edf", "oracle-srpt")
ALL_POLICIES = (*SIM_POLICIES, *ORACLES)
GROUPS = ("urgent", "realtime", "interactive", "batch", "all")
"""Report rows: ``urgent`` is the realtime jobs with an SLO under 100 ms (stress test only)."""

CLASS_TARGET_S = {SloClass.REALTIME: 1.0, SloClass.INTERACTIVE: 5.0, SloClass.BATCH: 60.0}
@dataclass(frozen=True, slots=True)
class Shape:
    """One job type of the mix: chunks of ``units_per_chunk`` cost units at ``s_per_unit``."""

    name: str
    share: float
    slo: SloClass
    kind: JobKind
    cost_key: str
    chunks: int
    units_per_chunk: float
    s_per_unit: float
    block_groups: int
    deadline_s: float | None = None
    """Explicit SLO (seconds after arrival); None: the class target."""

    @property
    def service_s(self) -> float:
        return self.chunks * self.units_per_chunk * self.s_per_unit


# Per-step H100 figures of the step-cost table (= the policy's cost priors): a chunk is one
# denoising step, or one decode chunk of K tokens (K = 8 interactive, 4 realtime).
MIX: tuple[Shape, ...] = (
    Shape("thumbnail-256", 0.40, SloClass.REALTIME, JobKind.IMAGE, "image-256", 50, 1, 0.010, 1),
    Shape("image-512", 0.30, SloClass.INTERACTIVE, JobKind.IMAGE, "image-512", 20, 1, 0.03, 2),
    Shape("chat-128tok", 0.20, SloClass.INTERACTIVE, JobKind.TEXT, "text", 16, 8, 0.006, 8),
    Shape("image-1024", 0.08, SloClass.BATCH, JobKind.IMAGE, "image-1024", 28, 1, 0.23, 2),
    Shape("video-480p", 0.02, SloClass.BATCH, JobKind.VIDEO, "video-480p", 50, 1, 1.3, 4,
          deadline_s=300.0),
)
URGENT = Shape("urgent-text", 0.0, SloClass.REALTIME, JobKind.TEXT, "text", 1, 4, 0.006, 4,
               deadline_s=0.08)
"""The stress test's urgent job: a 4-token reply (~24 ms) due within 80 ms."""


DEFAULT_HOP_S = 0.003
"""The overhead the simulator charges a chunk unless told otherwise: a hop measured on a quiet
machine (``tests/bench/bench_hop.py``)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run; times in virtual seconds."""

    workers: int = 16
    rate_per_s: float = 10.0
    duration_s: float = 60.0
    """Arrivals stop here; the run goes on for ``drain_s`` so queued work can finish."""
    drain_s: float = 30.0
    seed: int = 1
    dispatch_overhead_s: float = DEFAULT_HOP_S
    """Per hop: finish, publish the next chunk, a worker picks it up (unix socket ~2 ms, TCP
    3-5 ms)."""
    jitter: float = 0.1
    """Each chunk's duration is its prior × U(1 - jitter, 1 + jitter)."""
    tick_s: float = 0.1
    urgent_share: float = 0.0
    """Share of arrivals replaced by urgent (< 100 ms SLO) jobs."""
    fail_at_s: float | None = None
    """One busy worker dies here: its chunk is lost; its job resumes from its checkpoint once
    the chunk lease (and heartbeat) lapse."""
    lease_s: float = 10.0
    gold_share: float = 0.3
    bursty: bool = False
    """On/off modulated Poisson arrivals (``Arrivals(process="bursty")``: bursts at 4× the
    rate, then a lull) at the same mean rate; otherwise plain Poisson."""
    residency: ResidencyConfig | None = None
    """Model residency and placement (``app.bench.sim_residency``): applies only to a trace
    whose jobs name models; None or a single-model trace runs as if every model were held."""

    @classmethod
    def stress(cls, workers: int = 256, rate_per_s: float = 1000.0,
               duration_s: float = 60.0, **overrides: Any) -> SimConfig:
        """The reference stress test: mixed load, urgent jobs injected at random, a worker
        failing mid-run."""
        return cls(workers=workers, rate_per_s=rate_per_s, duration_s=duration_s,
                   urgent_share=0.05, fail_at_s=duration_s / 2, **overrides)

    @property
    def end_s(self) -> float:
        return self.duration_s + self.drain_s


@dataclass(frozen=True, slots=True)
class SimArrival:
    """One job of the trace, with its true chunk durations (the policies see only estimates)."""

    index: int
    arrival_s: float
    shape: Shape
    tier: Tier
    chunk_s: tuple[float, ...]
    deadline_s: float
    """Absolute, on the trace's clock: the job's own, or its shape's SLO after arrival."""
    model: str | None = None
    """The base model its chunks need resident (None: the single-model mix)."""
    adapters: tuple[str, ...] = ()
    tenant: str | None = None
    """Its tenant (None: ``acme`` for a gold job, ``hobbyist`` for a standard one)."""
    min_steps: int | None = None
    """Its quality floor (``JobSpec.quality_floor``): under overload it may run as few chunks
    (each chunk is a step); None: never degraded."""

    @property
    def group(self) -> str:
        return "urgent" if self.shape is URGENT else self.shape.slo.value


def generate_trace(config: SimConfig) -> list[SimArrival]:
    """Arrivals of the mix (and urgent jobs), seeded: every policy sees the same jobs."""
    rng = random.Random(config.seed)
    weights = [s.share for s in MIX]
    trace: list[SimArrival] = []
    for t in _arrival_instants(config, rng):
        urgent = rng.random() < config.urgent_share
        shape = URGENT if urgent else rng.choices(MIX, weights)[0]
        tier = Tier.GOLD if rng.random() < config.gold_share else Tier.STANDARD
        base_s = shape.units_per_chunk * shape.s_per_unit
        chunk_s = tuple(base_s * (1.0 + config.jitter * (2.0 * rng.random() - 1.0))
                        for _ in range(shape.chunks))
        budget_s = shape.deadline_s or CLASS_TARGET_S[shape.slo]
        trace.append(SimArrival(len(trace), t, shape, tier, chunk_s, t + budget_s))
    return trace


def _arrival_instants(config: SimConfig, rng: random.Random) -> Iterator[float]:
    """Poisson gaps drawn lazily from ``rng`` (between the draws of each job), or the whole
    bursty process up front."""
    if config.bursty:
        yield from arrival_times(rng, Arrivals(process="bursty"), config.rate_per_s,
                                 config.duration_s)
        return
    t = 0.0
    while (t := t + rng.expovariate(config.rate_per_s)) < config.duration_s:
        yield t


def mix_mean_service_s(urgent_share: float = 0.0) -> float:
    """E[service] of an arrival of the mix with ``urgent_share`` of urgent jobs."""
    total = sum(s.share for s in MIX)
    mean_s = sum(s.share * s.service_s for s in MIX) / total
    return (1 - urgent_share) * mean_s + urgent_share * URGENT.service_s


def offered_load(config: SimConfig) -> float:
    """ρ = λ · E[service] / workers for the configured mix."""
    return config.rate_per_s * mix_mean_service_s(config.urgent_share) / config.workers


# -- the simulated cluster ---------------------------------------------------------------------

class _Job:
    """A job's record in the simulated store (what Redis holds for a real one)."""

    __slots__ = (
        "arrival",
        "atomic",
        "epoch",
        "finished_s",
        "first_estimate_s",
        "groups_done",
        "id",
        "idle_holder",
        "lease_until_s",
        "level",
        "level_service_s",
        "load_s",
        "model_left",
        "next_chunk",
        "parked_on",
        "parked_q",
        "preempt",
        "preemptions",
        "queue",
        "reload_s",
        "running_on",
        "service_s",
        "started_warm",
        "state",
        "units_left",
        "view",
        "waiting_since_s",
    )

    def __init__(self, arrival: SimArrival) -> None:
        self.arrival = arrival
        self.id = f"j{arrival.index}"
        self.state = JobState.PENDING
        self.queue: str | None = None
        self.running_on: str | None = None
        self.next_chunk = 0
        self.groups_done = 0
        self.service_s = 0.0
        self.waiting_since_s = arrival.arrival_s
        self.preemptions = 0
        self.level: int | None = None
        self.level_service_s = 0.0
        self.preempt = False
        self.epoch = 0
        self.atomic = False
        self.finished_s: float | None = None
        self.first_estimate_s: float | None = None
        self.lease_until_s: float | None = None
        """Set when the worker running it dies: its lease lapses then (a live worker renews)."""
        self.view: JobView | None = None
        self.units_left = arrival.shape.chunks * arrival.shape.units_per_chunk
        self.parked_on: str | None = None
        """The worker whose own queue holds its next chunk (a hop, or a placement)."""
        self.parked_q: str | None = None
        """That queue (None: its class queue, or whichever queue ``queue`` names)."""
        self.load_s = 0.0
        """The load the planner is told to expect before its next chunk (``JobView.load_s``)."""
        self.reload_s = 0.0
        """The load a worker not holding its model would pay (``JobView.reload_s``)."""
        self.model_left = False
        """Parked on the own queue of a worker that evicted its model (``JobView.model_left``)."""
        self.idle_holder = False
        """Parked on a busy worker while an idle one holds its model (``JobView.idle_holder``)."""
        self.started_warm: bool | None = None
        """Whether its first chunk started on a worker holding its base (None: not started)."""

    def job_view(self) -> JobView:
        if self.view is None:
            a, shape = self.arrival, self.arrival.shape
            self.view = JobView(
                job_id=self.id, tenant=a.tenant or ("acme" if a.tier is Tier.GOLD
                                                    else "hobbyist"),
                tier=a.tier, slo_class=shape.slo, kind=shape.kind, state=self.state,
                submitted_at_s=a.arrival_s, deadline_s=a.deadline_s, cost_key=shape.cost_key,
                num_chunks=shape.chunks, next_chunk=self.next_chunk,
                remaining_cost_units=self.units_left, queue=self.queue,
                next_chunk_cost_units=shape.units_per_chunk if self.units_left > 0 else 0.0,
                block_groups=shape.block_groups,
                running_on=self.running_on, service_s=self.service_s,
                waiting_since_s=self.waiting_since_s, preemptions=self.preemptions,
                resource_profile=ResourceProfile.MEMORY if shape.kind is JobKind.TEXT
                else ResourceProfile.COMPUTE,
                level=self.level, level_service_s=self.level_service_s,
                preempt_requested=self.preempt, epoch=self.epoch,
                estimated=self.first_estimate_s is not None,
                lease_until_s=self.lease_until_s, parked_on=self.parked_on,
                load_s=self.load_s, reload_s=self.reload_s, model_left=self.model_left,
                idle_holder=self.idle_holder,
            )
        return self.view


class _Worker:
    """One worker process: consumes its queues in order, one chunk (or atomic job) at a time."""

    __slots__ = (
        "alive",
        "busy_s",
        "consumes",
        "dead_until_s",
        "job",
        "load_s",
        "loads",
        "mem",
        "name",
        "overhead_s",
        "queues",
        "run_start_s",
        "start_groups",
        "stop_groups",
        "token",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.queues: tuple[str, ...] = NORMAL_WORKER_QUEUES
        self.alive = True
        self.job: _Job | None = None
        self.token = 0
        self.run_start_s = 0.0
        self.start_groups = 0
        self.stop_groups = 0
        self.busy_s = 0.0
        self.overhead_s = 0.0
        self.dead_until_s = math.inf
        """After a failure: its heartbeat (and its job's lease) lapse at this time."""
        self.consumes: tuple[str, ...] = self.queues
        """The queues it reads, in order: ``queues``, with its own queue before each class
        that has one when residency is modelled."""
        self.mem: WorkerMemory | None = None
        self.load_s = 0.0
        """Seconds spent loading models (not counted in ``busy_s``)."""
        self.loads: deque[tuple[float, float]] = deque()
        """Its loads that may still fall in the policy's load window, as (end, seconds): what
        a live worker's heartbeat reports of its recent loads."""


_ARRIVE, _TICK, _WAKE, _END, _FAIL, _STAGED = range(6)


@dataclass
class SimResult:
    """Per-job outcomes and the run's counters."""

    finished_s: list[float | None]
    status: list[str]
    busy_s: float
    overhead_s: float
    lost_s: float
    capacity_s: float
    tick_ms: list[float] = field(default_factory=list)
    tick_jobs: list[int] = field(default_factory=list)
    preemptions: int = 0
    lost_jobs: list[int] = field(default_factory=list)
    """Jobs whose running chunk died with the failed worker."""
    wall_s: float = 0.0
    first_estimates_s: list[float | None] = field(default_factory=list)
    """Each job's first whole-service-time estimate from the policy (None: never made)."""
    residency: dict[str, Any] | None = None
    """Loads, load seconds, warm starts and peak bytes when residency is modelled."""
    moves: dict[str, int] = field(default_factory=dict)
    """How the plans moved jobs (``ClusterSim.moves``)."""
    served_s: dict[str, float] = field(default_factory=dict)
    """Worker-seconds each tenant's chunks ran while arrivals lasted (the fairness bench)."""
    reasons: dict[int, str] = field(default_factory=dict)
    """Per job shed at submit, expired or parked by overload, the last reason it was given
    (what its events would say)."""
    degraded: dict[int, int] = field(default_factory=dict)
    """Per job admission degraded, the steps it ran (``scheduler.degradation``)."""


class ClusterSim:
    """The adapter, the queues and the workers on a virtual clock (one policy, one trace)."""

    def __init__(self, config: SimConfig, trace: Sequence[SimArrival], policy: PolicyConfig,
                 check_invariants: bool = False) -> None:
        self.config, self.trace, self.policy = config, trace, policy
        self.check_invariants = check_invariants
        self.kind = policy.policy
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.workers = [_Worker(f"w{k:03d}") for k in range(config.workers)]
        self.by_name = {w.name: w for w in self.workers}
        self.idle: dict[str, _Worker] = {w.name: w for w in self.workers}
        self.queues: dict[str, deque[tuple[_Job, int]]] = {
            q: deque() for q in NORMAL_WORKER_QUEUES}
        self.jobs = [_Job(a) for a in trace]
        self.live: dict[str, _Job] = {}
        self.state = PolicyState()
        self.admission: AdmissionStatus | None = None
        self.cost = policy.new_cost_model()
        self.status = ["unfinished"] * len(trace)
        self.lost_s = 0.0
        self.ticks = 0
        self.ledger = ServiceLedger()
        """The tenants' fair-share counters (``scheduler.fairness``): each chunk's measured
        seconds charged as it ends, the join rule applied each tick (what Redis keeps live)."""
        self.planner = IncrementalPlanner()
        """The live tick's planner, held across ticks (it reads only the views that changed:
        a job's view is rebuilt only when what it shows changes, as the live cache does)."""
        self.result = SimResult([None] * len(trace), self.status, 0.0, 0.0, 0.0, 0.0)
        res = config.residency
        self.res = res if res is not None and any(a.model for a in trace) else None
        self.estimates = LoadEstimates()
        self.demand: dict[str, int] = {}
        self.staging: set[tuple[str, str]] = set()
        self.counts = {"base_loads": 0, "host_loads": 0, "adapter_loads": 0, "staged": 0,
                       "first_starts": 0, "warm_starts": 0, "placed_on_worker": 0,
                       "parked_recovered": 0, "resume_loads": 0, "model_left": 0,
                       "idle_holder": 0}
        self.moves = {"flag_preempt": 0, "preempted": 0, "standby": 0, "requeue": 0,
                      "release": 0, "suspend": 0, "expire": 0}
        """How the plans moved jobs: each target call, and the preemptions taking effect."""
        self.ended = 0
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

    # -- event loop -------------------------------------------------------------------------

    def _push(self, at_s: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at_s, self.seq, kind, payload))

    def run(self) -> SimResult:
        started = time.perf_counter()
        for job in self.jobs:
            self._push(job.arrival.arrival_s, _ARRIVE, job)
        self._push(0.0, _TICK, None)
        if self.config.fail_at_s is not None:
            self._push(self.config.fail_at_s, _FAIL, None)
        end_s = self.config.end_s
        handlers = (self.arrive, self._tick, self._wake, self._end, self._fail, self._staged)
        while self.events:
            at_s, _, kind, payload = heapq.heappop(self.events)
            if at_s > end_s:
                break
            self.now = at_s
            handlers[kind](payload)
            if self.res is not None and self.ended == len(self.jobs):
                # with residency (a models trace) the run ends with its last job: the drain
                # is set by the longest deadline, and ticks of an empty cluster change nothing
                end_s = self.now
                break
        self.now = end_s
        return self._finish(time.perf_counter() - started)

    def _finish(self, wall_s: float) -> SimResult:
        r = self.result
        for w in self.workers:
            if w.job is not None and w.alive:  # count the part of the chunk run by the end
                w.busy_s += max(self.now - w.run_start_s, 0.0)
                w.load_s -= max(w.run_start_s - self.now, 0.0)  # a load under way at the end
        r.busy_s = sum(w.busy_s for w in self.workers)
        r.overhead_s = sum(w.overhead_s for w in self.workers)
        r.lost_s = self.lost_s
        fail_s = self.config.fail_at_s
        lost_worker_s = self.now - fail_s if fail_s is not None and fail_s < self.now else 0.0
        r.capacity_s = len(self.workers) * self.now - lost_worker_s
        r.preemptions = sum(j.preemptions for j in self.jobs)
        r.first_estimates_s = [j.first_estimate_s for j in self.jobs]
        r.wall_s = wall_s
        r.moves = dict(self.moves)
        if self.res is not None:
            r.residency = {
                **self.counts, "load_s": sum(w.load_s for w in self.workers),
                "evictions": sum(w.mem.evictions for w in self.workers if w.mem),
                "peak_device_bytes": max(w.mem.peak_device_bytes for w in self.workers
                                         if w.mem),
                "device_budget_bytes": self.res.device_budget_bytes,
                "per_job": {**self.per_job, "started_warm": [j.started_warm for j in self.jobs]},
            }
        return r

    # -- submission (JobService.submit) -----------------------------------------------------

    def arrive(self, job: _Job) -> SubmitDecision:
        """The job is submitted now: the live submit path's own decision
        (:func:`scheduler.decide_submit`), applied to the simulated store."""
        self.live[job.id] = job
        degraded = self._degrade(job)
        decision = decide_submit(job.job_view(), self.policy, self.admission, self.now, degraded)
        job.atomic = decision.atomic
        if decision.action is SubmitAction.SHED:
            self.result.reasons[job.arrival.index] = decision.reason
            self._end_job(job, JobState.EXPIRED, "shed")
        elif decision.action is SubmitAction.SUSPEND:
            self.result.reasons[job.arrival.index] = decision.reason
            self._set_state(job, JobState.SUSPENDED)
        elif decision.action is SubmitAction.RELEASE:
            self._place(job, decision.queue)
        return decision

    def _degrade(self, job: _Job) -> Degradation | None:
        """The live submit path's degradation (:func:`scheduler.degradation.choose_steps` on a
        fresh admission status, the job priced by the cost model): its arrival cut to the
        chosen steps, its reason kept as its first event's."""
        a, status = job.arrival, self.admission
        if a.min_steps is None or status is None \
                or self.now - status.measured_at_s > self.policy.admission_status_ttl_s:
            return None
        shape = a.shape
        step_s = shape.units_per_chunk * self.cost.seconds_per_unit(shape.cost_key, "cuda")
        ladder = QualityLadder(full_steps=shape.chunks, min_steps=min(a.min_steps, shape.chunks),
                               step_s=step_s)
        chosen = choose_steps(ladder, a.deadline_s - self.now, status.load, self.policy)
        if chosen is None:
            return None
        job.arrival = replace(a, shape=replace(shape, chunks=chosen.steps),
                              chunk_s=a.chunk_s[:chosen.steps])
        job.units_left = chosen.steps * shape.units_per_chunk
        job.view = None
        self.result.degraded[a.index] = chosen.steps
        self.result.reasons[a.index] = chosen.reason
        return chosen

    # -- queues and workers -----------------------------------------------------------------

    def _set_state(self, job: _Job, state: JobState) -> None:
        job.state = state
        job.view = None

    def _publish(self, job: _Job, queue: str) -> None:
        self.queues[queue].append((job, job.epoch))
        for w in self.idle.values():
            if queue in w.consumes:
                del self.idle[w.name]
                self._wake(w)
                return

    def _release(self, job: _Job, queue: str, bump_epoch: bool = False,
                 parked_on: str | None = None, placed: bool = False) -> None:
        """``tasks.dispatch.release``: QUEUED on ``queue`` (or on ``parked_on``'s own queue
        for that class; ``placed``: its placement queue), flag cleared, chunk published."""
        job.epoch += 1 if bump_epoch else 0
        job.state, job.queue, job.preempt = JobState.QUEUED, queue, False
        job.parked_on = parked_on
        job.parked_q = None if parked_on is None else placed_queue(parked_on, queue) \
            if placed else affinity_queue(parked_on, queue)
        job.waiting_since_s = self.now
        job.view = None
        self._publish(job, job.parked_q or queue)

    def _place(self, job: _Job, queue: str, bump_epoch: bool = False) -> None:
        """A release: with residency, :func:`scheduler.placement.place` chooses the worker whose
        own queue takes the chunk (None: the class queue), as the live release path does."""
        model = job.arrival.model
        if self.res is None or model is None or queue not in AFFINITY_CLASSES:
            self._release(job, queue, bump_epoch)
            return
        need = self._need(job)
        workers = self._holdings(queue, need)
        placement = place(need, workers, self.estimates, self.res.placement, self.demand,
                          slack_s(job.arrival.deadline_s, self.now, self._remaining_est_s(job)))
        if placement.worker is not None:
            self.counts["placed_on_worker"] += 1
        self._release(job, queue, bump_epoch, parked_on=placement.worker, placed=True)

    def _need(self, job: _Job) -> ModelNeed:
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

    def _remaining_est_s(self, job: _Job) -> float:
        """The job's remaining work as the cost model estimates it (what a live placement
        reads from the job's record), plus a hop per chunk."""
        key = job.arrival.shape.cost_key
        chunks_left = job.arrival.shape.chunks - job.next_chunk
        return (job.units_left * self.cost.seconds_per_unit(key, "cuda")
                + chunks_left * self.config.dispatch_overhead_s)

    def _wake(self, w: _Worker) -> None:
        """The worker takes the first message its queues offer, in their order."""
        if not w.alive or w.job is not None:
            return
        for q in w.consumes:
            pending = self.queues[q]
            if pending:
                job, epoch = pending.popleft()
                if epoch == job.epoch and job.state is JobState.QUEUED \
                        and q == (job.parked_q or job.queue):
                    self._claim(w, job)
                else:  # a fenced (stale) message: one hop's overhead for nothing
                    w.overhead_s += self.config.dispatch_overhead_s
                    self._push(self.now + self.config.dispatch_overhead_s, _WAKE, w)
                return
        self.idle[w.name] = w

    def _claim(self, w: _Worker, job: _Job) -> None:
        overhead_s = self.config.dispatch_overhead_s
        w.overhead_s += overhead_s
        start_s = self.now + overhead_s
        if job.preempt:  # flagged while queued: yields at claim, having run nothing
            self._push(start_s, _WAKE, w)
            self._preempted(job, start_s)
            return
        job.state, job.running_on, job.parked_on = JobState.RUNNING, w.name, None
        job.parked_q = None
        job.view = None
        if w.mem is not None and job.arrival.model is not None:
            load_s = self._load(w, job)
            if load_s > 0.0:
                w.loads.append((start_s + load_s, load_s))
            start_s += load_s
        w.job, w.run_start_s, w.start_groups = job, start_s, job.groups_done
        w.token += 1
        if job.atomic:
            end_s = start_s + sum(job.arrival.chunk_s[job.next_chunk:]) - self._group_s(
                job) * job.groups_done
            w.stop_groups = -1
        else:
            w.stop_groups = job.arrival.shape.block_groups
            end_s = start_s + self._group_s(job) * (w.stop_groups - job.groups_done)
        self._push(end_s, _END, (w, w.token))

    def _load(self, w: _Worker, job: _Job) -> float:
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

    def _parked_models(self, w: _Worker) -> frozenset[str]:
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

    def _staged(self, payload: tuple[_Worker, str]) -> None:
        """A model read into a worker's host memory ahead of its jobs."""
        w, model = payload
        self.staging.discard((w.name, model))
        if w.alive and w.mem is not None and w.mem.stage(model, self.now):
            self.counts["staged"] += 1

    def _group_s(self, job: _Job) -> float:
        shape = job.arrival.shape
        return job.arrival.chunk_s[job.next_chunk] / shape.block_groups

    def _end(self, payload: tuple[_Worker, int]) -> None:
        w, token = payload
        if token != w.token or w.job is None or not w.alive:
            return
        job = w.job
        ran_s = self.now - w.run_start_s
        w.busy_s += ran_s
        w.job = None
        if job.state is JobState.RUNNING and job.running_on == w.name:
            job.service_s += ran_s
            self._charge(job, ran_s)
            job.running_on = None
            if w.stop_groups < 0:
                self._chunks_done(job, job.arrival.shape.chunks - job.next_chunk, w)
            elif w.stop_groups < job.arrival.shape.block_groups:
                job.groups_done = w.stop_groups
                self._preempted(job, self.now)
            else:
                if w.start_groups == 0:  # the chunk ran whole: the worker reports its time
                    shape = job.arrival.shape
                    self.cost = self.cost.observe(shape.cost_key, "cuda",
                                                  shape.units_per_chunk, ran_s)
                self._chunks_done(job, 1, w)
        self._wake(w)

    def _charge(self, job: _Job, seconds: float) -> None:
        """The commit's charge: measured seconds to the job's tenant in its class's band
        (and, while arrivals last, to its tenant's served seconds the report counts)."""
        view = job.job_view()
        if self.now <= self.config.duration_s:
            served = self.result.served_s
            served[view.tenant] = served.get(view.tenant, 0.0) + seconds
        if self.policy.fair_share.enabled:
            self.ledger = self.ledger.charged(view.slo_class.value, view.tenant,
                                              view.tier.value, seconds)

    def _chunks_done(self, job: _Job, count: int, w: _Worker | None = None) -> None:
        shape = job.arrival.shape
        job.next_chunk += count
        job.groups_done = 0
        job.units_left = (shape.chunks - job.next_chunk) * shape.units_per_chunk
        job.view = None
        if job.next_chunk >= shape.chunks:
            self._end_job(job, JobState.DONE, "done")
        elif job.preempt:
            self._preempted(job, self.now)
        else:  # hop: the next chunk goes to the back of the job's current queue
            job.state = JobState.QUEUED
            job.waiting_since_s = self.now
            queue = job.queue or CLASS_QUEUE[shape.slo]
            if w is not None and w.mem is not None and job.arrival.model is not None \
                    and affinity_queue(w.name, queue) in w.consumes:
                # with residency the next chunk stays where its model is: the worker's own queue
                job.parked_on = w.name
                queue = job.parked_q = affinity_queue(w.name, queue)
            self._publish(job, queue)

    def _preempted(self, job: _Job, at_s: float) -> None:
        job.state, job.preempt, job.running_on = JobState.PREEMPTED, False, None
        job.preemptions += 1
        self.moves["preempted"] += 1
        job.waiting_since_s = at_s
        job.view = None

    def _end_job(self, job: _Job, state: JobState, status: str) -> None:
        job.state, job.finished_s = state, self.now
        job.view = None
        if self.live.pop(job.id, None) is not None:
            self.ended += 1
        self.status[job.arrival.index] = status
        if state is JobState.DONE:
            self.result.finished_s[job.arrival.index] = self.now

    # -- failure and the lease watchdog -----------------------------------------------------

    def _fail(self, _: object) -> None:
        busy = [w for w in self.workers if w.alive and w.job is not None] or [
            w for w in self.workers if w.alive]
        if not busy:
            return
        w = random.Random(self.config.seed).choice(busy)
        w.alive = False
        w.dead_until_s = self.now + self.config.lease_s
        self.idle.pop(w.name, None)
        job = w.job
        if job is None:
            return
        ran_s = max(self.now - w.run_start_s, 0.0)
        if w.stop_groups < 0:  # atomic: the chunks it finished were checkpointed one by one
            kept = self._checkpointed_chunks(job, ran_s)
            job.service_s += kept
            self._charge(job, kept)
            ran_s -= kept
        w.busy_s += ran_s
        self.lost_s += ran_s
        job.lease_until_s, job.view = w.dead_until_s, None
        self.result.lost_jobs.append(job.arrival.index)

    def _checkpointed_chunks(self, job: _Job, ran_s: float) -> float:
        kept_s, chunks = 0.0, job.arrival.chunk_s
        while job.next_chunk < len(chunks) and kept_s + chunks[job.next_chunk] <= ran_s:
            kept_s += chunks[job.next_chunk]
            job.next_chunk += 1
        job.units_left = (len(chunks) - job.next_chunk) * job.arrival.shape.units_per_chunk
        job.view = None
        return kept_s

    # -- the tick (tasks/adapter.run_tick) --------------------------------------------------

    def _tick(self, _: object) -> None:
        self.ticks += 1
        self._push(self.ticks * self.config.tick_s, _TICK, None)
        if self.res is not None:
            self._residency_tick(self.res)
        snapshot = ClusterSnapshot(tuple(j.job_view() for j in self.live.values()),
                                   self._worker_views(), self.cost, self.state)
        started = time.perf_counter()
        if self.policy.fair_share.enabled:
            snapshot = replace(snapshot, service=self.ledger)
        plan = self.planner.plan(snapshot, self.policy, self.now)
        if plan.fair_share is not None:  # the join's lifts, active set and floors
            self.ledger = plan.fair_share.ledger
        self.result.tick_ms.append((time.perf_counter() - started) * 1e3)
        self.result.tick_jobs.append(len(snapshot.jobs))
        if self.check_invariants:
            check_plan_invariants(plan, snapshot, self.policy)
        apply_plan(plan, self)

    def _mark_moves(self, waiting: Sequence[_Job]) -> None:
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

    def _idle_holdings(self, waiting: Sequence[_Job]) -> dict[str, list[Holding]]:
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

    def _residency_tick(self, res: ResidencyConfig) -> None:
        """Before the plan: the queued demand per model; each waiting job's expected load
        (:func:`scheduler.placement.expected_load_s`, told to the planner as ``load_s``); and,
        under staging, the models to read into host memory (in the background: a read from
        disk into host memory does not hold the device)."""
        demand: dict[str, int] = {}
        waiting: list[_Job] = []
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
                self._push(self.now + w.mem.read_into_host_s(model), _STAGED, (w, model))

    def _worker_views(self) -> tuple[WorkerView, ...]:
        """The workers whose heartbeat is fresh, each with the loads of the policy's window."""
        since_s = self.now - self.policy.load_window_s
        for w in self.workers:
            while w.loads and w.loads[0][0] <= since_s:
                w.loads.popleft()
        return tuple(WorkerView(w.name, True, w.job.id if w.job is not None else None,
                                w.queues, "cuda", loads=tuple(w.loads))
                     for w in self.workers if w.alive or self.now < w.dead_until_s)

    # -- the plan's target (tasks.apply.TickTarget): the live tick's apply loop, in memory --

    def fail(self, failure: Failure) -> bool:
        job = self.live.get(failure.job_id)
        if job is not None:
            self._end_job(job, JobState.FAILED, "failed")
        return job is not None

    def recover(self, recovery: Recovery) -> bool:
        """A lapsed lease: the dead worker's job is requeued from its checkpoint."""
        job = self.live[recovery.job_id]
        dead = self.by_name.get(job.running_on or "")
        if dead is not None and dead.job is job:
            dead.job = None
        job.running_on, job.lease_until_s = None, None
        queue = CLASS_QUEUE[job.arrival.shape.slo] if job.queue is None else job.queue
        if recovery.cause in (RecoveryCause.MODEL_LEFT, RecoveryCause.IDLE_HOLDER):
            self.counts[recovery.cause.value] += 1  # placed anew, as a release
            job.model_left = job.idle_holder = False
            self._place(job, queue, bump_epoch=True)
            return True
        if job.parked_on is not None:
            self.counts["parked_recovered"] += 1
        self._release(job, queue, bump_epoch=True)
        return True

    def mark_level(self, job_id: str, mark: LevelMark) -> None:
        job = self.live[job_id]
        job.level, job.level_service_s, job.view = mark.level, mark.service_mark_s, None

    def expire(self, job_id: str, reason: str) -> bool:
        self.moves["expire"] += 1
        job = self.live[job_id]
        self.result.reasons[job.arrival.index] = reason
        self._end_job(job, JobState.EXPIRED, "expired")
        return True

    def suspend(self, job_id: str, reason: str) -> bool:
        self.moves["suspend"] += 1
        job = self.live[job_id]
        self.result.reasons[job.arrival.index] = reason
        self._set_state(job, JobState.SUSPENDED)
        return True

    def flag_preempt(self, job_id: str) -> bool:
        self.moves["flag_preempt"] += 1
        self._flag(self.live[job_id])
        return True

    def requeue(self, job_id: str, to_queue: str, reason: str) -> bool:
        """A queued chunk moved to ``to_queue`` (``tasks.affinity.requeue_queue``): it stays on
        the worker it is parked on, else it is placed like a release."""
        self.moves["requeue"] += 1
        job = self.live[job_id]
        keeps = self._keeps(job, to_queue)
        if keeps is None:
            self._place(job, to_queue, bump_epoch=True)
        else:
            self._release(job, to_queue, bump_epoch=True, parked_on=keeps,
                          placed=job.service_s == 0 and to_queue in AFFINITY_CLASSES)
        return True

    def _keeps(self, job: _Job, to_queue: str) -> str | None:
        """With residency, the worker a queued chunk moved to ``to_queue`` stays parked on: the
        one it is parked on, when that worker has its own queue for ``to_queue``."""
        w = self.by_name.get(job.parked_on or "")
        if w is None or w.mem is None or to_queue not in OWN_QUEUE_CLASSES \
                or affinity_queue(w.name, to_queue) not in w.consumes:
            return None
        return w.name

    def retarget(self, job_id: str, to_queue: str) -> bool:
        job = self.live[job_id]
        job.queue, job.view = to_queue, None
        return True

    def standby(self, job_id: str) -> bool:
        self.moves["standby"] += 1
        job = self.live[job_id]
        if job.state is JobState.QUEUED:
            self._release(job, STANDBY_QUEUE, bump_epoch=True,
                          parked_on=self._keeps(job, STANDBY_QUEUE))
        else:
            job.queue, job.view = STANDBY_QUEUE, None
        return True

    def release(self, job_id: str, queue: str, atomic: bool,
                estimate_s: float | None = None) -> bool:
        self.moves["release"] += 1
        job = self.live[job_id]
        job.atomic = job.atomic or atomic
        self._place(job, queue)
        return True

    def release_batch(self, batch_id: str, releases: Sequence[Release], join: bool) -> None:
        # The simulated cluster runs every job alone (its jobs carry no batch group, so the
        # policy forms no batch): a batch release is each job's own release.
        for rel in releases:
            self.release(rel.job_id, rel.queue, False, rel.estimate_s)

    def record_estimate(self, job_id: str, estimate_s: float) -> None:
        job = self.live[job_id]
        if job.first_estimate_s is None:
            job.first_estimate_s, job.view = estimate_s, None

    def set_worker_queues(self, wanted: Mapping[str, tuple[str, ...]]) -> None:
        for name, queues in wanted.items():
            w = self.by_name[name]
            if w.queues != queues:
                w.queues = queues
                w.consumes = queues if w.mem is None else with_affinity(name, queues)
                if w.alive and w.job is None:
                    self.idle.pop(name, None)
                    self._wake(w)

    def publish_decisions(self, plan: TickPlan) -> None:
        self.state, self.admission = plan.state, plan.admission

    def _flag(self, job: _Job) -> None:
        """Preempt flag: a running chunk stops at its next block-group boundary."""
        job.preempt, job.view = True, None
        w = self.by_name.get(job.running_on or "")
        if w is None or not w.alive or w.job is not job or w.stop_groups < 0:
            return
        group_s = self._group_s(job)
        # It checks the flag before each group but the first; the group under way completes.
        groups_run = max(math.ceil((self.now - w.run_start_s) / group_s - 1e-9), 1)
        stop = min(w.start_groups + groups_run, job.arrival.shape.block_groups)
        if stop < w.stop_groups:
            w.stop_groups = stop
            w.token += 1
            self._push(w.run_start_s + group_s * (stop - w.start_groups), _END, (w, w.token))

# -- runs and metrics --------------------------------------------------------------------------

def simulate_policy(config: SimConfig, trace: Sequence[SimArrival], policy: str) -> SimResult:
    """One policy (or oracle) on ``trace``."""
    if policy in ORACLES:
        return _oracle_result(config, trace, Discipline(policy.removeprefix("oracle-")))
    return ClusterSim(config, trace, sim_policy(config, policy)).run()


def sim_policy(config: SimConfig, policy: str) -> PolicyConfig:
    """The policy as an operator would configure it for this cluster: its measured hop cost
    and tick interval."""
    return PolicyConfig(policy=PolicyKind(policy), hop_overhead_s=config.dispatch_overhead_s,
                        tick_interval_s=config.tick_s)


def _oracle_result(config: SimConfig, trace: Sequence[SimArrival],
                   discipline: Discipline) -> SimResult:
    started = time.perf_counter()
    jobs = [OracleJob(a.arrival_s, sum(a.chunk_s), a.deadline_s) for a in trace]
    finished = run_oracle(jobs, config.workers, discipline, config.end_s, config.fail_at_s)
    status = ["done" if f is not None else "unfinished" for f in finished]
    busy_s = sum(min(j.size_s, config.end_s - j.arrival_s) for j in jobs)
    fail_s = config.fail_at_s
    capacity_s = config.workers * config.end_s - (
        config.end_s - fail_s if fail_s is not None else 0.0)
    return SimResult(finished, status, min(busy_s, capacity_s), 0.0, 0.0, capacity_s,
                     wall_s=time.perf_counter() - started)


def group_metrics(trace: Sequence[SimArrival], result: SimResult, duration_s: float,
                  end_s: float) -> dict[str, dict[str, Any]]:
    """Per report row: attainment (met ÷ submitted jobs due by the end of the run), latency
    quantiles of completed jobs, goodput (jobs meeting their SLO per second of arrivals) and
    what happened to the rest."""
    rows: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        picked = [a for a in trace if group == "all" or a.group == group]
        if not picked:
            continue
        lat = sorted(f - a.arrival_s for a in picked
                     if (f := result.finished_s[a.index]) is not None)
        met = sum(1 for a in picked if (f := result.finished_s[a.index]) is not None
                  and f <= a.deadline_s + 1e-9)
        counts = {s: sum(1 for a in picked if result.status[a.index] == s)
                  for s in ("shed", "expired", "unfinished")}
        # unfinished when the run ended but not yet due: neither met nor missed
        undecided = sum(1 for a in picked if result.status[a.index] == "unfinished"
                        and a.deadline_s > end_s)
        rows[group] = {
            "submitted": len(picked), "completed": len(lat), "met_slo": met,
            "undecided": undecided,
            "slo_attainment": met / max(len(picked) - undecided, 1),
            "p50_latency_s": percentile(lat, 50), "p95_latency_s": percentile(lat, 95),
            "p99_latency_s": percentile(lat, 99),
            "mean_latency_s": statistics.fmean(lat) if lat else None,
            "goodput_jobs_per_s": met / duration_s, **counts,
        }
    return rows


def estimate_error(config: SimConfig, trace: Sequence[SimArrival],
                   result: SimResult) -> dict[str, Any] | None:
    """|first estimate − true service| ÷ true service (chunk times plus one hop each) over the
    jobs the policy estimated: p50, p95 and how many."""
    hop_s = config.dispatch_overhead_s
    errors = sorted(abs(est - true_s) / true_s
                    for a, est in zip(trace, result.first_estimates_s, strict=False)
                    if est is not None and (true_s := sum(a.chunk_s) + len(a.chunk_s) * hop_s) > 0)
    if not errors:
        return None
    return {"jobs": len(errors), "p50": percentile(errors, 50), "p95": percentile(errors, 95)}


def _tick_stats(result: SimResult) -> dict[str, Any] | None:
    if not result.tick_ms:
        return None
    ordered = sorted(result.tick_ms)
    return {"ticks": len(ordered), "p50_ms": percentile(ordered, 50),
            "p99_ms": percentile(ordered, 99), "max_ms": ordered[-1],
            "mean_ms": statistics.fmean(ordered), "max_jobs_in_snapshot": max(result.tick_jobs)}


def policy_report(config: SimConfig, trace: Sequence[SimArrival],
                  result: SimResult) -> dict[str, Any]:
    capacity_s = max(result.capacity_s, 1e-9)
    return {
        "simulated": True,
        "groups": group_metrics(trace, result, config.duration_s, config.end_s),
        "utilisation": result.busy_s / capacity_s,
        "dispatch_overhead_share": result.overhead_s / capacity_s,
        "lost_work_s": result.lost_s,
        "preemptions": result.preemptions,
        "plan_tick": _tick_stats(result),
        "estimate_error": estimate_error(config, trace, result),
        "wall_s": result.wall_s,
    }


def run_config(config: SimConfig, policies: Sequence[str]) -> dict[str, Any]:
    """Every policy on one seeded trace."""
    trace = generate_trace(config)
    jobs = [OracleJob(a.arrival_s, sum(a.chunk_s), a.deadline_s) for a in trace]
    return {
        "simulated": True,
        "note": NOTE,
        "workers": config.workers, "rate_per_s": config.rate_per_s,
        "duration_s": config.duration_s, "drain_s": config.drain_s, "seed": config.seed,
        "stress": config.urgent_share > 0 or config.fail_at_s is not None,
        "urgent_share": config.urgent_share, "fail_at_s": config.fail_at_s,
        "dispatch_overhead_ms": config.dispatch_overhead_s * 1e3, "jitter": config.jitter,
        "jobs": len(trace), "offered_load": offered_load(config),
        "mean_latency_lower_bound_s": mean_response_lower_bound_s(jobs, config.workers),
        "policies": {p: policy_report(config, trace, simulate_policy(config, trace, p))
                     for p in policies},
    }


def check_policies(policies: Sequence[str]) -> None:
    """Raise ValueError naming any policy the simulation does not know."""
    unknown = set(policies) - set(ALL_POLICIES)
    if unknown or not policies:
        raise ValueError(f"unknown policies {sorted(unknown)}; use {', '.join(ALL_POLICIES)}")


def run_simulation(configs: Sequence[SimConfig], policies: Sequence[str]) -> dict[str, Any]:
    """The whole study, as written to ``simulation.json``."""
    check_policies(policies)
    return {
        "simulated": True,
        "note": NOTE,
        "oracles": ("clairvoyant preemptive global EDF / SRPT on the same workers: exact sizes, "
                    "preemption and migration at any instant (not only at step boundaries), "
                    "no dispatch overhead, no tick delay, no work lost on failure. Not a "
                    "theorem-grade bound for several workers; mean_latency_lower_bound_s "
                    "(SRPT on one worker N times as fast) is one for mean latency"),
        "mix": [{"name": s.name, "share": s.share, "class": s.slo.value, "chunks": s.chunks,
                 "chunk_s": s.units_per_chunk * s.s_per_unit, "block_groups": s.block_groups,
                 "service_s": s.service_s,
                 "slo_s": s.deadline_s or CLASS_TARGET_S[s.slo]} for s in (*MIX, URGENT)],
        "runs": [run_config(c, policies) for c in configs],
    }


def grid_configs(workers: Sequence[int], rates: Sequence[float], duration_s: float,
                 stress: bool, seed: int = 1, **overrides: Any) -> list[SimConfig]:
    """One config per (workers, rate); ``stress`` adds urgent jobs and a worker failure."""
    make = SimConfig.stress if stress else SimConfig
    return [make(workers=w, rate_per_s=r, duration_s=duration_s, seed=seed, **overrides)
            for w in workers for r in rates]


def summary_table(run: dict[str, Any]) -> Any:
    """A rich table of one run: per policy and report row, attainment, latency, goodput."""
    from rich.table import Table

    stress = " stress (urgent < 100 ms, a worker fails)" if run["stress"] else ""
    table = Table("policy", "class", "jobs", "SLO met", "p50 s", "p95 s", "p99 s", "goodput/s",
                  "util", "tick p50/p99 ms",
                  title=f"SIMULATED: {run['workers']} workers, {run['rate_per_s']:g} jobs/s, "
                        f"offered load {run['offered_load']:.2f}{stress}")
    for name, rep in run["policies"].items():
        tick = rep["plan_tick"]
        ticks = f"{tick['p50_ms']:.1f}/{tick['p99_ms']:.1f}" if tick else "-"
        rows = list(rep["groups"].items())
        for k, (group, g) in enumerate(rows):
            table.add_row(name, group, str(g["submitted"]), f"{100 * g['slo_attainment']:.1f}%",
                          *(_fmt(g[q]) for q in ("p50_latency_s", "p95_latency_s",
                                                 "p99_latency_s")),
                          f"{g['goodput_jobs_per_s']:.1f}",
                          f"{rep['utilisation']:.2f}" if group == "all" else "",
                          ticks if group == "all" else "", end_section=k == len(rows) - 1)
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
