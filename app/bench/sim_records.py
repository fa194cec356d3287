"""The simulated cluster's records: a job's (what Redis holds for a real one), a worker's (its
queues, its current chunk, its memory) and a run's outcomes (:class:`SimResult`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from app.bench.sim_residency import WorkerMemory
from app.bench.sim_workload import SimArrival
from scheduler import JobKind, JobState, JobView, ResourceProfile, Tier
from scheduler.queues import NORMAL_WORKER_QUEUES


class SimJob:
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


class SimWorker:
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
        self.job: SimJob | None = None
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
    level_share: dict[int, float] = field(default_factory=dict)
    """Per degraded job, its level's predicted work over full quality's."""
