"""Recovery, pure: which jobs the tick must requeue or fail before it plans anything else.

A RUNNING job whose chunk lease lapsed lost its worker; one whose worker still heartbeats but
whose chunk ran far past its expected time is stuck; a QUEUED job whose last publish names
another chunk or epoch was never published; one whose message was published but that an idle
live worker consuming its queue has not taken is held by a hung consumer; a chunk parked on a
worker's own queue waited too long, its worker is gone, or its worker evicted its model; a
waiting job whose dependency failed can never run; a record the store cannot read is failed
with its reason, once. Each becomes an action of the ``TickPlan``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from scheduler.cost import CostModel
from scheduler.lifecycle import JobState
from scheduler.model import JobView, WorkerView
from scheduler.placement import slack_s


class RecoveryCause(str, Enum):
    """Why a job's next chunk is put back on its class queue under a new epoch."""

    LOST = "lost"
    """Its worker's chunk lease lapsed (the worker died or lost Redis)."""
    STUCK = "stuck"
    """Its chunk ran far past the expected time with a live heartbeat."""
    UNPUBLISHED = "unpublished"
    """It is QUEUED but its chunk message was never published."""
    UNCLAIMED = "unclaimed"
    """It is QUEUED and its message was published, but an idle live worker consuming its queue
    has not taken it for ``RecoveryConfig.claim_within_s`` past ``unclaimed_after_s`` of
    waiting: the message is not on the queue — a consumer that stopped (SIGSTOP, a frozen
    host: alive, its connection open, its heartbeat lapsed) took it, reserved and unclaimed,
    or it sits in that consumer's socket. Its message is published again under a new epoch;
    the old one, if the consumer wakes, is refused at its claim."""
    PARKED = "parked"
    """Its chunk waited on a worker's own (affinity) queue too long, or that worker is gone."""
    MODEL_LEFT = "model_left"
    """Its chunk waits on the own queue of a worker that has since evicted its model
    (``JobView.model_left``): it is placed anew, as a release is. Two jobs in flight on one
    worker whose models do not fit its device together would otherwise take turns chunk by
    chunk, each turn a load."""
    IDLE_HOLDER = "idle_holder"
    """Its chunk waits on the own queue of a worker busy with another job while an idle worker
    holds its model and adapters (``JobView.idle_holder``): it is placed anew, as a release is.
    Two jobs in flight on one worker take turns chunk by chunk to the end of both, each
    finishing about when both would run back to back, while a worker holding the same model
    may sit idle (at 256 simulated workers, load 0.5: most of the interactive jobs Stepline
    missed)."""


@dataclass(frozen=True, slots=True)
class Recovery:
    """Requeue the job's next chunk on its class queue under a new epoch, if the job is still as
    the snapshot saw it (the running attempt, or the parked message, is then stale)."""

    job_id: str
    cause: RecoveryCause
    reason: str


@dataclass(frozen=True, slots=True)
class Failure:
    """Fail the job (→ FAILED) with ``reason``: it can never run."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """When the tick recovers a job. Built from the broker and affinity settings."""

    stuck_min_s: float = 5.0
    """No chunk is judged stuck before it ran this long (doubled per stuck requeue)."""
    stuck_factor: float = 10.0
    """Stuck: ran longer than this many times its expected time."""
    stuck_min_samples: int = 3
    """Measured chunks a cost key (or the job itself) needs before its time is trusted."""
    unpublished_after_s: float = 10.0
    """A QUEUED job with no matching publish this long after it was queued was never published."""
    unclaimed_after_s: float = 10.0
    """No published message is judged unclaimed before its job waited this long: the
    heartbeat timeout (the chunk lease), within which a hung consumer's heartbeat lapses."""
    claim_within_s: float = 0.5
    """An idle worker takes a message on a queue it consumes within a hop; one idle this long
    while the message waited says the message is not there."""
    affinity_max_wait_s: float | None = 0.3
    """A parked chunk moves to its class queue after this wait (None: affinity is off)."""
    wait_within_slack: bool = False
    """A chunk parked where its model is stays past its reload while its slack covers twice
    that load (the Stepline placement parks on the same terms; the baselines do not)."""

    def parked_wait_s(self, job: JobView) -> float | None:
        """How long ``job``'s chunk may stay parked on a busy worker (None: no limit): the
        affinity wait, or for a job on a model the load it would pay elsewhere if that is
        longer. Placement parks such a chunk where its model is when that start is sooner than
        a load elsewhere; once it has waited as long as the load, moving costs no more than
        waiting on (the ski-rental rule: never more than twice the better choice's wait)."""
        if self.affinity_max_wait_s is None:
            return None
        return max(self.affinity_max_wait_s, job.reload_s)


