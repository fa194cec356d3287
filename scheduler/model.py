"""What the policy sees each tick: one view per job and per worker, gathered in a snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.cost import CostModel
from scheduler.errors import InvalidSnapshot
from scheduler.fairness import ServiceLedger
from scheduler.lifecycle import JobState, SloClass
from scheduler.queues import LOWEST_LEVEL as _LOWEST_LEVEL
from scheduler.state import PolicyState


class Tier(str, Enum):
    """The tenant's commercial tier."""

    GOLD = "gold"
    """Key customer: scores higher and is never shed by admission."""
    STANDARD = "standard"
    """Everyone else."""


class JobKind(str, Enum):
    """What the job generates; it sets how visible an SLO miss is."""

    SIMULATED = "simulated"
    IMAGE = "image"
    VIDEO = "video"
    TEXT = "text"


class ResourceProfile(str, Enum):
    """What bounds the job's steps on the device."""

    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class JobView:
    """One live job as the store sees it at snapshot time. Times share the clock of ``now_s``."""

    job_id: str
    tenant: str
    tier: Tier
    slo_class: SloClass
    kind: JobKind
    state: JobState
    submitted_at_s: float
    """Arrival time; it orders jobs and is kept across preemptions (a job keeps its place)."""
    deadline_s: float
    """Absolute deadline (submit time + class target unless the client gave one)."""
    cost_key: str
    """Key of the cost model (model, shape); priors match it by prefix."""
    num_chunks: int
    next_chunk: int
    """Chunks done so far."""
    remaining_cost_units: float
    """Relative cost of the chunks still to run, as the runner reports it."""
    remaining_units_by_key: tuple[tuple[str, float], ...] = ()
    """The same units split by chunk-kind cost key (``dit-tiny:256x256#denoise``), each kind
    estimated on its own; empty: all of them under ``cost_key``."""
    block_groups: int = 1
    """Block groups per chunk: a preempted chunk stops at the next group boundary, so the
    worker is free again within one group's time."""
    queue: str | None = None
    """Queue the job's current (or next) chunk is on; None before its first release."""
    running_on: str | None = None
    service_s: float = 0.0
    """Worker seconds consumed so far."""
    waiting_since_s: float = 0.0
    """When the job last began waiting: submit, release, chunk hop or preemption."""
    preemptions: int = 0
    resource_profile: ResourceProfile = ResourceProfile.COMPUTE
    depends_on: tuple[str, ...] = ()
    """Jobs this one waits for; a dependency absent from the snapshot counts as finished."""
    level: int | None = None
    """MLFQ level from the plan's ``levels`` (None until first placed)."""
    level_service_s: float = 0.0
    """``service_s`` when the job entered ``level``; the quantum used is the difference."""
    preempt_requested: bool = False
    """A preempt flag is set and the job has not stopped yet."""
    estimated: bool = False
    """The job's first estimate of its whole service time is on record already."""
    shed_if_late: bool = False
    """Under overload, expire the job once it cannot meet its deadline; otherwise it is
    demoted to the lowest level, behind the work that still can."""
    # facts for recovery (scheduler/recovery.py)
    epoch: int = 0
    lease_until_s: float | None = None
    """A RUNNING job's chunk lease; its worker's heartbeat renews it."""
    chunk_running_since_s: float | None = None
    """When the running chunk began: its claim or the last commit, whichever is later."""
    stuck_requeues: int = 0
    next_chunk_cost_units: float = 0.0
    own_s_per_unit: float | None = None
    """The job's own median seconds per cost unit over its commits (None: too few, or not
    gathered because its chunk is not long-running)."""
    parked_on: str | None = None
    """The worker whose own (affinity or placement) queue holds the job's next chunk."""
    reload_s: float = 0.0
    """Seconds a worker that does not hold the job's model would spend loading it (0: the job
    runs on no model). A chunk parked on a busy worker holding its model waits at least this
    long before it moves to its class queue: until then, waiting costs less than the load."""
    model_left: bool = False
    """Its next chunk waits on the own queue of the worker that ran its last one, and that
    worker no longer holds its base model on its device (evicted for another job's): a chunk
    there would load it again, so its stay there has lost its reason (the tick places it anew:
    :data:`scheduler.recovery.RecoveryCause.MODEL_LEFT`)."""
    idle_holder: bool = False
    """Its next chunk waits on the own queue of a worker busy with another job's chunk, while
    a worker that is idle, with nothing parked on it, holds its base model and adapters on its
    device: there it would start at once with no load, so its stay has lost its reason (the
    tick places it anew: :data:`scheduler.recovery.RecoveryCause.IDLE_HOLDER`;
    :func:`scheduler.placement.idle_holders` gives each idle worker to one job)."""
    load_s: float = 0.0
    """Seconds of model loading expected before the job's next chunk can run (no worker holds
    its base model or adapters: ``scheduler.placement.expected_load_s``); counted into its
    remaining time, so deadlines, lateness and admission see a cold start. 0: it is warm."""
    published: tuple[int, int] | None = None
    """(chunk, epoch) of the last chunk message published for the job; (-1, -1) when none was;
    None when not known (then the job is never judged unpublished)."""
    failed_dependency: str | None = None
    """Why a dependency can never let this job run (it failed, was cancelled or expired)."""
    batch_group: str | None = None
    """Jobs of one group (model and shape) may run as one batched forward per step; None: the
    job always runs alone (an exact job, or a kind that does not batch)."""
    batch_id: str | None = None
    """The batch the job's current (or next) chunk runs in, if any."""
    batch_growth: float | None = None
    """The job's own batched-step growth (a simulated job declares it); None: the policy's
    table by cost key."""

    def __post_init__(self) -> None:
        if self.num_chunks < 1 or not 0 <= self.next_chunk <= self.num_chunks:
            raise InvalidSnapshot(
                f"job {self.job_id}: next_chunk {self.next_chunk} outside 0..{self.num_chunks}; "
                "num_chunks must be >= 1"
            )
        if self.remaining_cost_units < 0 or self.service_s < 0 or self.preemptions < 0:
            raise InvalidSnapshot(
                f"job {self.job_id}: remaining_cost_units, service_s and preemptions must be >= 0"
            )
        if self.level is not None and not 0 <= self.level <= _LOWEST_LEVEL:
            raise InvalidSnapshot(
                f"job {self.job_id}: level {self.level} outside 0..{_LOWEST_LEVEL}"
            )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker process (one device) as its heartbeat describes it."""

    name: str
    alive: bool
    """Heartbeat fresh; dead workers get no queues and count for nothing."""
    busy_job: str | None = None
    queues: tuple[str, ...] = ()
    """Queues it consumes now, in order."""
    device: str = "cpu"
    idle_since_s: float | None = None
    """Since when it has been idle consuming ``queues`` (None: busy, warming, or not said)."""
    seen_at_s: float | None = None
    """When its heartbeat was written (None: not said)."""
    loads: tuple[tuple[float, float], ...] = ()
    """Its recent model loads that held its device, as (end, seconds) on the snapshot's clock
    (an end after now: under way); the effective load counts the time they took
    (``scheduler.admission.paid_load_share``)."""

    def idle_over_s(self, since_s: float) -> float:
        """How long, up to its heartbeat, it has been idle consuming ``queues`` since
        ``since_s`` (0: busy or not known): a message on one of them since ``since_s`` would
        have been taken within a hop, so one still waiting after that long is not on them —
        another consumer holds it (:class:`~scheduler.recovery.RecoveryCause` ``UNCLAIMED``)."""
        if not self.alive or self.busy_job is not None or self.idle_since_s is None \
                or self.seen_at_s is None:
            return 0.0
        return max(0.0, self.seen_at_s - max(self.idle_since_s, since_s))


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything ``plan_tick`` reads. Terminal jobs may be present; they are ignored."""

    jobs: tuple[JobView, ...]
    workers: tuple[WorkerView, ...]
    cost: CostModel
    state: PolicyState
    unreadable: tuple[tuple[str, str], ...] = ()
    """(job id, problem) of each live record the store could not parse."""
    service: ServiceLedger | None = None
    """The tenants' fair-share counters (``scheduler.fairness``), joined for this tick; None:
    every tenant at zero."""
