"""One tick's decision as values: the ``TickPlan``, its actions (release, requeue, retarget,
expiry, level marks) and the admission status it publishes for the submit path. ``tasks.apply``
applies a plan, to the live stack or to the simulator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.fairness import Joined
from scheduler.policy import PolicyKind
from scheduler.recovery import Failure, Recovery
from scheduler.state import AdmissionState, PolicyState


@dataclass(frozen=True, slots=True)
class Release:
    """Publish the job's next chunk to ``queue`` (PENDING / PREEMPTED / SUSPENDED → QUEUED)."""

    job_id: str
    queue: str
    estimate_s: float | None = field(default=None, compare=False)
    """The policy's estimate of the job's whole service time (recorded at its first release,
    so the bench can report the cost model's error)."""
    batch: str | None = None
    """The batch the job's chunks run in: releases naming one new batch are published as one
    message; None: the job runs alone."""
    join: bool = False
    """``batch`` is in flight already: the job joins it at its next step boundary."""


@dataclass(frozen=True, slots=True)
class Requeue:
    """Move a QUEUED job's chunk: bump its epoch, publish to ``to_queue`` with a fresh task id."""

    job_id: str
    from_queue: str
    to_queue: str


@dataclass(frozen=True, slots=True)
class Retarget:
    """A RUNNING job's next chunk goes to ``to_queue``: set the job's queue, nothing else."""

    job_id: str
    from_queue: str
    to_queue: str


@dataclass(frozen=True, slots=True)
class Expiry:
    """Shed the job (→ EXPIRED) with ``reason`` on its event stream."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class LevelMark:
    """A job's MLFQ place: its level and its ``service_s`` when it entered the level."""

    level: int
    service_mark_s: float


@dataclass(frozen=True, slots=True)
class AdmissionStatus:
    """What the submit path needs to call ``admit``: the state, the load and when measured."""

    state: AdmissionState
    load: float
    """The figure admission uses (``PolicyConfig.overload_measure``: the effective load by
    default)."""
    retry_after_s: float
    measured_at_s: float
    compute_load: float | None = None
    """Outstanding compute work alone ÷ capacity (None: not measured, as by a baseline)."""
    effective_load: float | None = None
    """Compute plus expected model loads ÷ capacity (``scheduler.admission``; None: not
    measured)."""


@dataclass(frozen=True, slots=True)
class TickPlan:
    """Everything one tick decided. Action lists are disjoint: a job appears in at most one of
    releases, requeues, retargets, preempt, suspend, standby and expire."""

    policy: PolicyKind
    now_s: float
    origin_id: str | None
    origin_score: float | None
    top_scores: tuple[tuple[str, float], ...]
    """Highest scores first (at most ``PolicyConfig.top_scores``)."""
    releases: tuple[Release, ...]
    """In priority order: publish in this order."""
    atomic_release: bool
    """FIFO baseline: publish each released job as one task running every chunk."""
    requeues: tuple[Requeue, ...]
    retargets: tuple[Retarget, ...]
    preempt: tuple[str, ...]
    """In-flight jobs to flag: a RUNNING one stops at its next block group, a QUEUED one at its
    claim (having run nothing); both become PREEMPTED."""
    suspend: tuple[str, ...]
    """PENDING / PREEMPTED jobs → SUSPENDED (overload convergence)."""
    standby: tuple[str, ...]
    """QUEUED jobs: requeue to ``standby``; RUNNING jobs: their next chunk goes to ``standby``."""
    expire: tuple[Expiry, ...]
    levels: Mapping[str, LevelMark]
    """MLFQ marks that changed (first placement, demotion): write them onto the job."""
    reserved_workers: frozenset[str]
    worker_queues: Mapping[str, tuple[str, ...]]
    """Alive worker → queues in strict priority order (reserved: realtime only)."""
    admission: AdmissionStatus
    capacity_slots: int | None
    """Most jobs in flight (QUEUED or RUNNING, not on standby, not being preempted) after this
    plan; None for the baselines, which release without a gate."""
    state: PolicyState
    """Store it; the next snapshot carries it back."""
    recoveries: tuple[Recovery, ...] = ()
    """Jobs requeued from their checkpoint under a new epoch (lost, stuck, unpublished, parked);
    planned before everything else, and left out of the rest of the plan."""
    failures: tuple[Failure, ...] = ()
    """Jobs that can never run (a failed dependency, an unreadable record) → FAILED."""
    estimates: Mapping[str, float] | None = None
    """Whole-service-time estimates of jobs that have none on record yet (kept once, so the
    bench can report the cost model's error)."""
    reserve_reason: str | None = None
    """Why workers are held for realtime work only (None: the reserve is lent out)."""
    suspend_reason: str = "overload convergence: held back"
    """What each job of ``suspend`` has on its event stream: why, with the load figures."""
    deferred: tuple[str, ...] = ()
    """Jobs ranked behind the rest because the fleet cannot finish them by their deadlines
    together with the work that can still make it (not marked; judged again every tick)."""
    fair_share: Joined | None = None
    """Under tenant fair share, this tick's join (``scheduler.fairness.join``: the lifts, the
    active set, the floors) that the order read its counters from: the caller persists it and
    hands its ledger back with the next snapshot. None: fair share off."""
