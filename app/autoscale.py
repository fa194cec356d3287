"""The worker autoscaler of ``stepline up --workers MIN:MAX``: ``decide`` is pure (the backlog, the
oldest wait and the scheduler's load in, one decision with its reason out); the bottom section
reads those signals from Redis and records decisions. ``app.stack`` applies them."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from scheduler import AdmissionStatus
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.adapter import load_admission
from tasks.errors import AdmissionStatusError, SteplineError
from tasks.record import JobRecord, UnreadableRecord
from tasks.settings.autoscale import AutoscaleSettings
from tasks.store import JobStore

log = logging.getLogger(__name__)

MAX_POOL = 64
"""Most worker processes one stack runs."""
EVENTS_MAXLEN = 10_000
"""Entries kept in the autoscaler's event stream (approximately)."""


class AutoscaleError(SteplineError):
    """Raised when a scaling decision breaks an invariant of the policy (a bug, not a load)."""


@dataclass(frozen=True, slots=True)
class WorkerRange:
    """``--workers N`` (a fixed pool of N) or ``--workers MIN:MAX`` (autoscaled)."""

    min_workers: int
    max_workers: int

    @property
    def fixed(self) -> bool:
        return self.min_workers == self.max_workers

    @classmethod
    def parse(cls, text: str) -> WorkerRange:
        """``"2"`` → 2..2, ``"1:4"`` → 1..4; raises ValueError saying what to write."""
        low_text, colon, high_text = text.strip().partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if colon else low
        except ValueError:
            raise ValueError(f"{text!r}: write a count (2) or a range MIN:MAX (1:4)") from None
        if not 1 <= low <= high <= MAX_POOL:
            raise ValueError(f"{text!r}: need 1 <= MIN <= MAX <= {MAX_POOL}")
        return cls(low, high)

    def __str__(self) -> str:
        return str(self.min_workers) if self.fixed else f"{self.min_workers}:{self.max_workers}"


class ScaleAction(str, Enum):
    """What one decision does to the pool."""

    UP = "up"
    """Start workers."""
    DOWN = "down"
    """Drain workers: they stop consuming, finish their chunk, and exit."""
    HOLD = "hold"
    """Keep the pool as it is."""


class Cause(str, Enum):
    """Why the decision is what it is (the first word of its reason)."""

    BACKLOG = "backlog"
    """Up: at least ``backlog_per_worker`` jobs wait per active worker."""
    OLD_WAIT = "old_wait"
    """Up: a job has waited ``max_wait_s`` for a worker."""
    HIGH_LOAD = "high_load"
    """Up: the scheduler's load is at least ``load_high`` while jobs wait."""
    IDLE = "idle"
    """Down: a worker has had no job to run for ``down_after_s``."""
    BELOW_MIN = "below_min"
    """Up: the pool fell below MIN (a repair; no cooldown applies)."""
    ABOVE_MAX = "above_max"
    """Down: the pool is above MAX (a repair; no cooldown applies)."""
    NOT_SUSTAINED = "not_sustained"
    """Hold: pressure or idleness, not yet for long enough."""
    COOLDOWN = "cooldown"
    """Hold: pressure or idleness, but the last change is too recent."""
    AT_MAX = "at_max"
    """Hold: pressure, but the pool (draining workers included) is at MAX."""
    AT_MIN = "at_min"
    """Hold: idle, but no worker can go without leaving fewer than MIN or than the jobs."""
    STEADY = "steady"
    """Hold: neither pressure nor idleness."""
    NO_SIGNALS = "no_signals"
    """Hold: the signals could not be read (Redis unreachable); timers start over."""


@dataclass(frozen=True, slots=True)
class ScalingSignals:
    """What the autoscaler reads each interval (facts only)."""

    waiting_jobs: int
    """Jobs that want a worker and have none: PENDING (no live dependency), QUEUED,
    PREEMPTED or SUSPENDED."""
    oldest_wait_s: float
    """How long the longest-waiting of them has waited (0 when none waits)."""
    load: float | None
    """The scheduler's load estimate (outstanding work ÷ capacity over its horizon); None when
    unpublished or stale."""
    busy_workers: frozenset[str] = frozenset()
    """Node names of the workers running a job now."""


