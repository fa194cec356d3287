"""What the policy sees each tick: one view per job and per worker, gathered in a snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.cost import CostModel
from scheduler.errors import InvalidSnapshot
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


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything ``plan_tick`` reads. Terminal jobs may be present; they are ignored."""

    jobs: tuple[JobView, ...]
    workers: tuple[WorkerView, ...]
    cost: CostModel
    state: PolicyState