def plan_recoveries(
    jobs: Iterable[JobView], alive_workers: frozenset[str], cost: CostModel,
    config: RecoveryConfig, now_s: float, workers: Sequence[WorkerView] = (),
) -> tuple[tuple[Recovery, ...], tuple[Failure, ...]]:
    """The recoveries and failures of this tick, from the snapshot's facts alone (``workers``:
    the snapshot's, whose idle ones witness a published message that nobody claims)."""
    recoveries: list[Recovery] = []
    failures: list[Failure] = []
    jobs = tuple(jobs)
    idle = tuple(w for w in workers if w.alive and w.busy_job is None
                 and w.idle_since_s is not None)

    @functools.cache
    def running_batches() -> frozenset[str]:  # a pass over the jobs only when a joiner waits
        return frozenset(job.batch_id for job in jobs
                         if job.batch_id is not None and job.state is JobState.RUNNING)

    for job in jobs:
        if job.failed_dependency is not None and job.state is JobState.PENDING:
            failures.append(Failure(job.job_id, job.failed_dependency))
            continue
        recovery = _recovery_of(job, alive_workers, cost, config, now_s, running_batches)
        if recovery is None and idle:
            recovery = _unclaimed(job, idle, config, now_s)
        if recovery is not None:
            recoveries.append(recovery)
    return tuple(recoveries), tuple(failures)


def _unclaimed(job: JobView, idle: Sequence[WorkerView], config: RecoveryConfig,
               now_s: float) -> Recovery | None:
    """``UNCLAIMED``: a QUEUED job on a shared queue (a class queue or standby, not a worker's
    own: only that worker consumes it, and the parked rules judge it) whose message was
    published as it was queued, waiting ``unclaimed_after_s`` or more, while a live worker
    that consumes its queue has been idle ``claim_within_s`` since it was queued."""
    if (job.state is not JobState.QUEUED or job.parked_on is not None or job.queue is None
            or job.batch_id is not None
            or job.published != (job.next_chunk, job.epoch)
            or now_s - job.waiting_since_s < config.unclaimed_after_s):
        return None
    for worker in idle:
        idle_s = worker.idle_over_s(job.waiting_since_s)
        if idle_s >= config.claim_within_s and job.queue in worker.queues:
            return Recovery(job.job_id, RecoveryCause.UNCLAIMED,
                            f"chunk {job.next_chunk} epoch {job.epoch} unclaimed for "
                            f"{now_s - job.waiting_since_s:.1f}s while {worker.name} sat idle "
                            f"on {job.queue} for {idle_s:.1f}s: a hung consumer holds its "
                            "message; published again")
    return None


def _affords_waiting(job: JobView, cost: CostModel, now_s: float) -> bool:
    """Whether a chunk parked where its model is may wait on past the load it would pay
    elsewhere: while its slack (its deadline less now and its remaining work) still covers
    twice that load, moving later still leaves it time to load elsewhere and finish, and
    every second it waits instead is a load's worker time no other job loses (placement
    parks it there on the same terms: ``scheduler.placement.place``'s ``slack_s``)."""
    if job.reload_s <= 0.0:
        return False
    left_s = job.remaining_cost_units * cost.seconds_per_unit(job.cost_key)
    return slack_s(job.deadline_s, now_s, left_s) >= 2.0 * job.reload_s