@dataclass(frozen=True, slots=True)
class PoolView:
    """The stack's own workers (node names, oldest first)."""

    active: tuple[str, ...]
    """Started and not draining (still-starting ones included)."""
    draining: tuple[str, ...] = ()
    """Told to stop; they hold their slot under MAX until they exit."""


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """Bounds, thresholds, timers and steps of the autoscaler (durations in seconds)."""

    min_workers: int
    max_workers: int
    backlog_per_worker: float = 1.0
    max_wait_s: float = 2.0
    load_high: float = 0.7
    up_after_s: float = 2.0
    down_after_s: float = 30.0
    up_cooldown_s: float = 5.0
    down_cooldown_s: float = 30.0
    up_step: int = 2
    down_step: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise AutoscaleError(f"need 1 <= min_workers <= max_workers, got "
                                 f"{self.min_workers}:{self.max_workers}")
        if self.up_step < 1 or self.down_step < 1 or self.backlog_per_worker <= 0:
            raise AutoscaleError("up_step, down_step and backlog_per_worker must be positive")

    @classmethod
    def from_settings(cls, settings: AutoscaleSettings, workers: WorkerRange) -> ScalingPolicy:
        s = settings
        return cls(min_workers=workers.min_workers, max_workers=workers.max_workers,
                   backlog_per_worker=s.backlog_per_worker, max_wait_s=s.max_wait,
                   load_high=s.load_high, up_after_s=s.up_after, down_after_s=s.down_after,
                   up_cooldown_s=s.up_cooldown, down_cooldown_s=s.down_cooldown,
                   up_step=s.up_step, down_step=s.down_step)


@dataclass(frozen=True, slots=True)
class ScalingMemory:
    """What one decision hands the next: since when pressure or idleness has held unbroken,
    and when the pool last changed."""

    pressure_since_s: float | None = None
    idle_since_s: float | None = None
    last_change_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One interval's decision: the only thing the supervisor acts on."""

    action: ScaleAction
    cause: Cause
    workers_from: int
    """Active workers before."""
    workers_to: int
    """Active workers after (UP: start the difference; DOWN: drain ``retire``)."""
    reason: str
    retire: tuple[str, ...] = ()
    """DOWN: the workers to drain."""
    memory: ScalingMemory = ScalingMemory()

    def describe(self) -> str:
        """One line for the log and ``stepline up``'s output."""
        if self.action is ScaleAction.HOLD:
            return f"hold {self.workers_to} workers ({self.cause.value}): {self.reason}"
        return (f"{self.workers_from} -> {self.workers_to} workers ({self.action.value}, "
                f"{self.cause.value}): {self.reason}")


# the policy (pure) -----------------------------------------------------------------------------
def decide(signals: ScalingSignals | None, pool: PoolView, policy: ScalingPolicy,
           memory: ScalingMemory, now_s: float) -> ScalingDecision:
    """The pool's next move. Workers are added only while jobs wait (more workers cannot speed
    up a job: its chunks run one at a time), after the pressure has held ``up_after_s`` and
    ``up_cooldown_s`` after the last change; drained only after a worker has had nothing to
    run for ``down_after_s`` and ``down_cooldown_s`` after the last change."""
    size = len(pool.active)
    if size < policy.min_workers or size > policy.max_workers:
        return _repair(signals, pool, policy, memory, now_s)
    if signals is None:
        return _hold(Cause.NO_SIGNALS, size, "the signals could not be read; holding",
                     ScalingMemory(last_change_at_s=memory.last_change_at_s))
    pressure = pressure_of(signals, pool, policy)
    idle = None if pressure is not None else idleness_of(signals, pool)
    memory = replace(
        memory,
        pressure_since_s=_since(memory.pressure_since_s, pressure is not None, now_s),
        idle_since_s=_since(memory.idle_since_s, idle is not None, now_s),
    )
    if pressure is not None:
        return _scale_up(pressure, signals, pool, policy, memory, now_s)
    if idle is not None:
        return _scale_down(idle, signals, pool, policy, memory, now_s)
    return _hold(Cause.STEADY, size, describe_signals(signals, pool), memory)


