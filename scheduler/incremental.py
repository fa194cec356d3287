"""The Stepline planner held across ticks: the same plan as :func:`scheduler.plan_tick`, in a
few milliseconds at 10 000 jobs.

What a job view alone decides is read once per view object into the column store
(:mod:`scheduler.columns`). What the clock or the cost model moves (remaining work, slack, waited
time, scores, lateness, load, the deferral) is worked out each tick over the columns as whole
arrays, in the same floating-point operations in the same order as the readable pipeline
(``scheduler.survey``, ``judgement``, ``ordering``, ``allocation``, ``reserve``; the fair order
in :mod:`scheduler.fair_walk`), so every float and every tie comes out the same:
``tests/unit/test_scheduler_incremental.py`` holds the plans equal over random histories, and
the pinned digests hold the readable pipeline.

Where an order matters, numpy sorts stably with the index (or the position) as the last key,
as Python's sorts and heaps break ties; sums that the readable code accumulates one job at a
time are cumulative sums (sequential, not numpy's pairwise reduction) in the same order.
"""

from __future__ import annotations

import math
from itertools import compress

import numpy as np

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
from scheduler.columns import (
    QUEUED,
    RUNNING,
    SUSPENDED,
    WAITING,
    Bools,
    Columns,
    Floats,
    Ints,
    Tick,
)
from scheduler.deferral import defer_overcommitted
from scheduler.fair_walk import FairArrays, fair_best, fair_ranking
from scheduler.judgement import Judgement
from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot, JobView, WorkerView
from scheduler.ordering import (
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
from scheduler.queues import LOWEST_LEVEL
from scheduler.reserve import hold_reserve
from scheduler.scoring import ScoreTerms
from scheduler.state import AdmissionState
from scheduler.survey import Survey, _RateTable
from scheduler.tick import plan_tick, with_recoveries


class IncrementalPlanner:
    """``IncrementalPlanner().plan(snapshot, policy, now_s)`` equals
    ``plan_tick(snapshot, policy, now_s)``; held across ticks, it reads only the job views that
    are new since the last tick. Not thread-safe: one planner per ticking process."""

    def __init__(self) -> None:
        self._columns: Columns | None = None

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
            columns = self._columns = Columns(policy)
        rows = columns.rows(snapshot.jobs)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            plan = _Planning(columns, snapshot, policy, now_s).plan(rows)
        recovering = np.flatnonzero(columns.b["recover"][rows]).tolist()
        jobs = snapshot.jobs
        return with_recoveries(snapshot, policy, now_s, plan, [jobs[k] for k in recovering])


class _Planning:
    """One tick of :class:`IncrementalPlanner`: ``scheduler.planner.plan_stepline``'s steps,
    each over arrays where the readable step walks every job."""

    def __init__(self, columns: Columns, snapshot: ClusterSnapshot, policy: PolicyConfig,
                 now_s: float) -> None:
        self.c, self.snapshot, self.policy, self.now_s = columns, snapshot, policy, now_s
        self.fair: FairArrays = ()
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
            if levels.inherited:
                ranking = with_fair_share(ranking, snapshot.service)
            else:
                ranking, self.fair = fair_ranking(self.c, ranking, tick, policy.fair_share,
                                                  snapshot.service, now_s)
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

    def _estimates(self, tick: Tick) -> dict[str, float]:
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
                alive: tuple[WorkerView, ...]) -> tuple[Survey, Tick]:
        c, policy, now_s = self.c, self.policy, self.now_s
        f, b = c.f, c.b
        if live_mask.all():  # as a snapshot of live records is
            rows, live = all_rows, tuple(snapshot.jobs)
        else:
            rows = all_rows[live_mask]
            live = tuple(compress(snapshot.jobs, live_mask.tolist()))
        state = c.i["state"][rows]
        remaining, sure = self._remaining(snapshot, rows, live, alive)
        deadline = f["deadline"][rows]
        finish = now_s + remaining
        late = (finish > deadline + policy.expire_grace_s) & sure
        waiting = state == WAITING
        running = state == RUNNING
        suspended = state == SUSPENDED
        waited = now_s - f["waiting"][rows]
        scores = self._scores(rows, running, remaining, finish, deadline, waited)
        demand, outstanding, cold = self._demand(rows, remaining, deadline, ~suspended)
        realtime = b["realtime"][rows]
        holding = ((state == QUEUED) | running) & ~b["preempt"][rows]
        on_standby = b["on_standby"][rows]
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
            aged=frozen("aged", np.flatnonzero(waiting & (waited >= policy.aging_bound_s))),
            late=frozen("late", late_at), with_deps=frozen("with_deps",
                                                           np.flatnonzero(b["deps"][rows])),
            outstanding_s=outstanding, cold_s=cold,
            paid_share=paid_load_share(alive, policy.load_window_s, now_s),
            incumbent=self._incumbent(snapshot.state.origin_id, rows))
        return survey, Tick(rows, state, remaining, demand, deadline, waited, scores,
                             np.zeros(len(rows)), np.zeros(len(rows)), waiting_rt,
                             waiting_other, suspended_at, standby, late_at)

    def _remaining(self, snapshot: ClusterSnapshot, rows: Ints, live: tuple[JobView, ...],
                   alive: tuple[WorkerView, ...]) -> tuple[Floats, Bools]:
        """Each job's remaining seconds (its units at the fleet's rate of its cost key, or of
        each chunk kind, plus the hops and the expected load), and whether the estimate is
        backed by enough measurements."""
        c, policy = self.c, self.policy
        f = c.f
        table = _RateTable(snapshot.cost, [w.device for w in alive], policy.cost_min_samples)
        keys = c.i["key"][rows]
        rates = np.zeros(len(c.key_names))
        sure_of = np.zeros(len(c.key_names), np.bool_)
        for k in np.flatnonzero(np.bincount(keys, minlength=len(c.key_names))).tolist():
            rates[k] = table.learn(c.key_names[k])
            sure_of[k] = table.confident[c.key_names[k]]
        remaining = f["units"][rows] * rates[keys]
        sure = sure_of[keys]
        for k in np.flatnonzero(c.b["by_key"][rows]).tolist():
            remaining[k], sure[k] = table.remaining_s(live[k])
        remaining = remaining + c.i["left"][rows] * policy.hop_overhead_s
        return remaining + f["load"][rows], sure  # + 0.0 where warm: the same floats

    def _scores(self, rows: Ints, running: Bools, remaining: Floats, finish: Floats,
                deadline: Floats, waited: Floats) -> Floats:
        """Each job's origin score: ``scoring.score_jobs``' terms, summed in its order (the
        terms a view alone decides read from the columns)."""
        f, t = self.c.f, ScoreTerms.from_policy(self.policy)
        bound_s = self.policy.aging_bound_s
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
        return scores + tail

    def _demand(self, rows: Ints, remaining: Floats, deadline: Floats,
                counted: Bools) -> tuple[Floats, float, float]:
        """Each job's remaining work due within the load horizon (later work pro rata), and
        the sums over the counted jobs (those not suspended), in index order, of it and of
        the expected loads counted alike."""
        horizon_s = self.policy.load_horizon_s
        due_in = deadline - self.now_s
        demand = np.where(due_in <= horizon_s, remaining, remaining * horizon_s / due_in)
        outstanding = float(np.cumsum(np.concatenate(([0.0], demand[counted])))[-1])
        loads = self.c.f["load"][rows]
        cold_demand = np.where(due_in <= horizon_s, loads, loads * horizon_s / due_in)
        cold = float(np.cumsum(np.concatenate(([0.0], cold_demand[counted])))[-1])
        return demand, outstanding, cold

    def _incumbent(self, origin_id: str | None, rows: Ints) -> int | None:
        """The position of the last tick's origin among the live jobs, if it is still live:
        found by the row last read for its id first (job ids are unique in a snapshot), else
        by every live job's id."""
        if origin_id is None:
            return None
        c = self.c
        row = c.row_of_id.get(origin_id)
        found = np.flatnonzero(rows == row) if row is not None else np.zeros(0, np.int64)
        if not found.size:
            found = np.flatnonzero(c.ids[rows] == origin_id)
        return int(found[-1]) if found.size else None

    # -- judgement (scheduler.judgement.judge) ----------------------------------------------

    def _judge(self, survey: Survey, tick: Tick, workers: int,
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
        skip = tick.state == SUSPENDED
        for i in (*demoted, *blocked, *expired):
            skip[i] = True
        deferred = defer_overcommitted(self.c, tick, np.flatnonzero(~skip), workers,
                                       now_s)
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

    def _batching_gain(self, survey: Survey, tick: Tick, growths: GrowthTable) -> float:
        """``judgement.batching_gain_s``: groups in order of their first member, members in
        index order, each adding saved × its demand."""
        batching, c = self.policy.batching, self.c
        if not batching.enabled or not c.b["group_truthy"][tick.rows].any():
            return 0.0
        members = np.flatnonzero(c.b["grouped"][tick.rows] & (tick.state != SUSPENDED))
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

    def _blocked(self, survey: Survey, tick: Tick) -> frozenset[int]:
        if not survey.with_deps:
            return frozenset()
        live = survey.live
        ids = set(self.c.ids[tick.rows].tolist())
        return frozenset(i for i in survey.with_deps
                         if live[i].state is not JobState.RUNNING
                         and live[i].state is not JobState.QUEUED
                         and any(dep in ids for dep in live[i].depends_on))

    # -- ranking (Ranking.keys for every job) ------------------------------------------------

    def _keys(self, tick: Tick, behind: frozenset[int]) -> None:
        policy, now_s = self.policy, self.now_s
        bound_s = policy.aging_bound_s
        waited = np.where(tick.state == RUNNING, 0.0, tick.waited)
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

    # -- flight (scheduler.allocation.plan_flight) ------------------------------------------

    def _levels(self, levels: Levels, tick: Tick) -> Ints:
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
        own = np.where((marked == 0) | (tick.state == RUNNING) | (steps <= 0), marked, aged)
        if levels.demoted:
            own[list(levels.demoted)] = LOWEST_LEVEL
        if levels.origin is not None:
            own[levels.origin] = 0
        for i, inherited in levels.inherited.items():
            own[i] = min(int(own[i]), inherited)
        return own

    def _work(self, tick: Tick) -> Floats:
        """``levels.work_s(i)`` of every job: remaining seconds without the expected load."""
        load = self.c.f["load"][tick.rows]
        return np.where(load > 0.0, tick.remaining - load, tick.remaining)

    def _flight(self, order: Order, tick: Tick) -> tuple[Flight, Ints]:
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

    def _suspend(self, order: Order, tick: Tick, lowest: Bools) -> Ints:
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

    def _restorable(self, order: Order, tick: Tick, out: Bools) -> list[int]:
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

    def _earliest(self, indices: Ints, count: int, tick: Tick) -> list[int]:
        """``heapq.nsmallest(count, indices, key=submitted)``: ties in the given order."""
        if count <= 0 or not indices.size:
            return []
        submitted = self.c.f["submitted"][tick.rows[indices]]
        return indices[np.argsort(submitted, kind="stable")[:count]].tolist()  # type: ignore[no-any-return]

    # -- allocation and reserve --------------------------------------------------------------

    def _ranked(self, order: Order, flight: Flight, pool: Ints, tick: Tick,
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
            best = fair_best(self.fair, pool, take, tick)
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

    def _realtime_slack(self, tick: Tick, demoted: frozenset[int]) -> tuple[bool, float]:
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
                   standby: tuple[int, ...], cap: int, tick: Tick) -> tuple[int, ...]:
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