def _recovery_of(job: JobView, alive: frozenset[str], cost: CostModel, config: RecoveryConfig,
                 now_s: float, running_batches: Callable[[], frozenset[str]] = frozenset
                 ) -> Recovery | None:
    if job.state is JobState.RUNNING:
        if job.lease_until_s is not None and job.lease_until_s < now_s:
            return Recovery(job.job_id, RecoveryCause.LOST,
                            f"lease of {job.running_on} lapsed; requeued from checkpoint")
        reason = stuck_reason(job, cost, config, now_s)
        return None if reason is None else Recovery(job.job_id, RecoveryCause.STUCK, reason)
    if job.state is not JobState.QUEUED:
        return None
    if job.parked_on is not None and job.parked_on in alive \
            and config.affinity_max_wait_s is not None:
        if job.model_left:
            return Recovery(job.job_id, RecoveryCause.MODEL_LEFT,
                            f"affinity: {job.parked_on} no longer holds its model; placed anew")
        if job.idle_holder:
            return Recovery(job.job_id, RecoveryCause.IDLE_HOLDER,
                            f"affinity: {job.parked_on} is busy with another job and an idle "
                            "worker holds its model; placed anew")
    max_wait_s = config.parked_wait_s(job) if job.parked_on is not None else None
    if job.parked_on is not None and (max_wait_s is not None or job.parked_on not in alive):
        # a worker gone (its heartbeat lapsed: dead, or hung) never takes what it was given,
        # whether or not affinity is on now
        waited_s = now_s - job.waiting_since_s
        if job.parked_on not in alive or (
                max_wait_s is not None and waited_s >= max_wait_s and not (
                    config.wait_within_slack and _affords_waiting(job, cost, now_s))):
            why = "gone" if job.parked_on not in alive else f"busy for {waited_s * 1000:.0f} ms"
            return Recovery(job.job_id, RecoveryCause.PARKED,
                            f"affinity: {job.parked_on} {why}; moved to {job.queue}")
    # A job released into a running batch (a joiner) is carried by the batch's next message,
    # published when the step under way ends, however long that step takes (a first step
    # that loads its model takes seconds): it is unpublished only once its batch stops.
    if (job.published is not None and job.published != (job.next_chunk, job.epoch)
            and now_s - job.waiting_since_s >= config.unpublished_after_s
            and not (job.batch_id is not None and job.batch_id in running_batches())):
        return Recovery(job.job_id, RecoveryCause.UNPUBLISHED,
                        f"chunk {job.next_chunk} epoch {job.epoch} was never published")
    return None


def stuck_reason(job: JobView, cost: CostModel, config: RecoveryConfig,
                 now_s: float) -> str | None:
    """Why the running chunk is stuck, or None. A chunk with no trusted expected time (too few
    measured chunks of its cost key and of the job itself) is never judged stuck."""
    if job.chunk_running_since_s is None or job.next_chunk >= job.num_chunks:
        return None
    running_s = now_s - job.chunk_running_since_s
    backoff = 2 ** job.stuck_requeues  # each stuck requeue doubles the allowance
    floor_s = config.stuck_min_s * backoff
    if running_s <= floor_s:
        return None  # cheap exit before any estimate: most chunks end here
    expected_s, source = expected_chunk_s(job, cost, config.stuck_min_samples)
    if expected_s is None:
        return None
    limit_s = max(config.stuck_factor * expected_s * backoff, floor_s)
    if running_s <= limit_s:
        return None
    return (f"chunk {job.next_chunk} on {job.running_on or '?'} ran {running_s:.1f}s with a live "
            f"heartbeat, over {limit_s:.1f}s ({config.stuck_factor:g} x {expected_s:.3f}s "
            f"expected, {source}); requeued from checkpoint")


def expected_chunk_s(job: JobView, cost: CostModel,
                     min_samples: int) -> tuple[float | None, str]:
    """The next chunk's expected seconds: from the cost model where it measured the job's cost
    key often enough, else from the job's own median seconds per unit, else None."""
    learned = cost.learned.get(job.cost_key, {})
    if sum(e.samples for e in learned.values()) >= min_samples:
        return job.next_chunk_cost_units * cost.seconds_per_unit(job.cost_key), "cost model"
    if job.own_s_per_unit is not None:
        return job.next_chunk_cost_units * job.own_s_per_unit, "own median"
    return None, ""