def pressure_of(signals: ScalingSignals, pool: PoolView,
                policy: ScalingPolicy) -> tuple[Cause, str] | None:
    """Backlog, an old wait or high load, with jobs waiting; None when there is none."""
    waiting, size = signals.waiting_jobs, max(len(pool.active), 1)
    if waiting == 0:
        return None
    if waiting >= policy.backlog_per_worker * size:
        return Cause.BACKLOG, (f"{waiting} jobs waiting for {size} workers "
                               f"(>= {policy.backlog_per_worker:g} per worker)")
    if signals.oldest_wait_s >= policy.max_wait_s:
        return Cause.OLD_WAIT, (f"a job has waited {signals.oldest_wait_s:.1f}s "
                                f"(>= {policy.max_wait_s:g}s), {waiting} waiting")
    if signals.load is not None and signals.load >= policy.load_high:
        return Cause.HIGH_LOAD, (f"load {signals.load:.2f} (>= {policy.load_high:g}) with "
                                 f"{waiting} jobs waiting")
    return None


def idleness_of(signals: ScalingSignals, pool: PoolView) -> str | None:
    """Some active worker has no job to run (running and waiting jobs together are fewer than
    the active workers); None otherwise. A chunk between two workers is still a job, so hops
    never look like idleness."""
    spare = spare_workers(signals, pool)
    if spare < 1:
        return None
    return (f"{spare} of {len(pool.active)} workers have no job to run "
            f"({running_jobs(signals, pool)} running, {signals.waiting_jobs} waiting)")


def running_jobs(signals: ScalingSignals, pool: PoolView) -> int:
    """Jobs running on this pool's workers (draining ones included: their job needs a worker
    again once its chunk ends)."""
    return len(signals.busy_workers.intersection(pool.active + pool.draining))


def spare_workers(signals: ScalingSignals, pool: PoolView) -> int:
    return len(pool.active) - running_jobs(signals, pool) - signals.waiting_jobs


def choose_retirees(active: Sequence[str], busy: Collection[str], count: int) -> tuple[str, ...]:
    """``count`` workers to drain: idle before busy (a busy one first finishes its chunk), and
    newest first (the oldest keep their warm caches)."""
    order = sorted(range(len(active)), key=lambda i: (active[i] in busy, -i))
    return tuple(active[i] for i in order[:count])


def describe_signals(signals: ScalingSignals, pool: PoolView) -> str:
    return (f"{signals.waiting_jobs} waiting (oldest {signals.oldest_wait_s:.1f}s), "
            f"{running_jobs(signals, pool)} running, load {_load(signals)}")


def check_decision_invariants(decision: ScalingDecision, pool: PoolView,
                              policy: ScalingPolicy) -> None:
    """Raise :class:`AutoscaleError` if ``decision`` breaks a rule of the policy."""
    d, size = decision, len(pool.active)
    problems = []
    if d.workers_from != size:
        problems.append(f"workers_from {d.workers_from} != pool size {size}")
    if policy.min_workers <= size <= policy.max_workers and not (
            policy.min_workers <= d.workers_to <= policy.max_workers):
        problems.append(f"target {d.workers_to} outside {policy.min_workers}:"
                        f"{policy.max_workers}")
    if d.action is ScaleAction.UP and (d.workers_to <= size or d.retire):
        problems.append("an UP decision must add workers and retire none")
    if d.action is ScaleAction.UP and d.cause is not Cause.BELOW_MIN and (
            d.workers_to + len(pool.draining) > policy.max_workers):
        problems.append("an UP decision would run more than MAX processes")
    if d.action is ScaleAction.DOWN and (
            len(set(d.retire)) != size - d.workers_to or not set(d.retire) <= set(pool.active)):
        problems.append(f"DOWN retires {d.retire} for {size} -> {d.workers_to}")
    if d.action is ScaleAction.HOLD and (d.workers_to != size or d.retire):
        problems.append("a HOLD must change nothing")
    if problems:
        raise AutoscaleError("; ".join(problems) + f" (decision: {d.describe()})")


