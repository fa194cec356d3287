"""The Stepline planner held across ticks: the same plan as :func:`scheduler.plan_tick`, in a
few milliseconds at 10 000 jobs.

A snapshot mostly carries the same :class:`JobView` objects tick after tick (a job's view is
rebuilt only when its record changes), so what a view alone decides — its state's partition,
its class and tier weights, its deadline, its cost units — is read once per view object into
columns (numpy arrays, one row per view; rows are found by object identity) and only the new
views of a tick are read. What the clock or the cost model moves (remaining work, slack, waited
time, scores, lateness, load, the deferral) is worked out each tick over the columns as whole
arrays, in the same floating-point operations in the same order as the readable pipeline
(``scheduler.survey``, ``judgement``, ``ordering``, ``allocation``, ``reserve``), so every
float and every tie comes out the same: ``tests/unit/test_scheduler_incremental.py`` holds the
plans equal over random histories, and the pinned digests hold the readable pipeline.

Where an order matters, numpy sorts stably with the index (or the position) as the last key,
as Python's sorts and heaps break ties; sums that the readable code accumulates one job at a
time are cumulative sums (sequential, not numpy's pairwise reduction) in the same order.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import compress
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from scheduler.admission import (
    expiry_reason,
    measure_loads,
    next_admission_state,
    paid_load_share,
)
from scheduler.allocation import (
    Allocation,
    Flight,
    allocate_ranked,
    idle_slots,
    origin_waits,
    ranked_candidates,
)
from scheduler.batching import GrowthTable, batch_slowdown
from scheduler.fairness import (
    ON_TIME,
    PAST_SAVING,
    URGENT,
    FairKey,
    FairShareConfig,
    ServiceKey,
    ServiceLedger,
    TenantKey,
    join,
)
from scheduler.judgement import Judgement
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import ClusterSnapshot, JobView, ResourceProfile, Tier, WorkerView
from scheduler.ordering import (
    BAND_NAMES,
    Levels,
    Order,
    Ranking,
    choose_origin,
    settle_levels,
    with_fair_share,
)
from scheduler.plan import TickPlan
from scheduler.planner import _Emit
from scheduler.policy import PolicyConfig, PolicyKind
from scheduler.queues import LOWEST_LEVEL, STANDBY_QUEUE
from scheduler.reserve import hold_reserve
from scheduler.scoring import ScoreTerms
from scheduler.state import AdmissionState
from scheduler.survey import JOB_VALUE, Survey, _RateTable
from scheduler.tick import plan_tick, with_recoveries

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Objects = npt.NDArray[np.object_]
T = TypeVar("T")

_WAITING, _QUEUED, _RUNNING, _SUSPENDED, _NOT_LIVE = 0, 1, 2, 3, -1
_STATE_CODE = {JobState.PENDING: _WAITING, JobState.PREEMPTED: _WAITING,
               JobState.QUEUED: _QUEUED, JobState.RUNNING: _RUNNING,
               JobState.SUSPENDED: _SUSPENDED}

_FLOATS = ("submitted", "deadline", "waiting", "service", "level_service", "units", "load",
           "base", "prog", "pre", "value", "next_units", "fair_weight")
_INTS = ("state", "cls_rank", "key", "left", "level", "tenant")
_BOOLS = ("realtime", "batch", "preempt", "on_standby", "estimated", "shed", "deps", "by_key",
          "grouped", "group_truthy", "recover")


class _Columns:
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
                _same_bits(a, b) for a, b in zip(last[0], inputs, strict=True)):
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
        key_of, names = self.key_of, self.key_names
        for j in views:
            if j.cost_key not in key_of:
                key_of[j.cost_key] = len(names)
                names.append(j.cost_key)
        i["key"][at] = [key_of[j.cost_key] for j in views]
        tenant_of, tenants = self.tenant_of, self.tenant_names
        for j in views:
            if j.tenant not in tenant_of:
                tenant_of[j.tenant] = len(tenants)
                tenants.append(j.tenant)
        i["tenant"][at] = [tenant_of[j.tenant] for j in views]
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
class _Tick:
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


class IncrementalPlanner:
    """``IncrementalPlanner().plan(snapshot, policy, now_s)`` equals
    ``plan_tick(snapshot, policy, now_s)``; held across ticks, it reads only the job views that
    are new since the last tick. Not thread-safe: one planner per ticking process."""

    def __init__(self) -> None:
        self._columns: _Columns | None = None

    @property
    def views_read(self) -> int:
        """Job views read into columns since the columns were last rebuilt."""
        return 0 if self._columns is None else len(self._columns.views)

    def plan(self, snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
        """``plan_tick(snapshot, policy, now_s)``."""
        if policy.policy is not PolicyKind.STEPLINE:
            return plan_tick(snapshot, policy, now_s)
        columns = self._columns
        if columns is None or (columns.policy is not policy and columns.policy != policy):
            columns = self._columns = _Columns(policy)
        rows = columns.rows(snapshot.jobs)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            plan = _Planning(columns, snapshot, policy, now_s).plan(rows)
        recovering = np.flatnonzero(columns.b["recover"][rows]).tolist()
        jobs = snapshot.jobs
        return with_recoveries(snapshot, policy, now_s, plan, [jobs[k] for k in recovering])


class _Planning:
    """One tick of :class:`IncrementalPlanner`: ``scheduler.planner.plan_stepline``'s steps,
    each over arrays where the readable step walks every job."""

    def __init__(self, columns: _Columns, snapshot: ClusterSnapshot, policy: PolicyConfig,
                 now_s: float) -> None:
        self.c, self.snapshot, self.policy, self.now_s = columns, snapshot, policy, now_s
        self.fair: tuple[Floats, ...] = ()
        """Under fair share, the fair key of every job as four arrays (band, urgency, start
        tag, warm 0 / cold 1); empty: off, or ranked by the readable order."""

    def plan(self, all_rows: Ints) -> TickPlan:
        snapshot, policy, now_s = self.snapshot, self.policy, self.now_s
        live_mask = self.c.i["state"][all_rows] >= 0
        alive = tuple(w for w in snapshot.workers if w.alive)
        survey, tick = self._survey(snapshot, all_rows, live_mask, alive)
        growths = GrowthTable(snapshot.cost, policy.batching, policy.cost_min_samples)
        judgement, scores = self._judge(survey, tick, len(alive), growths)
        origin = choose_origin(survey, judgement, policy, _top(scores, policy.top_scores))
        levels = settle_levels(survey, judgement, origin, policy, now_s)
        behind = judgement.demoted | judgement.deferred
        ranking = Ranking(survey, levels, behind, policy, now_s)
        self._keys(tick, behind)
        if policy.fair_share.enabled:
            ranking = (with_fair_share(ranking, snapshot.service) if levels.inherited
                       else self._fair(ranking, tick))
        order = Order(alive, survey, judgement, origin, levels, ranking, growths)
        flight, pool = self._flight(order, tick)
        cap = len(alive) * policy.slots_per_worker
        reserve = hold_reserve(order, flight.staying, snapshot.state, policy, now_s,
                               self._realtime_slack(tick, judgement.demoted))
        if levels.inherited:
            ranked = ranked_candidates(order, flight, cap, policy)
        else:
            ranked = self._ranked(order, flight, pool, tick, cap)
        allocation = allocate_ranked(order, flight, ranked, reserve.workers, cap, policy)
        standby = (*flight.standby, *allocation.trimmed)
        restored = self._fill_idle(order, flight, allocation, standby, cap, tick)
        emit = _Emit(order, flight, allocation, reserve, snapshot.state, policy, now_s,
                     self._estimates(tick))
        return emit.plan(standby, cap, restored)

    def _estimates(self, tick: _Tick) -> dict[str, float]:
        """The first estimates (service so far + remaining) of the jobs without one on record,
        by id in survey order: the last tick's mapping again when the same rows come to the
        same float bits, as when nothing moved and the cost model stood still (plans share
        it: a plan's estimates are read, never written)."""
        c = self.c
        not_estimated = ~c.b["estimated"][tick.rows]
        rows = tick.rows[not_estimated]
        values = (c.f["service"][tick.rows] + tick.remaining)[not_estimated]
        last = c.estimates
        if (last is not None and np.array_equal(last[0], rows)
                and np.array_equal(last[1].view(np.int64), values.view(np.int64))):
            return last[2]
        estimates = dict(zip(c.ids[rows].tolist(), values.tolist(), strict=True))
        c.estimates = (rows, values, estimates)
        return estimates

    # -- survey (scheduler.survey.survey_jobs) ----------------------------------------------

    def _survey(self, snapshot: ClusterSnapshot, all_rows: Ints, live_mask: Bools,
                alive: tuple[WorkerView, ...]) -> tuple[Survey, _Tick]:
        c, policy, now_s = self.c, self.policy, self.now_s
        f, b = c.f, c.b
        if live_mask.all():  # as a snapshot of live records is
            rows, live = all_rows, tuple(snapshot.jobs)
        else:
            rows = all_rows[live_mask]
            live = tuple(compress(snapshot.jobs, live_mask.tolist()))
        state = c.i["state"][rows]
        table = _RateTable(snapshot.cost, [w.device for w in alive], policy.cost_min_samples)
        keys = c.i["key"][rows]
        rates = np.zeros(len(c.key_names))
        sure_of = np.zeros(len(c.key_names), np.bool_)
        for k in np.flatnonzero(np.bincount(keys, minlength=len(c.key_names))).tolist():
            rates[k] = table.learn(c.key_names[k])
            sure_of[k] = table.confident[c.key_names[k]]
        remaining = f["units"][rows] * rates[keys]
        sure = sure_of[keys]
        for k in np.flatnonzero(b["by_key"][rows]).tolist():
            remaining[k], sure[k] = table.remaining_s(live[k])
        remaining = remaining + c.i["left"][rows] * policy.hop_overhead_s
        remaining = remaining + f["load"][rows]  # + 0.0 where warm: the same floats
        deadline = f["deadline"][rows]
        finish = now_s + remaining
        late = (finish > deadline + policy.expire_grace_s) & sure
        waiting = state == _WAITING
        running = state == _RUNNING
        suspended = state == _SUSPENDED
        waited = now_s - f["waiting"][rows]
        t = ScoreTerms.from_policy(policy)
        bound_s = policy.aging_bound_s
        wait_term = np.where(running, 0.0, np.where(
            waited >= bound_s, t.wait_max, np.where(waited > 0.0, t.wait_per_s * waited, 0.0)))
        submitted = f["submitted"][rows]
        budget = deadline - submitted
        spent = (finish - submitted) / budget
        slack_term = np.where(budget <= 0.0, t.slack, np.where(
            spent >= 1.0, t.slack, np.where(spent > 0.0, t.slack * spent, 0.0)))
        scores = f["base"][rows] + slack_term
        scores = scores + wait_term
        tail = t.short / (remaining + t.short_s)
        tail = f["prog"][rows] + tail
        tail = tail + f["pre"][rows]
        scores = scores + tail
        due_in = deadline - now_s
        horizon_s = policy.load_horizon_s
        demand = np.where(due_in <= horizon_s, remaining, remaining * horizon_s / due_in)
        outstanding = float(np.cumsum(np.concatenate(([0.0], demand[~suspended])))[-1])
        loads = f["load"][rows]
        cold_demand = np.where(due_in <= horizon_s, loads, loads * horizon_s / due_in)
        cold = float(np.cumsum(np.concatenate(([0.0], cold_demand[~suspended])))[-1])
        realtime = b["realtime"][rows]
        queued_or_running = (state == _QUEUED) | running
        holding = queued_or_running & ~b["preempt"][rows]
        on_standby = b["on_standby"][rows]
        incumbent: int | None = None
        origin_id = snapshot.state.origin_id
        if origin_id is not None:
            # the row last read for that id first (job ids are unique in a snapshot); else
            # every live job's id
            row = c.row_of_id.get(origin_id)
            found = np.flatnonzero(rows == row) if row is not None else np.zeros(0, np.int64)
            if not found.size:
                found = np.flatnonzero(c.ids[rows] == origin_id)
            incumbent = int(found[-1]) if found.size else None
        waiting_rt = np.flatnonzero(waiting & realtime)
        waiting_other = np.flatnonzero(waiting & ~realtime)
        suspended_at = np.flatnonzero(suspended)
        standby = np.flatnonzero(holding & on_standby)
        late_at = np.flatnonzero(late)
        frozen = c.frozen
        survey = Survey(
            live=live, remaining_s=frozen("remaining", remaining),
            values=frozen("values", f["value"][rows]), scores=tuple(scores.tolist()),
            waiting_realtime=frozen("waiting_realtime", waiting_rt),
            waiting_other=frozen("waiting_other", waiting_other),
            suspended=frozen("suspended", suspended_at),
            inflight=frozen("inflight", np.flatnonzero(holding & ~on_standby)),
            standby=frozen("standby", standby),
            aged=frozen("aged", np.flatnonzero(waiting & (waited >= bound_s))),
            late=frozen("late", late_at), with_deps=frozen("with_deps",
                                                           np.flatnonzero(b["deps"][rows])),
            outstanding_s=outstanding, cold_s=cold,
            paid_share=paid_load_share(alive, policy.load_window_s, now_s), incumbent=incumbent)
        return survey, _Tick(rows, state, remaining, demand, deadline, waited, scores,
                             np.zeros(len(rows)), np.zeros(len(rows)), waiting_rt,
                             waiting_other, suspended_at, standby, late_at)

    # -- judgement (scheduler.judgement.judge) ----------------------------------------------

    def _judge(self, survey: Survey, tick: _Tick, workers: int,
               growths: GrowthTable) -> tuple[Judgement, Floats]:
        policy, now_s = self.policy, self.now_s
        figures = measure_loads(survey.outstanding_s - self._batching_gain(survey, tick, growths),
                                survey.cold_s, survey.paid_share, workers, policy)
        load = figures.governing(policy)
        admission = next_admission_state(self.snapshot.state.admission, load, policy)
        converging = admission is AdmissionState.CONVERGING
        late = tick.late
        shed = self.c.b["shed"][tick.rows[late]] & converging
        expired = {i: reason for i in late[shed].tolist() if (reason := expiry_reason(
            survey.live[i], survey.remaining_s[i], load, policy, now_s)) is not None}
        demoted = frozenset(late[~shed].tolist())
        blocked = self._blocked(survey, tick)
        skip = tick.state == _SUSPENDED
        for i in (*demoted, *blocked, *expired):
            skip[i] = True
        deferred = self._defer(tick, np.flatnonzero(~skip), workers)
        if not (expired or demoted or deferred):
            return Judgement(load, admission, expired, demoted, blocked, deferred,
                             survey.scores, figures), tick.scores
        scores = tick.scores.copy()
        if expired:
            scores[list(expired)] = -1.0
        if demoted:
            scores[list(demoted)] = 0.0
        if deferred:
            at = list(deferred)
            scores[at] = np.where(scores[at] > 0.0, 0.0, scores[at])
        judgement = Judgement(load, admission, expired, demoted, blocked, deferred,
                              tuple(scores.tolist()), figures)
        return judgement, scores

    def _batching_gain(self, survey: Survey, tick: _Tick, growths: GrowthTable) -> float:
        """``judgement.batching_gain_s``: groups in order of their first member, members in
        index order, each adding saved × its demand."""
        batching, c = self.policy.batching, self.c
        if not batching.enabled or not c.b["group_truthy"][tick.rows].any():
            return 0.0
        members = np.flatnonzero(c.b["grouped"][tick.rows] & (tick.state != _SUSPENDED))
        if not members.size:
            return 0.0
        codes = c.group[tick.rows[members]]
        unique, first, inverse, counts = np.unique(codes, return_index=True,
                                                   return_inverse=True, return_counts=True)
        saved = np.zeros(len(unique))
        pays = np.zeros(len(unique), np.bool_)
        for g in range(len(unique)):
            growth = growths.of(survey.live[int(members[first[g]])])
            size = min(int(counts[g]), batching.max_batch)
            if size >= 2 and batching.pays(growth):
                saved[g], pays[g] = 1.0 - batch_slowdown(growth, size) / size, True
        inverse = inverse.reshape(-1)
        counted = pays[inverse]
        rank_of_group = np.argsort(np.argsort(first, kind="stable"), kind="stable")
        gains = (saved[inverse] * tick.demand[members])[counted]
        walk = np.lexsort((members[counted], rank_of_group[inverse][counted]))
        return float(np.cumsum(np.concatenate(([0.0], gains[walk])))[-1])

    def _blocked(self, survey: Survey, tick: _Tick) -> frozenset[int]:
        if not survey.with_deps:
            return frozenset()
        live = survey.live
        ids = set(self.c.ids[tick.rows].tolist())
        return frozenset(i for i in survey.with_deps
                         if live[i].state is not JobState.RUNNING
                         and live[i].state is not JobState.QUEUED
                         and any(dep in ids for dep in live[i].depends_on))

    def _defer(self, tick: _Tick, runnable: Ints, workers: int) -> frozenset[int]:
        """``judgement._defer_overcommitted`` (Moore-Hodgson): the running sum of work in
        deadline order is compared with the room a block at a time (a cumulative sum from the
        running total, so each partial sum is the readable loop's float); the heap of the
        jobs seen so far is built only when some job does not fit. The heap holds each job's
        rank in the readable heap's order of (key, index) — one sort up front instead of a
        tuple per job and tuple comparisons — unless a key is NaN (then the tuples)."""
        order = self.c.kept("defer order", (runnable, tick.deadline[runnable]), lambda: runnable[
            np.argsort(tick.deadline[runnable], kind="stable")])
        n = len(order)
        if not n:
            return frozenset()
        work_of = tick.remaining[order]
        room = (tick.deadline[order] - self.now_s) * max(workers, 1)
        heap: list[int] = []
        deferred: list[int] = []
        push, pop = heapq.heappush, heapq.heappop
        work_s, start, pushed, block, dense = 0.0, 0, 0, n, False
        entries: list[int] = []
        """Per position in ``order``: its heap entry (its rank)."""
        index_of: list[int] = []
        work_by: list[float] = []
        """Per rank: the job's survey index and its work."""
        room_list: list[float] = []
        work_list: list[float] = []
        while start < n:
            if dense:
                # Jobs that do not fit come close together: the readable loop, a stretch at a
                # time, until a stretch fits whole.
                stop, hit = min(start + 64, n), False
                for k in range(start, stop):
                    work_s += work_list[k]
                    push(heap, entries[k])
                    if work_s > room_list[k]:
                        hit = True
                        while work_s > room_list[k] and heap:
                            e = pop(heap)
                            work_s -= work_by[e]
                            deferred.append(index_of[e])
                start = pushed = stop
                dense, block = hit, 64
                continue
            end = min(start + block, n)
            sums = np.cumsum(np.concatenate(([work_s], work_of[start:end])))[1:]
            over = sums > room[start:end]
            if not over.any():
                work_s, start, block = float(sums[-1]), end, min(block * 2, 4096)
                continue
            at = start + int(over.argmax())
            work_s = float(sums[at - start])
            if not entries:
                keys = (-work_of) / self.c.f["value"][tick.rows[order]]
                if np.isnan(keys).any():
                    return self._defer_tuples(tick, order, room, workers)
                entries, index_of, work_by, work_list = self.c.kept(
                    "defer ranks", (order, keys, work_of), partial(_ranks, order, keys, work_of))
                room_list = room.tolist()
            fresh = entries[pushed:at + 1]
            if len(fresh) > len(heap) // 4:
                heap.extend(fresh)
                heapq.heapify(heap)
            else:
                for item in fresh:
                    push(heap, item)
            pushed = at + 1
            while work_s > room_list[at] and heap:
                e = pop(heap)
                work_s -= work_by[e]
                deferred.append(index_of[e])
            start, dense = at + 1, True
        return frozenset(deferred)

    def _defer_tuples(self, tick: _Tick, order: Ints, room: Floats,
                      workers: int) -> frozenset[int]:
        """:meth:`_defer` as the readable loop, for keys no sort can rank as the heap
        compares them (a NaN)."""
        keys = ((-tick.remaining[order]) / self.c.f["value"][tick.rows[order]]).tolist()
        remaining = tick.remaining.tolist()
        heap: list[tuple[float, int]] = []
        deferred: list[int] = []
        work_s = 0.0
        for k, i in enumerate(order.tolist()):
            work_s += remaining[i]
            heapq.heappush(heap, (keys[k], i))
            while work_s > room[k] and heap:
                _, j = heapq.heappop(heap)
                work_s -= remaining[j]
                deferred.append(j)
        return frozenset(deferred)

    # -- ranking (Ranking.keys for every job) ------------------------------------------------

    def _keys(self, tick: _Tick, behind: frozenset[int]) -> None:
        policy, now_s = self.policy, self.now_s
        bound_s = policy.aging_bound_s
        waited = np.where(tick.state == _RUNNING, 0.0, tick.waited)
        slack = tick.deadline - now_s - tick.remaining
        tie = tick.remaining / self.c.f["value"][tick.rows]
        late = slack < 0.0
        if behind:
            late[list(behind)] = True
        aged = 1.0 + np.where(waited > 0.0, waited, 0.0) / bound_s
        k1 = np.where(late, tie * policy.late_penalty / aged,
                      tie * np.where(waited > bound_s, bound_s / waited, 1.0))
        tick.k1[:] = k1
        tick.k2[:] = np.where(late, tie, slack)

    # -- fair share (scheduler.ordering.fair_order) -----------------------------------------

    def _fair(self, ranking: Ranking, tick: _Tick) -> Ranking:
        """``ordering.fair_order`` without inheritance, over the columns: the chunk estimates,
        urgencies and charges as arrays; the join (``fairness.join`` itself) on the tenants of
        the contending rows and the in-flight rows' charges; each (band, tenant)'s counter
        looked up once; the start tags a sequential cumulative sum per tenant, in the order
        ``fairness.fair_keys`` walks (band, tenant, urgency, in flight first, key, index)."""
        c, config, rows = self.c, self.policy.fair_share, tick.rows
        remaining, units, after = tick.remaining, c.f["units"][rows], c.f["next_units"][rows]
        chunk = np.where((after > 0.0) & (units > 0.0), remaining * after / units,
                         remaining / np.maximum(c.i["left"][rows], 1))
        slack = tick.deadline - self.now_s - remaining
        past = slack < 0.0
        if ranking.behind:
            past[list(ranking.behind)] = True
        urgency = np.where(past, PAST_SAVING, np.where(slack < chunk, URGENT, ON_TIME))
        in_flight = (tick.state == _QUEUED) | (tick.state == _RUNNING)
        charge = chunk / c.f["fair_weight"][rows]
        band, tenant = c.i["cls_rank"][rows], c.i["tenant"][rows]
        ledger = self.snapshot.service or ServiceLedger()
        virtual = self._virtual(ledger, config)
        joined = join(ledger, self._contending(tick, band, tenant), config,
                      self._in_flight(band, tenant, charge, in_flight), virtual)
        # one small integer for (band, tenant, urgency, in flight first): the sort is stable,
        # so the index needs no key of its own
        within = ((band * len(c.tenant_names) + tenant) * 3 + urgency) * 2 + ~in_flight
        walk = self._walk(within, tick.k1, tick.k2, rows)
        # no lift: the joined ledger's counters are the ledger's
        counters = virtual if not joined.lifts else joined.ledger.virtual(config)
        start = self._start_tags(walk, band * len(c.tenant_names) + tenant, charge, counters,
                                 rows)
        self.fair = (band.astype(np.float64), urgency.astype(np.float64), start,
                     np.where(c.f["load"][rows] <= 0.0, 0.0, 1.0))
        return replace(ranking, fair=_FairKeys(self.fair), joined=joined)

    def _virtual(self, ledger: ServiceLedger, config: FairShareConfig) -> dict[TenantKey, float]:
        """``ledger.virtual(config)``: the last tick's counters again when the measured
        seconds, the lifts and the weights are those of then (no chunk committed, none
        joined), as they are at most ticks."""
        last = self.c.virtual
        if (last is not None and last[2] == config and last[0] == ledger.service_s
                and last[1] == ledger.lift):
            return last[3]
        virtual = ledger.virtual(config)
        self.c.virtual = (dict(ledger.service_s), dict(ledger.lift), config, virtual)
        return virtual

    def _walk(self, code: Ints, k1: Floats, k2: Floats, rows: Ints) -> Ints:
        """``np.lexsort((k2, k1, code))``: the last tick's walk again where it still holds,
        the rows it no longer orders (new, changed, moved past a neighbour) sorted apart
        and merged in by a binary search; the full sort when no walk is kept, a key is NaN
        or many rows moved."""
        c = self.c
        last, c.fair_walk = c.fair_walk, None
        if np.isnan(k1).any() or np.isnan(k2).any():  # no order a search can keep
            return _lexsort3(k2, k1, code)
        if last is None:
            walk = _lexsort3(k2, k1, code)
        elif _same_bits(last[0], rows):  # the same rows at the same places
            walk = _repaired_walk(code, k1, k2, last[1])
        else:
            position = np.full(len(c.views), -1, np.int64)
            position[rows] = np.arange(len(rows))
            kept = position[last[0][last[1]]]
            walk = _repaired_walk(code, k1, k2, kept[kept >= 0])
        c.fair_walk = (rows, walk)
        return walk

    def _contending(self, tick: _Tick, band: Ints, tenant: Ints) -> frozenset[TenantKey]:
        """``ordering.active_tenants``: the (band, tenant) of every row not suspended."""
        names = self.c.tenant_names
        count = np.bincount((band * len(names) + tenant)[tick.state != _SUSPENDED],
                            minlength=len(BAND_NAMES) * len(names))
        codes = np.flatnonzero(count)
        last = self.c.contending
        if last is not None and last[0] == len(names) and _same_bits(last[1], codes):
            return last[2]
        out = frozenset((BAND_NAMES[code // len(names)], names[code % len(names)])
                        for code in codes.tolist())
        self.c.contending = (len(names), codes, out)
        return out

    def _in_flight(self, band: Ints, tenant: Ints, charge: Floats,
                   in_flight: Bools) -> dict[TenantKey, float]:
        """``fairness.in_flight_charges``: the in-flight rows' charges summed in index order."""
        out: dict[TenantKey, float] = {}
        names = self.c.tenant_names
        at = np.flatnonzero(in_flight)
        for b, t, value in zip(band[at].tolist(), tenant[at].tolist(), charge[at].tolist(),
                               strict=True):
            key = (BAND_NAMES[b], names[t])
            out[key] = out.get(key, 0.0) + value
        return out

    def _start_tags(self, walk: Ints, code: Ints, charge: Floats,
                    counters: dict[TenantKey, float], rows: Ints) -> Floats:
        """:func:`_walked_tags` in the rows' order, again only for the (band, tenant)s whose
        rows along the walk, charges or counter are not those of the last tick (when each
        holds the same places of the walk as then)."""
        walk_rows, walked, codes = rows[walk], charge[walk], code[walk]
        base = self._bases(counters)
        last = self.c.fair_tags
        if last is None or not (_same_bits(last[2], codes) and last[3].shape == base.shape):
            tags = _walked_tags(codes, walked, base)
        else:
            moved = last[3].view(np.int64) != base.view(np.int64)
            dirty = ((last[0] != walk_rows) | (last[1].view(np.int64) != walked.view(np.int64))
                     | moved[codes])
            tags = last[4]
            if dirty.any():
                group = np.cumsum(np.concatenate(([True], codes[1:] != codes[:-1]))) - 1
                again = np.zeros(int(group[-1]) + 1, np.bool_)
                again[group[dirty]] = True
                redo = again[group]
                tags = tags.copy()
                tags[redo] = _walked_tags(codes[redo], walked[redo], base)
        self.c.fair_tags = (walk_rows, walked, codes, base, tags)
        out = np.empty(len(walk))
        out[walk] = tags
        return out

    def _bases(self, counters: dict[TenantKey, float]) -> Floats:
        """Each (band, tenant) code's counter (0: none), kept while ``counters`` is the same
        mapping (:meth:`_virtual` hands the last one back while nothing changed)."""
        names, tenant_of = self.c.tenant_names, self.c.tenant_of
        last, size = self.c.bases, len(BAND_NAMES) * len(names)
        if last is not None and last[0] is counters and len(last[1]) == size:
            return last[1]
        base = np.zeros(size)
        for (band, tenant), value in counters.items():
            if band in BAND_NAMES and tenant in tenant_of:
                base[BAND_NAMES.index(band) * len(names) + tenant_of[tenant]] = value
        self.c.bases = (counters, base)
        return base

    # -- flight (scheduler.allocation.plan_flight) ------------------------------------------

    def _levels(self, levels: Levels, tick: _Tick) -> Ints:
        """``levels.level(i)`` of every job."""
        c, policy = self.c, self.policy
        rows = tick.rows
        quantum0_s, quantum1_s = policy.level_quanta_s
        remaining = self._work(tick)
        size = np.where(remaining <= quantum0_s, 0, np.where(remaining <= quantum1_s, 1, 2))
        joined = np.maximum(c.i["cls_rank"][rows], size)
        level = c.i["level"][rows]
        quanta = np.array([quantum0_s, quantum1_s, math.inf])[np.clip(level, 0, 2)]
        used = c.f["service"][rows] - c.f["level_service"][rows]
        marked = np.where(level < 0, joined, np.where(
            (level < LOWEST_LEVEL) & (used >= quanta), level + 1, level))
        waited = tick.waited
        steps = np.where(waited > 0, np.floor_divide(waited, policy.aging_bound_s), 0.0)
        steps = np.minimum(steps, 1 << 30).astype(np.int64)
        floor = np.where(c.b["realtime"][rows], 0, 1)
        aged = np.maximum(np.minimum(marked, floor), marked - steps)
        own = np.where((marked == 0) | (tick.state == _RUNNING) | (steps <= 0), marked, aged)
        if levels.demoted:
            own[list(levels.demoted)] = LOWEST_LEVEL
        if levels.origin is not None:
            own[levels.origin] = 0
        for i, inherited in levels.inherited.items():
            own[i] = min(int(own[i]), inherited)
        return own

    def _work(self, tick: _Tick) -> Floats:
        """``levels.work_s(i)`` of every job: remaining seconds without the expected load."""
        load = self.c.f["load"][tick.rows]
        return np.where(load > 0.0, tick.remaining - load, tick.remaining)

    def _flight(self, order: Order, tick: _Tick) -> tuple[Flight, Ints]:
        judgement, survey, levels = order.judgement, order.survey, order.levels
        converging = judgement.converging
        n = len(tick.rows)
        level = self._levels(levels, tick) if converging else np.zeros(n, np.int64)
        lowest = level == LOWEST_LEVEL
        suspend: tuple[int, ...] = ()
        standby: tuple[int, ...] = ()
        out = np.zeros(n, np.bool_)
        if converging:
            suspended = self._suspend(order, tick, lowest)
            suspend = self.c.frozen("suspend", suspended)
            out[suspended] = True
            standby = tuple(i for i in survey.inflight
                            if i not in judgement.expired and lowest[i])
        gone = {*judgement.expired, *suspend, *standby, *judgement.blocked}
        staying = tuple(i for i in survey.inflight if i not in gone)
        if levels.origin is not None:
            gone.add(levels.origin)
        excluded = frozenset(gone)
        few = [*judgement.expired, *standby, *judgement.blocked]
        if levels.origin is not None:
            few.append(levels.origin)
        if few:
            out[few] = True
        waiting = np.concatenate((tick.waiting_realtime, tick.waiting_other))
        standing = tick.standby
        keep = ~out[standing]
        if converging:
            keep &= ~lowest[standing]
        parts = [waiting[~out[waiting]], standing[keep]]
        if not converging:
            parts.append(np.asarray(self._restorable(order, tick, out), np.int64))
        pool = np.concatenate(parts)
        flight = Flight(suspend, standby, staying, frozenset(staying), excluded,
                        self.c.frozen("pool", pool))
        return flight, pool

    def _suspend(self, order: Order, tick: _Tick, lowest: Bools) -> Ints:
        levels, judgement, policy, c = order.levels, order.judgement, self.policy, self.c
        rows = tick.rows
        # Levels.at_lowest of every job
        new = c.i["level"][rows] < 0
        fits = (self._work(tick) <= policy.level_quanta_s[1]) & ~c.b["batch"][rows]
        fresh_lowest = ~fits & (tick.waited < policy.aging_bound_s)
        at_lowest = np.where(new, fresh_lowest, lowest)
        if judgement.demoted:
            at_lowest[list(judgement.demoted)] = True
        kept = np.zeros(len(rows), np.bool_)
        held_back = [*levels.inherited, *judgement.expired]
        if levels.origin is not None:
            held_back.append(levels.origin)
        if held_back:
            kept[held_back] = True
        other, realtime = tick.waiting_other, tick.waiting_realtime
        held = other[~kept[other] & (c.b["batch"][rows[other]] | at_lowest[other])]
        urgent = realtime[~kept[realtime] & at_lowest[realtime]]
        return np.concatenate((held, urgent))

    def _restorable(self, order: Order, tick: _Tick, out: Bools) -> list[int]:
        policy, survey = self.policy, order.survey
        room = (policy.convergence_threshold - policy.convergence_hysteresis
                - order.judgement.load) * max(len(order.alive), 1) * policy.load_horizon_s
        resumable = tick.suspended[~out[tick.suspended]]
        chosen: list[int] = []
        for i in self._earliest(resumable, policy.resume_per_tick, tick):
            if survey.remaining_s[i] > room:
                break
            room -= survey.remaining_s[i]
            chosen.append(i)
        return chosen

    def _earliest(self, indices: Ints, count: int, tick: _Tick) -> list[int]:
        """``heapq.nsmallest(count, indices, key=submitted)``: ties in the given order."""
        if count <= 0 or not indices.size:
            return []
        submitted = self.c.f["submitted"][tick.rows[indices]]
        return indices[np.argsort(submitted, kind="stable")[:count]].tolist()  # type: ignore[no-any-return]

    # -- allocation and reserve --------------------------------------------------------------

    def _ranked(self, order: Order, flight: Flight, pool: Ints, tick: _Tick,
                cap: int) -> list[int]:
        """``allocation.ranked_candidates`` without inheritance: ``rank(i)`` is
        ``(1, *keys(i))`` but for the origin (band 0)."""
        batching, c = self.policy.batching, self.c
        shared = batching.enabled and bool(c.b["grouped"][tick.rows[pool]].any())
        take = cap * (batching.max_batch if shared else 1) + len(flight.staying)
        # under fair share the fair key goes first: (band, urgency, start tag, warm)
        ahead = self.fair[::-1]
        k1, k2 = tick.k1[pool], tick.k2[pool]
        chosen = np.arange(len(pool))
        if ahead:
            best = self._fair_best(pool, take, tick)
        else:
            if take < len(pool):
                bar = np.partition(k1, take - 1)[take - 1]
                chosen = np.flatnonzero(k1 <= bar)
            best = chosen[np.lexsort((chosen, k2[chosen], k1[chosen]))][:take]
        candidates = [*flight.staying, *pool[best].tolist()]
        origin = order.levels.origin
        if origin is not None and origin_waits(order, flight, origin):
            candidates.append(origin)
        at = np.asarray(candidates, np.int64)
        band = np.ones(len(at), np.int64)
        if origin is not None:
            band[at == origin] = 0
        fair_at = [a[at] if origin is None else np.where(band == 0, 0.0, a[at])
                   for a in ahead]
        walk = np.lexsort((np.arange(len(at)), tick.k2[at], tick.k1[at], *fair_at, band))
        return at[walk].tolist()  # type: ignore[no-any-return]

    def _fair_best(self, pool: Ints, take: int, tick: _Tick) -> Ints:
        """The ``take`` best of the pool (positions in it) by (fair key, key, index): whole
        (band, urgency) classes while they fit, then the least start tags of the class that
        does not (ties at the bar kept), and only those sorted."""
        if take <= 0:  # no slot (no alive worker): no class to fill, none to cut
            return np.zeros(0, np.int64)
        band, urgency, start, warm = (a[pool] for a in self.fair)
        k1, k2 = tick.k1[pool], tick.k2[pool]
        chosen = np.arange(len(pool))
        if take < len(pool):
            klass = (band * 3 + urgency).astype(np.int64)
            filled = np.cumsum(np.bincount(klass))
            edge = int(np.searchsorted(filled, take))
            need = take - (int(filled[edge - 1]) if edge else 0)
            edges = start[klass == edge]
            bar = np.partition(edges, need - 1)[need - 1]
            keep = (klass < edge) | ((klass == edge) & ((start <= bar) | np.isnan(bar)))
            chosen = np.flatnonzero(keep)
        return chosen[np.lexsort((chosen, k2[chosen], k1[chosen], warm[chosen], start[chosen],
                                  urgency[chosen], band[chosen]))][:take]

    def _realtime_slack(self, tick: _Tick, demoted: frozenset[int]) -> tuple[bool, float]:
        """``reserve._realtime_slack``."""
        c, rows = self.c, tick.rows
        realtime = c.b["realtime"][rows].copy()
        if demoted:
            realtime[list(demoted)] = False
        if not realtime.any():
            return False, math.inf
        slack = (tick.deadline - c.f["submitted"][rows] - c.f["service"][rows]
                 - tick.remaining)[realtime]
        slack = slack[slack > 0]
        return True, float(slack.min()) if slack.size else math.inf

    def _fill_idle(self, order: Order, flight: Flight, allocation: Allocation,
                   standby: tuple[int, ...], cap: int, tick: _Tick) -> tuple[int, ...]:
        """``allocation.fill_idle``."""
        idle = idle_slots(order, flight, allocation, standby, cap)
        if idle <= 0:
            return ()
        suspended = tick.suspended
        out = {*flight.excluded, *order.judgement.blocked}
        if out:
            mask = np.zeros(len(tick.rows), np.bool_)
            mask[list(out)] = True
            suspended = suspended[~mask[suspended]]
        return tuple(self._earliest(suspended, idle, tick))


class _FairKeys(Sequence[FairKey]):
    """``Ranking.fair`` over the four key arrays (read by index for the few jobs ranked one
    at a time, as the preemption's holders are)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: tuple[Floats, ...]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys[0])

    def __getitem__(self, i: int) -> FairKey:  # type: ignore[override]
        band, urgency, start, warm = self._keys
        return (float(band[i]), float(urgency[i]), float(start[i]), float(warm[i]))


def _lexsort3(k2: Floats, k1: Floats, code: Ints) -> Ints:
    """``np.lexsort((k2, k1, code))`` (``code`` >= 0 first, then ``k1``, ``k2``, the index),
    faster: each float replaced by its dense rank (an unstable sort, then a count of new
    values), the four folded into one distinct integer, which any sort puts in the one order.
    A NaN (no rank) or a fold past 63 bits: ``np.lexsort`` itself."""
    n = len(code)
    if not n or np.isnan(k1).any() or np.isnan(k2).any():
        return np.lexsort((k2, k1, code))
    r1, r2 = _dense_rank(k1), _dense_rank(k2)
    m1, m2, top = int(r1.max()) + 1, int(r2.max()) + 1, int(code.max()) + 1
    if top * m1 * m2 * n >= 1 << 63:
        return np.lexsort((k2, k1, code))
    return np.argsort(((code * m1 + r1) * m2 + r2) * n + np.arange(n))


_WALK_KEY = np.dtype([("code", np.int64), ("k1", np.float64), ("k2", np.float64),
                      ("at", np.int64)])
"""One row of the fair walk's key: a structured value compares field by field, as
``np.lexsort`` orders (the index last)."""


def _walked_tags(codes: Ints, walked: Floats, base: Floats) -> Floats:
    """Each start tag along a walk: its (band, tenant)'s counter (``base[code]``) plus the
    charges before it along the walk of the same (band, tenant), summed from zero in that
    order (a cumulative sum along each row of a padded table: sequential, so the readable
    loop's floats)."""
    n = len(codes)
    if not n:
        return np.zeros(0)
    cut = np.concatenate(([True], codes[1:] != codes[:-1]))
    group = np.cumsum(cut) - 1
    begins = np.flatnonzero(cut)
    place = np.arange(n) - begins[group]
    sizes = np.diff(np.concatenate((begins, [n])))
    before = np.zeros(n)
    if int(sizes.max()) * len(begins) <= 4 * n + 4096:
        table = np.zeros((len(begins), int(sizes.max())))
        table[group, place] = walked
        summed = np.cumsum(table, axis=1)
        later = place > 0
        before[later] = summed[group[later], place[later] - 1]
    else:  # a few tenants hold most rows: one cumulative sum per tenant
        for lo, size in zip(begins.tolist(), sizes.tolist(), strict=True):
            before[lo + 1:lo + size] = np.cumsum(walked[lo:lo + size - 1])
    return base[codes] + before


def _walk_keys(code: Ints, k1: Floats, k2: Floats, at: Ints) -> npt.NDArray[np.void]:
    keys = np.empty(len(at), _WALK_KEY)
    keys["code"], keys["k1"], keys["k2"], keys["at"] = code[at], k1[at], k2[at], at
    return keys


def _in_order(code: Ints, k1: Floats, k2: Floats, at: Ints) -> Bools:
    """Whether each position of ``at`` comes before the next by (code, k1, k2, index)."""
    c, f, g = code[at], k1[at], k2[at]
    later = (g[:-1] < g[1:]) | ((g[:-1] == g[1:]) & (at[:-1] < at[1:]))
    later = (f[:-1] < f[1:]) | ((f[:-1] == f[1:]) & later)
    return (c[:-1] < c[1:]) | ((c[:-1] == c[1:]) & later)  # type: ignore[no-any-return]


def _repaired_walk(code: Ints, k1: Floats, k2: Floats, kept: Ints) -> Ints:
    """The positions in ascending (code, k1, k2, index), from ``kept`` (the last walk's
    positions still here, in its order): those less both of each pair out of order (again
    until none is), the rest sorted apart and merged in (``np.searchsorted`` on structured
    keys, which compare field by field). The full sort when more than an eighth moved."""
    n = len(code)
    loose: list[Ints] = []
    if len(kept) < n:
        seen = np.zeros(n, np.bool_)
        seen[kept] = True
        loose.append(np.flatnonzero(~seen))
    for _ in range(8):
        ordered = _in_order(code, k1, k2, kept)
        if ordered.all():
            break
        out = np.zeros(len(kept), np.bool_)
        out[:-1] |= ~ordered
        out[1:] |= ~ordered
        loose.append(kept[out])
        kept = kept[~out]
    else:
        return _lexsort3(k2, k1, code)
    if not loose:
        return kept
    merged = np.concatenate(loose)
    if len(merged) * 8 > n:
        return _lexsort3(k2, k1, code)
    merged = merged[np.lexsort((merged, k2[merged], k1[merged], code[merged]))]
    where = np.searchsorted(_walk_keys(code, k1, k2, kept), _walk_keys(code, k1, k2, merged))
    return np.insert(kept, where, merged)


def _dense_rank(values: Floats) -> Ints:
    """Each value's rank among the distinct values (equal values, 0.0 and -0.0 too, share
    one)."""
    order = np.argsort(values)
    ordered = values[order]
    rank = np.empty(len(values), np.int64)
    rank[order] = np.cumsum(np.concatenate(([0], ordered[1:] != ordered[:-1])))
    return rank


def _same_bits(a: Floats | Ints, b: Floats | Ints) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float64:
        return bool(np.array_equal(a.view(np.int64), b.view(np.int64)))
    return bool(np.array_equal(a, b))


def _ranks(order: Ints, keys: Floats, work_of: Floats
           ) -> tuple[list[int], list[int], list[float], list[float]]:
    """The Moore-Hodgson heap's entries: each position's rank in the order of (key, index),
    and by rank the index and the work; and the work by position."""
    n = len(order)
    by = np.lexsort((order, keys))
    rank = np.empty(n, np.int64)
    rank[by] = np.arange(n)
    return rank.tolist(), order[by].tolist(), work_of[by].tolist(), work_of.tolist()


def _indices(mask: Bools) -> tuple[int, ...]:
    return tuple(np.flatnonzero(mask).tolist())


def _top(scores: Floats, count: int) -> tuple[int, ...]:
    """``ordering.top_scores`` over an array: the ``count`` highest, ties to the earlier job."""
    n = len(scores)
    if not n:
        return ()
    chosen = np.arange(n)
    if count < n:
        bar = np.partition(scores, n - count)[n - count]
        chosen = np.flatnonzero(scores >= bar)
    best = chosen[np.lexsort((chosen, -scores[chosen]))][:count]
    return tuple(i for i in best.tolist() if scores[i] >= 0.0)
