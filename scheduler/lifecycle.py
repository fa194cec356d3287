"""Job lifecycle: the states, the SLO classes and the one table of legal transitions."""

from __future__ import annotations

from enum import Enum

from scheduler.errors import IllegalTransition


class JobState(str, Enum):
    """Where a job is in its life."""

    PENDING = "PENDING"
    """Accepted and stored; no chunk released to a queue yet."""
    QUEUED = "QUEUED"
    """A chunk message is on a queue, waiting for a worker."""
    RUNNING = "RUNNING"
    """A worker is executing one of the job's chunks."""
    PREEMPTED = "PREEMPTED"
    """Stopped at a chunk or block-group boundary with its checkpoint saved; waits for release."""
    SUSPENDED = "SUSPENDED"
    """Held back by overload convergence; released again when load falls."""
    DONE = "DONE"
    """Every chunk ran; the artifact or result is stored."""
    FAILED = "FAILED"
    """A chunk raised an error that retrying cannot fix; the reason is on the record."""
    CANCELLED = "CANCELLED"
    """Cancelled by its owner; stopped at its next chunk boundary."""
    EXPIRED = "EXPIRED"
    """Shed by the scheduler because it could no longer meet its deadline."""

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})

_S = JobState
_ENDINGS = {_S.FAILED, _S.CANCELLED, _S.EXPIRED}

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.QUEUED, _S.SUSPENDED} | _ENDINGS),
    _S.QUEUED: frozenset({_S.RUNNING, _S.QUEUED, _S.PREEMPTED, _S.SUSPENDED} | _ENDINGS),
    _S.RUNNING: frozenset({_S.QUEUED, _S.PREEMPTED, _S.SUSPENDED, _S.DONE} | _ENDINGS),
    _S.PREEMPTED: frozenset({_S.QUEUED, _S.SUSPENDED} | _ENDINGS),
    _S.SUSPENDED: frozenset({_S.QUEUED} | _ENDINGS),
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
    _S.EXPIRED: frozenset(),
}
"""Legal moves. QUEUED → QUEUED is a requeue (a chunk moved to another queue with a new epoch);
RUNNING → QUEUED is the normal hop to the next chunk."""


def check_transition(job_id: str, current: JobState, target: JobState) -> None:
    """Raise :class:`IllegalTransition` unless ``current → target`` is in :data:`TRANSITIONS`."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(job_id, current.value, target.value)


class SloClass(str, Enum):
    """The three service classes; each has its own queue and latency target."""

    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 is the most urgent."""
        return _CLASS_RANK[self]


_CLASS_RANK = {SloClass.REALTIME: 0, SloClass.INTERACTIVE: 1, SloClass.BATCH: 2}