def _since(since_s: float | None, holds: bool, now_s: float) -> float | None:
    if not holds:
        return None
    return now_s if since_s is None else since_s


def _held_s(since_s: float | None, now_s: float) -> float:
    return 0.0 if since_s is None else now_s - since_s


def _cooling_s(memory: ScalingMemory, cooldown_s: float, now_s: float) -> float:
    """Seconds of cooldown left after the last change (0 when none)."""
    if memory.last_change_at_s is None:
        return 0.0
    return max(memory.last_change_at_s + cooldown_s - now_s, 0.0)


def _hold(cause: Cause, size: int, reason: str, memory: ScalingMemory) -> ScalingDecision:
    return ScalingDecision(ScaleAction.HOLD, cause, size, size, reason, memory=memory)


def _repair(signals: ScalingSignals | None, pool: PoolView, policy: ScalingPolicy,
            memory: ScalingMemory, now_s: float) -> ScalingDecision:
    size = len(pool.active)
    changed = replace(memory, last_change_at_s=now_s)
    if size < policy.min_workers:
        return ScalingDecision(ScaleAction.UP, Cause.BELOW_MIN, size, policy.min_workers,
                               f"{size} workers, below the minimum {policy.min_workers}",
                               memory=changed)
    busy = signals.busy_workers if signals is not None else frozenset()
    retire = choose_retirees(pool.active, busy, size - policy.max_workers)
    return ScalingDecision(ScaleAction.DOWN, Cause.ABOVE_MAX, size, policy.max_workers,
                           f"{size} workers, above the maximum {policy.max_workers}: "
                           f"draining {', '.join(retire)}", retire, changed)


def _scale_up(pressure: tuple[Cause, str], signals: ScalingSignals, pool: PoolView,
              policy: ScalingPolicy, memory: ScalingMemory, now_s: float) -> ScalingDecision:
    cause, why = pressure
    size = len(pool.active)
    room = policy.max_workers - size - len(pool.draining)
    if room <= 0:
        draining = f", {len(pool.draining)} draining" if pool.draining else ""
        return _hold(Cause.AT_MAX, size, f"{why}; at the maximum {policy.max_workers}{draining}",
                     memory)
    held_s = _held_s(memory.pressure_since_s, now_s)
    if held_s < policy.up_after_s:
        return _hold(Cause.NOT_SUSTAINED, size,
                     f"{why}, for {held_s:.1f}s of {policy.up_after_s:g}s", memory)
    if (left_s := _cooling_s(memory, policy.up_cooldown_s, now_s)) > 0:
        return _hold(Cause.COOLDOWN, size, f"{why}; {left_s:.1f}s of cooldown left", memory)
    wanted = max(signals.waiting_jobs - max(spare_workers(signals, pool), 0), 1)
    add = min(policy.up_step, room, wanted)
    return ScalingDecision(ScaleAction.UP, cause, size, size + add,
                           f"{why}, for {held_s:.1f}s; load {_load(signals)}",
                           memory=replace(memory, last_change_at_s=now_s))


def _scale_down(why: str, signals: ScalingSignals, pool: PoolView, policy: ScalingPolicy,
                memory: ScalingMemory, now_s: float) -> ScalingDecision:
    size = len(pool.active)
    needed = running_jobs(signals, pool) + signals.waiting_jobs
    removable = size - max(policy.min_workers, needed)
    if removable <= 0:
        return _hold(Cause.AT_MIN, size, f"{why}; at the minimum {policy.min_workers}", memory)
    held_s = _held_s(memory.idle_since_s, now_s)
    if held_s < policy.down_after_s:
        return _hold(Cause.NOT_SUSTAINED, size,
                     f"{why}, for {held_s:.1f}s of {policy.down_after_s:g}s", memory)
    if (left_s := _cooling_s(memory, policy.down_cooldown_s, now_s)) > 0:
        return _hold(Cause.COOLDOWN, size, f"{why}; {left_s:.1f}s of cooldown left", memory)
    retire = choose_retirees(pool.active, signals.busy_workers, min(policy.down_step, removable))
    return ScalingDecision(ScaleAction.DOWN, Cause.IDLE, size, size - len(retire),
                           f"{why}, for {held_s:.1f}s: draining {', '.join(retire)}", retire,
                           replace(memory, last_change_at_s=now_s))


