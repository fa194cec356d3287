"""The incremental planner's column store: one row per job view, kept across ticks.

A snapshot mostly carries the same :class:`JobView` objects tick after tick (a job's view is
rebuilt only when its record changes), so what a view alone decides — its state's partition,
its class and tier weights, its deadline, its cost units — is read once per view object into
columns (numpy arrays, one row per view; rows are found by object identity) and only the new
views of a tick are read. The store also keeps what the last tick built of those rows (frozen
tuples, sorts, the fair walk's parts), for the next tick to hand back while its inputs hold the
same bits. :class:`Tick` is one tick's live jobs as arrays over the store.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from scheduler.fairness import FairShareConfig, ServiceKey, TenantKey
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobView, ResourceProfile, Tier
from scheduler.policy import PolicyConfig
from scheduler.queues import STANDBY_QUEUE
from scheduler.scoring import ScoreTerms
from scheduler.survey import JOB_VALUE

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Objects = npt.NDArray[np.object_]
T = TypeVar("T")

WAITING, QUEUED, RUNNING, SUSPENDED, _NOT_LIVE = 0, 1, 2, 3, -1
_STATE_CODE = {JobState.PENDING: WAITING, JobState.PREEMPTED: WAITING,
               JobState.QUEUED: QUEUED, JobState.RUNNING: RUNNING,
               JobState.SUSPENDED: SUSPENDED}

_FLOATS = ("submitted", "deadline", "waiting", "service", "level_service", "units", "load",
           "base", "prog", "pre", "value", "next_units", "fair_weight")
_INTS = ("state", "cls_rank", "key", "left", "level", "tenant")
_BOOLS = ("realtime", "batch", "preempt", "on_standby", "estimated", "shed", "deps", "by_key",
          "grouped", "group_truthy", "recover")


class Columns:
    """One row per JobView object seen (held, so its identity is not reused): what the view
    alone decides, as arrays. Rows of views no longer in the snapshot are dropped by a rebuild
    once they outnumber the live ones."""

    def __init__(self, policy: PolicyConfig) -> None:
        self.policy = policy
        self.row_of: dict[int, int] = {}
        self.views: list[JobView] = []
        self.key_of: dict[str, int] = {}
        self.key_names: list[str] = []
        self.group_of: dict[str, int] = {}
        self.tenant_of: dict[str, int] = {}
        self.tenant_names: list[str] = []
        self.row_of_id: dict[str, int] = {}
        """The row last read for each job id."""
        self.capacity = 0
        self.f: dict[str, Floats] = {name: np.zeros(0) for name in _FLOATS}
        self.i: dict[str, Ints] = {name: np.zeros(0, np.int64) for name in _INTS}
        self.b: dict[str, Bools] = {name: np.zeros(0, np.bool_) for name in _BOOLS}
        self.group: Ints = np.zeros(0, np.int64)
        self.ids: Objects = np.zeros(0, object)
        self.sorted_ids: Ints = np.zeros(0, np.int64)
        """The identities of the views read, ascending (the keys of ``row_of``)."""
        self.sorted_rows: Ints = np.zeros(0, np.int64)
        """The row of each of ``sorted_ids``."""
        self._frozen: dict[str, tuple[Floats | Ints, tuple[Any, ...]]] = {}
        self._kept: dict[str, tuple[tuple[Floats | Ints, ...], Any]] = {}
        self.last: tuple[tuple[JobView, ...], Ints] = ((), np.zeros(0, np.int64))
        """The last tick's views and their rows."""
        self.estimates: tuple[Ints, Floats, dict[str, float]] | None = None
        """The last tick's first estimates: the rows and values they were built of."""
        self.fair_walk: tuple[Ints, Ints] | None = None
        """Under fair share, the last tick's rows and its walk (``fairness.fair_keys``'s
        order, positions in those rows)."""
        self.fair_tags: tuple[Ints, Floats, Ints, Floats, Floats] | None = None
        """Under fair share, what the last tick's start tags were built of (along its walk
        the rows, charges and (band, tenant) codes; the counters by code) and the tags."""
        self.contending: tuple[int, Ints, frozenset[TenantKey]] | None = None
        """The last tick's tenant count, contending (band, tenant) codes and their names."""
        self.bases: tuple[dict[TenantKey, float], Floats] | None = None
        """The last counters and their array by (band, tenant) code."""
        self.virtual: tuple[dict[ServiceKey, float], dict[TenantKey, float],
                            FairShareConfig, dict[TenantKey, float]] | None = None
        """The last ledger's measured seconds, lifts and config, and its counters."""

    def rows(self, jobs: Sequence[JobView]) -> Ints:
        """Each job's row, reading the views not seen before: the identities found by a
        binary search of those read (the views are held, so an identity is never reused)."""
        if len(self.views) > 2 * len(jobs) + 4096:
            self.__init__(self.policy)  # type: ignore[misc]  # drop the rows of gone views
        n = len(jobs)
        last, last_rows = self.last
        if jobs is last:
            return last_rows
        if len(last) == n:  # the same views at the same places, mostly: search the others
            same = np.fromiter(map(operator.is_, jobs, last), np.bool_, n)
            rows = np.where(same, last_rows, -1)
            moved = np.flatnonzero(~same)
            rows[moved] = self._search(np.fromiter(
                map(id, map(jobs.__getitem__, moved.tolist())), np.int64, moved.size))
        else:
            rows = self._search(np.fromiter(map(id, jobs), np.int64, n))
        unseen = np.flatnonzero(rows < 0)
        if unseen.size:
            fresh: list[JobView] = []
            start = len(self.views)
            known = self.sorted_ids
            for k in unseen.tolist():
                key = id(jobs[k])
                row = self.row_of.get(key)
                if row is None:
                    row = self.row_of[key] = len(self.views)
                    self.views.append(jobs[k])
                    fresh.append(jobs[k])
                rows[k] = row
            self._read(start, fresh)
            added = np.fromiter(map(id, fresh), np.int64, len(fresh))
            order = np.argsort(added, kind="stable")
            where = np.searchsorted(known, added[order])
            self.sorted_ids = np.insert(known, where, added[order])
            self.sorted_rows = np.insert(self.sorted_rows, where,
                                         np.arange(start, start + len(fresh))[order])
        rows.flags.writeable = False  # handed out again while the same views come
        self.last = (tuple(jobs), rows)
        return rows

    def frozen(self, name: str, values: Floats | Ints) -> tuple[Any, ...]:
        """``tuple(values.tolist())``, kept under ``name`` between ticks: the last tick's tuple
        again when every value has the same bits, or a copy of it with the few values that
        differ replaced (a tuple of ten thousand floats costs more to build than to patch)."""
        last = self._frozen.get(name)
        if last is not None and last[0].shape == values.shape and last[0].dtype == values.dtype:
            before, now = last[0], values
            if values.dtype == np.float64:
                before, now = before.view(np.int64), now.view(np.int64)
            diff = np.flatnonzero(before != now)
            if not diff.size:
                return last[1]
            if diff.size * 8 < values.size:
                items = list(last[1])
                for k, value in zip(diff.tolist(), values[diff].tolist(), strict=True):
                    items[k] = value
                out = tuple(items)
                self._frozen[name] = (values, out)
                return out
        out = tuple(values.tolist())
        self._frozen[name] = (values, out)
        return out

    def kept(self, name: str, inputs: tuple[Floats | Ints, ...], make: Callable[[], T]) -> T:
        """``make()``, kept under ``name`` between ticks: the last tick's value again when
        every input array holds the same bits as then (``make`` reads only those)."""
        last = self._kept.get(name)
        if last is not None and len(last[0]) == len(inputs) and all(
                same_bits(a, b) for a, b in zip(last[0], inputs, strict=True)):
            return cast(T, last[1])
        value = make()
        self._kept[name] = (inputs, value)
        return value

    def _search(self, ids: Ints) -> Ints:
        """The row of each view identity (-1: not read yet)."""
        known = self.sorted_ids
        if not known.size:
            return np.full(ids.size, -1, np.int64)
        at = np.minimum(np.searchsorted(known, ids), known.size - 1)
        return np.where(known[at] == ids, self.sorted_rows[at], -1)

    def _grow(self, size: int) -> None:
        if size <= self.capacity:
            return
        capacity = max(size, 2 * self.capacity, 1024)
        for cols in (self.f, self.i, self.b):
            for name, col in cols.items():
                grown = np.zeros(capacity, col.dtype)
                grown[:self.capacity] = col
                cols[name] = grown  # type: ignore[assignment]
        group = np.full(capacity, -1, np.int64)
        group[:self.capacity] = self.group
        ids = np.zeros(capacity, object)
        ids[:self.capacity] = self.ids
        self.group, self.ids, self.capacity = group, ids, capacity

    def _read(self, start: int, views: list[JobView]) -> None:
        end = start + len(views)
        self._grow(end)
        f, i, b = self.f, self.i, self.b
        at = slice(start, end)
        f["submitted"][at] = [j.submitted_at_s for j in views]
        f["deadline"][at] = [j.deadline_s for j in views]
        f["waiting"][at] = [j.waiting_since_s for j in views]
        f["service"][at] = [j.service_s for j in views]
        f["level_service"][at] = [j.level_service_s for j in views]
        f["units"][at] = [j.remaining_cost_units for j in views]
        f["load"][at] = [j.load_s for j in views]
        f["value"][at] = [JOB_VALUE[j.slo_class, j.tier] for j in views]
        states = [j.state for j in views]
        i["state"][at] = [_STATE_CODE.get(s, _NOT_LIVE) for s in states]
        classes = [j.slo_class for j in views]
        i["cls_rank"][at] = [c.rank for c in classes]
        i["key"][at] = _codes([j.cost_key for j in views], self.key_of, self.key_names)
        i["tenant"][at] = _codes([j.tenant for j in views], self.tenant_of, self.tenant_names)
        f["next_units"][at] = [j.next_chunk_cost_units for j in views]
        fair = self.policy.fair_share
        f["fair_weight"][at] = [fair.weight(j.tier.value) for j in views]
        done = np.array([j.next_chunk for j in views], np.int64)
        chunks = np.array([j.num_chunks for j in views], np.int64)
        i["left"][at] = chunks - done
        i["level"][at] = [-1 if j.level is None else j.level for j in views]
        b["realtime"][at] = [c is SloClass.REALTIME for c in classes]
        b["batch"][at] = [c is SloClass.BATCH for c in classes]
        b["preempt"][at] = [j.preempt_requested for j in views]
        b["on_standby"][at] = [j.queue == STANDBY_QUEUE for j in views]
        b["estimated"][at] = [j.estimated for j in views]
        b["shed"][at] = [j.shed_if_late for j in views]
        b["deps"][at] = [bool(j.depends_on) for j in views]
        b["by_key"][at] = [bool(j.remaining_units_by_key) for j in views]
        b["grouped"][at] = [j.batch_group is not None for j in views]
        b["group_truthy"][at] = [bool(j.batch_group) for j in views]
        b["recover"][at] = [s is JobState.RUNNING or s is JobState.QUEUED or (
            s is JobState.PENDING and j.failed_dependency is not None)
            for s, j in zip(states, views, strict=True)]
        groups = self.group_of
        self.group[at] = [-1 if j.batch_group is None else groups.setdefault(
            j.batch_group, len(groups)) for j in views]
        self.ids[at] = [j.job_id for j in views]
        self.row_of_id.update((j.job_id, row) for row, j in enumerate(views, start))
        # The survey's score terms a view alone decides, summed in its order (a zero term
        # added is the same float as one skipped: every term is >= 0).
        t = ScoreTerms.from_policy(self.policy)
        base = np.where([j.tier is Tier.GOLD for j in views], t.gold, 0.0)
        base = base + np.where(b["realtime"][at], t.realtime, np.where(
            [c is SloClass.INTERACTIVE for c in classes], t.interactive, 0.0))
        base = base + np.where([j.resource_profile is ResourceProfile.MEMORY for j in views],
                               t.memory, 0.0)
        f["base"][at] = base + np.array([t.impact[j.kind] for j in views])
        f["prog"][at] = t.progress * done.astype(np.float64) / chunks.astype(np.float64)
        pre = np.array([j.preemptions for j in views], np.int64)
        f["pre"][at] = np.where(pre == 0, 0.0, np.where(
            pre >= t.max_preemptions, t.preemptions_max, t.per_preemption * pre))


@dataclass(frozen=True, slots=True)
class Tick:
    """The tick's live jobs as arrays (position = survey index), and what the clock made of
    them."""

    rows: Ints
    """Each live job's row in the columns."""
    state: Ints
    remaining: Floats
    demand: Floats
    """Remaining work due within the load horizon (later work pro rata), as the load counts."""
    deadline: Floats
    waited: Floats
    scores: Floats
    k1: Floats
    k2: Floats
    """:meth:`Ranking.keys` of every job, valid once the ranking is settled (zeros before)."""
    waiting_realtime: Ints
    waiting_other: Ints
    suspended: Ints
    standby: Ints
    late: Ints
    """The survey's index tuples of the same names, as arrays."""


def same_bits(a: Floats | Ints, b: Floats | Ints) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float64:
        return bool(np.array_equal(a.view(np.int64), b.view(np.int64)))
    return bool(np.array_equal(a, b))


def _codes(values: list[str], code_of: dict[str, int], names: list[str]) -> list[int]:
    """Each value's code, a value not seen before getting the next one (kept in ``code_of``
    and ``names``, so codes stay stable across ticks)."""
    for value in values:
        if value not in code_of:
            code_of[value] = len(names)
            names.append(value)
    return [code_of[value] for value in values]