def _load(signals: ScalingSignals) -> str:
    return "unknown" if signals.load is None else f"{signals.load:.2f}"


# reading the signals, recording the decisions ----------------------------------------------------
WAITING_STATES = frozenset({JobState.PENDING, JobState.QUEUED, JobState.PREEMPTED,
                            JobState.SUSPENDED})
"""Jobs in these states want a worker and have none. Under the ``stepline`` policy most of a
backlog is PENDING in the store, not on a Celery queue: the tick releases only what the workers
can take, so Celery's queue lengths alone would miss it."""


def signals_from(records: Iterable[JobRecord], admission: AdmissionStatus | None,
                 now_s: float, load_ttl_s: float) -> ScalingSignals:
    """The signals in the live records and the last tick's admission status (a status older
    than ``load_ttl_s`` is no load reading at all)."""
    live = list(records)
    live_ids = {r.job_id for r in live}
    waiting = [r for r in live if r.state in WAITING_STATES
               and not (r.state is JobState.PENDING and live_ids.intersection(r.depends_on))]
    # The same "waiting since" the scheduler ages jobs by.
    waits_s = [now_s - (r.queued_at_s or r.preempted_at_s or r.submitted_at_s) for r in waiting]
    busy = frozenset(r.running_on for r in live if r.state is JobState.RUNNING and r.running_on)
    fresh = admission is not None and now_s - admission.measured_at_s <= load_ttl_s
    return ScalingSignals(waiting_jobs=len(waiting), oldest_wait_s=max([0.0, *waits_s]),
                          load=admission.load if fresh and admission else None,
                          busy_workers=busy)


def read_signals(store: JobStore, now_s: float, load_ttl_s: float) -> ScalingSignals:
    """The signals, read from the store in a few round trips (raises redis errors)."""
    records = [r for r in store.records(store.active_ids())
               if not isinstance(r, UnreadableRecord)]
    try:
        admission = load_admission(store)
    except AdmissionStatusError as exc:  # a status nobody can parse is no reading
        log.warning("%s; scaling without the load", exc)
        admission = None
    return signals_from(records, admission, now_s, load_ttl_s)


def decision_event(decision: ScalingDecision, signals: ScalingSignals | None, pool: PoolView,
                   now_s: float) -> dict[str, str]:
    """A decision as the fields of one entry of ``sl:autoscale:events``."""
    event = {
        "kind": "decision", "ts": repr(now_s), "action": decision.action.value,
        "cause": decision.cause.value, "workers_from": str(decision.workers_from),
        "workers_to": str(decision.workers_to), "draining": str(len(pool.draining)),
        "retire": ",".join(decision.retire), "reason": decision.reason,
    }
    if signals is not None:
        event.update(waiting_jobs=str(signals.waiting_jobs),
                     oldest_wait_s=f"{signals.oldest_wait_s:.3f}",
                     running_jobs=str(running_jobs(signals, pool)), load=_load(signals))
    return event


def record_event(client: Any, fields: Mapping[str, str]) -> None:
    """Append one event to ``sl:autoscale:events`` (capped)."""
    client.xadd(keys.AUTOSCALE_EVENTS, dict(fields), maxlen=EVENTS_MAXLEN, approximate=True)


def read_events(store: JobStore, after_id: str = "0-0") -> list[tuple[str, dict[str, str]]]:
    """The autoscaler's events after ``after_id``, oldest first."""
    return store.read_stream(keys.AUTOSCALE_EVENTS, after_id=after_id)

