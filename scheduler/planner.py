"""Stepline's planner: deadline-aware order, origin, MLFQ, reserve, preemption and overload.

Slots: at most ``alive workers × slots_per_worker`` slots are in flight — a job (QUEUED or
RUNNING, not on standby, not being preempted), or a batch of compatible jobs sharing one batched
forward per step (``scheduler.batching``): the best-ranked ones; every slot is filled while
runnable work waits. The origin ranks first; then shortest value-weighted remaining work
first, with aging (least slack on ties), where work past saving by its estimate, or that the
fleet cannot fit together with the work that can (Moore-Hodgson, least value per second deferred
first), counts ``late_penalty`` times its size. In-flight work outside the top goes to the
standby queue; a running job outside it yields at its next block group when a job of the top
would otherwise wait past its deadline for a worker.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import replace

from scheduler.admission import (
    admission_status,
    expiry_reason,
    measure_load,
    next_admission_state,
)
from scheduler.batching import Slot, SlotPacker, batch_slowdown, learned_growth
from scheduler.inheritance import inherit_levels
from scheduler.lifecycle import JobState, SloClass
from scheduler.mlfq import aged_level, current_mark, mark_level
from scheduler.model import ClusterSnapshot, JobView, Tier, WorkerView
from scheduler.plan import Expiry, LevelMark, Release, Requeue, Retarget, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import LOWEST_LEVEL, REALTIME_QUEUE, STANDBY_QUEUE, queue_for_level
from scheduler.reserve import choose_reserved, reserve_size, reserve_until_s, worker_queues
from scheduler.scoring import select_origin
from scheduler.state import AdmissionState, PolicyState
from scheduler.survey import Survey, survey_jobs

_CLASS_VALUE = {SloClass.REALTIME: 4.0, SloClass.INTERACTIVE: 2.0, SloClass.BATCH: 1.0}
_ORIGIN, _ON_TIME = 0, 1
"""Rank bands, best first: the origin, then everything else by key."""

Rank = tuple[int, float, float]
"""(band, key, tie-break): smaller ranks first."""


_VALUE = {(cls, tier): value * (2.0 if tier is Tier.GOLD else 1.0)
          for cls, value in _CLASS_VALUE.items() for tier in Tier}


def job_value(job: JobView) -> float:
    """What meeting the job's deadline is worth relative to others: its class, doubled for a
    gold tenant. Deferral drops the least value per second of work first."""
    return _VALUE[job.slo_class, job.tier]


def plan_stepline(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """The Stepline policy's plan for this tick."""
    return _Planner(snapshot, policy, now_s).plan()


def _job_ids(live: list[JobView], indices: list[int]) -> tuple[str, ...]:
    return tuple([live[i].job_id for i in indices])  # a list first: faster than a generator


class _Planner:
    """The working set of one tick; each method is one step of the plan."""

    def __init__(self, snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> None:
        self.snapshot, self.policy, self.now_s = snapshot, policy, now_s
        self.alive: list[WorkerView] = [w for w in snapshot.workers if w.alive]
        self.sv: Survey = survey_jobs(snapshot, self.alive, policy, now_s)
        self.scores = self.sv.scores
        self._learned: dict[str, float | None] = {}
        """Measured growth per chunk-kind key, looked up once a tick."""
        self.load = measure_load(self.sv.outstanding_s - self._batching_gain_s(),
                                 len(self.alive), policy)
        self.admission = next_admission_state(snapshot.state.admission, self.load, policy)
        self.converging = self.admission is AdmissionState.CONVERGING
        self.marks: dict[int, LevelMark] = {}
        self.inherited: dict[int, int] = {}
        self.origin: int | None = None
        self.expired: dict[int, str] = {}
        self.demoted: set[int] = set()
        """Cannot meet the deadline even if run alone now: lowest level, behind everything
        that still can, no claim to the origin."""
        self.deferred: set[int] = set()
        """Could meet the deadline alone, but the fleet cannot fit it with the on-time work."""
        self.blocked: set[int] = set()
        self.taken: list[int] = []
        self.victims: list[int] = []
        self.excluded: set[int] = set()
        self.trimmed: list[int] = []
        """In flight but outside the top: their next chunk goes to the standby queue."""
        self._staying_set: set[int] = set()
        self.reserve_reason: str | None = None
        self.reserve_until_s: float | None = None
        self.values = [_VALUE[job.slo_class, job.tier] for job in self.sv.live]
        self.slots: list[Slot] = []
        """The in-flight work after this plan, one slot per worker's worth (a lone job or a
        batch of compatible jobs, see ``scheduler.batching``)."""
        self._ranks: dict[int, Rank] = {}

    def plan(self) -> TickPlan:
        self._judge_late()
        self.blocked = self._blocked()
        self.deferred = self._defer_overcommitted()
        top = self._top_and_origin()
        self._inherit()
        suspend = self._suspend() if self.converging else []
        standby = self._standby() if self.converging else []
        gone = {*self.expired, *suspend, *standby, *self.blocked}
        staying = [i for i in self.sv.inflight if i not in gone]
        self._staying_set = set(staying)
        if self.origin is not None:
            gone.add(self.origin)  # placed apart: it ranks first
        self.excluded = gone
        pool = self._pool()
        cap = len(self.alive) * self.policy.slots_per_worker
        reserved = self._reserve(staying)
        self._allocate(staying, pool, cap, reserved)
        standby += self.trimmed
        restored = self._fill_idle(staying, cap, standby)
        return self._emit(top, suspend, standby, staying, reserved, cap, restored)

    def _batching_gain_s(self) -> float:
        """Worker time batching saves on the outstanding work: a group of n jobs runs in
        batches of b = min(n, max_batch), each job's step costing (1 + growth·(b − 1)) / b of a
        lone step (demand counted as the survey counts it: work due past the horizon pro rata)."""
        batching, live = self.policy.batching, self.sv.live
        if not batching.enabled or not any(job.batch_group for job in live):
            return 0.0
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(live):
            if job.batch_group is not None and job.state is not JobState.SUSPENDED:
                groups.setdefault(job.batch_group, []).append(i)
        horizon_s, gain_s = self.policy.load_horizon_s, 0.0
        for members in groups.values():
            growth = self._growth(members[0])
            size = min(len(members), batching.max_batch)
            if size < 2 or not batching.pays(growth):
                continue
            saved = 1.0 - batch_slowdown(growth, size) / size
            for i in members:
                rem, due_in_s = self.sv.remaining_s[i], live[i].deadline_s - self.now_s
                gain_s += saved * (rem if due_in_s <= horizon_s else rem * horizon_s / due_in_s)
        return gain_s

    # -- levels ------------------------------------------------------------------------------

    def mark(self, i: int) -> LevelMark:
        found = self.marks.get(i)
        if found is None:
            found = self.marks[i] = current_mark(self.sv.live[i], self.sv.remaining_s[i],
                                                 self.policy)
        return found

    def base_level(self, i: int) -> int:
        """MLFQ level after aging; 0 for the origin; inheritance not applied."""
        if i == self.origin:
            return 0
        if i in self.demoted:
            return LOWEST_LEVEL
        job = self.sv.live[i]
        level = mark_level(job, self.sv.remaining_s[i], self.policy)
        if level == 0 or job.state is JobState.RUNNING:
            return level
        return aged_level(level, self.now_s - job.waiting_since_s, job.slo_class, self.policy)

    def level(self, i: int) -> int:
        """Effective level: MLFQ, aged, origin, inherited — the job's queue follows it."""
        own = self.base_level(i)
        return min(own, self.inherited.get(i, own)) if self.inherited else own

    # -- ranks -------------------------------------------------------------------------------

    def slack_s(self, i: int) -> float:
        """Deadline − now − estimated remaining work."""
        return self.sv.live[i].deadline_s - self.now_s - self.sv.remaining_s[i]

    def chunk_s(self, i: int) -> float:
        """Estimated time of the job's next chunk (the mean chunk when its size is unknown)."""
        job = self.sv.live[i]
        if job.next_chunk_cost_units > 0 and job.remaining_cost_units > 0:
            return self.sv.remaining_s[i] * job.next_chunk_cost_units / job.remaining_cost_units
        return self.sv.remaining_s[i] / max(job.num_chunks - job.next_chunk, 1)

    def rank(self, i: int) -> Rank:
        """Where the job stands in this tick's order (see the module docstring); computed
        once per job and tick (the marks it reads are settled before the first call)."""
        found = self._ranks.get(i)
        if found is None:
            found = self._ranks[i] = self._rank(i)
        return found

    def _rank(self, i: int) -> Rank:
        remaining_s = self.sv.remaining_s[i]
        job = self.sv.live[i]
        value = self.values[i]
        tie = remaining_s / value
        if i == self.origin:
            return (_ORIGIN, 0.0, tie)
        slack_s = self.slack_s(i)
        if i in self.demoted or i in self.deferred or slack_s < 0.0:
            # Past saving by the estimate (however few measurements back it: this only
            # orders, it marks and sheds nothing), or deferred: it ranks as on-time work
            # ``late_penalty`` times its size — still before long work that has slack to
            # spare, never before short work that can make its deadline.
            waited_s = 0.0 if job.state is JobState.RUNNING else max(
                self.now_s - job.waiting_since_s, 0.0)
            aged = 1.0 + waited_s / self.policy.aging_bound_s
            return (_ON_TIME, tie * self.policy.late_penalty / aged, tie)
        if self.inherited and self.inherited.get(i, LOWEST_LEVEL) < self.base_level(i):
            return (_ON_TIME, -math.inf, tie)  # others wait on it: it runs first
        # Shortest remaining work first, in value-weighted seconds: the class and tier are
        # priors (a realtime job ranks with an interactive one of half its work, a batch one
        # of a quarter). Measured on nine suite rows, this order among the work that can still
        # make its deadline beat least-slack-first on four (heavy tails, by 1–8 points), tied on
        # three and lost two (2-worker mixed, by 0.4–1.4): the deadlines act through deferral,
        # the late penalty and the preemption rule instead.
        # Aging: past the aging bound, the waited time shrinks the key (by bound ÷ wait), so
        # long work still runs within a few bounds of waiting.
        waited_s = 0.0 if job.state is JobState.RUNNING else self.now_s - job.waiting_since_s
        bound_s = self.policy.aging_bound_s
        aged = bound_s / waited_s if waited_s > bound_s else 1.0
        return (_ON_TIME, remaining_s / value * aged, slack_s)

    def _keys(self, indices: list[int]) -> list[tuple[float, float]]:
        """``rank(i)[1:]`` of many jobs, inlined: the pool may hold 10 000 of them. (Only the
        origin and inheritance need :meth:`_rank`'s other branches; the origin is never in the
        pool.)"""
        if self.inherited:
            return [self.rank(i)[1:] for i in indices]
        live, remaining, values = self.sv.live, self.sv.remaining_s, self.values
        now_s, bound_s, penalty = self.now_s, self.policy.aging_bound_s, self.policy.late_penalty
        behind = self.demoted | self.deferred
        running = JobState.RUNNING
        keys: list[tuple[float, float]] = []
        append = keys.append
        for i in indices:
            job = live[i]
            rem = remaining[i]
            tie = rem / values[i]
            waited_s = 0.0 if job.state is running else now_s - job.waiting_since_s
            slack_s = job.deadline_s - now_s - rem
            if slack_s < 0.0 or i in behind:
                aged = 1.0 + (waited_s if waited_s > 0.0 else 0.0) / bound_s
                append((tie * penalty / aged, tie))
            else:
                append((rem / values[i] * (bound_s / waited_s if waited_s > bound_s else 1.0),
                        slack_s))
        return keys

    # -- steps -------------------------------------------------------------------------------

    def _judge_late(self) -> None:
        """A job that can no longer meet its deadline even if run alone now stops taking
        capacity from jobs that still can: demoted to the lowest level with no claim to the
        origin — or, under overload, shed with the reason if it asked to be. Only estimates
        backed by enough measurements judge a job (``Survey.late``)."""
        live = self.sv.live
        for i in self.sv.late:
            job = live[i]
            reason = expiry_reason(job, self.sv.remaining_s[i], self.load, self.policy,
                                   self.now_s)
            if reason is None:
                continue
            if job.shed_if_late and self.converging:
                self.expired[i] = reason
                self.scores[i] = -1.0
            else:
                self.demoted.add(i)
                self.marks[i] = LevelMark(LOWEST_LEVEL, job.service_s)
                self.scores[i] = 0.0

    def _blocked(self) -> set[int]:
        """Waiting jobs whose dependencies are still live: they cannot run yet."""
        if not self.sv.with_deps:
            return set()
        live = self.sv.live
        ids = {job.job_id for job in live}
        return {i for i in self.sv.with_deps
                if live[i].state is not JobState.RUNNING and live[i].state is not JobState.QUEUED
                and any(dep in ids for dep in live[i].depends_on)}

    def _defer_overcommitted(self) -> set[int]:
        """Moore-Hodgson on the fleet: walk the runnable jobs by deadline, adding up their work
        at the fleet's rate; whenever a job would finish past its deadline, defer the job of
        least value per second of work seen so far until the rest fit. What stays is the
        largest set of jobs (by value) the fleet can finish on time together."""
        live, remaining, now_s = self.sv.live, self.sv.remaining_s, self.now_s
        skip = {*self.sv.suspended, *self.demoted, *self.blocked, *self.expired}
        deadlines = [job.deadline_s for job in live]
        order = [i for i in range(len(live)) if i not in skip]
        order.sort(key=deadlines.__getitem__)
        rate = max(len(self.alive), 1)
        heap: list[tuple[float, int]] = []
        push, values = heapq.heappush, self.values
        deferred: set[int] = set()
        work_s = 0.0
        for i in order:
            work_s += remaining[i]
            push(heap, (-remaining[i] / values[i], i))
            room_s = (deadlines[i] - now_s) * rate
            while work_s > room_s and heap:
                _, j = heapq.heappop(heap)
                work_s -= remaining[j]
                deferred.add(j)
        for i in deferred:
            self.scores[i] = min(self.scores[i], 0.0)  # no claim to the origin
        return deferred

    def _top_and_origin(self) -> list[int]:
        scores, live = self.scores, self.sv.live
        top = [i for i in heapq.nlargest(self.policy.top_scores, range(len(scores)),
                                          key=scores.__getitem__) if scores[i] >= 0.0]
        incumbent = self.sv.incumbent
        held = None if incumbent is None or incumbent in self.expired or (
            incumbent in self.deferred or incumbent in self.demoted) else (
            live[incumbent].job_id, scores[incumbent])
        candidates = [(live[i].job_id, scores[i]) for i in top[:1]
                      if i not in self.blocked and i not in self.deferred]
        picked = select_origin(candidates, held, self.policy.origin_threshold(self.load),
                               self.policy.origin_margin)
        if picked is not None:
            self.origin = incumbent if held is not None and picked[0] == held[0] else top[0]
        return top

    def _inherit(self) -> None:
        """Lower the level of jobs others wait on."""
        if not self.sv.with_deps:
            return
        live = self.sv.live
        index = {job.job_id: i for i, job in enumerate(live)}
        depends = {live[i].job_id: live[i].depends_on for i in self.sv.with_deps}
        for job in live:
            depends.setdefault(job.job_id, ())
        waiters = [(live[i].job_id, self.base_level(i)) for i in self.sv.with_deps]
        lowered = inherit_levels(waiters, depends, lambda job_id: self.base_level(index[job_id]))
        self.inherited = {index[job_id]: level for job_id, level in lowered.items()}

    def _suspend(self) -> list[int]:
        """Overload: waiting batch work — batch class, or demoted to the batch level — is held
        back, unless it is the origin or something more urgent waits on it."""
        live, batch, at_lowest = self.sv.live, SloClass.BATCH, self._at_lowest_level
        kept = {*self.inherited, *self.expired, self.origin}
        held = [i for i in self.sv.waiting_other
                if i not in kept and (live[i].slo_class is batch or at_lowest(i))]
        # A realtime-class job too big for the realtime quantum skip-joins the batch level: under
        # overload it is held back like any other batch-level work.
        return held + [i for i in self.sv.waiting_realtime if i not in kept and at_lowest(i)]

    def _at_lowest_level(self, i: int) -> bool:
        # Fast path for new jobs, same answer as level(): a job joins the lowest level when it
        # is batch or does not fit the second quantum, and one aging bound of waiting lifts it.
        if i in self.demoted:
            return True
        job = self.sv.live[i]
        if job.level is None:
            fits = self.sv.remaining_s[i] <= self.policy.level_quanta_s[1]
            if fits and job.slo_class is not SloClass.BATCH:
                return False
            return self.now_s - job.waiting_since_s < self.policy.aging_bound_s
        return self.level(i) == LOWEST_LEVEL

    def _standby(self) -> list[int]:
        """Overload: in-flight non-critical (lowest-level) work moves to the standby queue."""
        return [i for i in self.sv.inflight
                if i not in self.expired and self.level(i) == LOWEST_LEVEL]

    def _pool(self) -> list[int]:
        """Release candidates: waiting jobs not excluded, and, once load is low again, a few
        standby and suspended ones."""
        excluded = self.excluded
        pool = [i for i in (*self.sv.waiting_realtime, *self.sv.waiting_other)
                if i not in excluded]
        # Standby work competes like any other, except batch-level work while overload
        # convergence holds it back (it is restored a few jobs per tick once load is low).
        pool.extend(i for i in self.sv.standby if i not in excluded
                    and not (self.converging and self.level(i) == LOWEST_LEVEL))
        if not self.converging:
            pool.extend(self._restorable(excluded))
        return pool

    def _restorable(self, excluded: set[int]) -> list[int]:
        """Load is low again: a few suspended jobs compete for slots once more."""
        budget = self.policy.resume_per_tick
        live, remaining = self.sv.live, self.sv.remaining_s
        by_arrival = lambda i: live[i].submitted_at_s  # noqa: E731
        chosen: list[int] = []
        room = (self.policy.convergence_threshold - self.policy.convergence_hysteresis
                - self.load) * max(len(self.alive), 1) * self.policy.load_horizon_s
        resumable = (i for i in self.sv.suspended if i not in excluded)
        for i in heapq.nsmallest(budget, resumable, key=by_arrival):
            if remaining[i] > room:
                break
            room -= remaining[i]
            chosen.append(i)
        return chosen

    # -- the reserve -------------------------------------------------------------------------

    def _reserve(self, staying: list[int]) -> frozenset[str]:
        """Reserved workers consume only realtime work. The reserve is lent out — other work
        runs on every worker, and realtime work reclaims it by preemption — unless a block
        group of the lent work outlasts the slack of the realtime work in sight: then
        preemption would come too late, and the reserve is held (idle if need be)."""
        live = self.sv.live
        realtime = [i for i in range(len(live))
                    if live[i].slo_class is SloClass.REALTIME and i not in self.demoted]
        pressure = self.origin is not None or bool(realtime)
        previous = self.snapshot.state
        until_s = reserve_until_s(pressure, previous.reserve_until_s, self.policy, self.now_s)
        yield_s = self._yield_s(staying)
        # Realtime work with no slack at all is beyond any reserve's help.
        budget_s = min((slack_s for i in realtime if (slack_s := self._arrival_slack_s(i)) > 0),
                       default=math.inf)
        if realtime and yield_s > budget_s:
            self.reserve_reason = (f"a block group of lent work takes ~{yield_s * 1e3:.0f} ms, "
                                   f"realtime work has ~{max(budget_s, 0.0) * 1e3:.0f} ms of "
                                   "slack: preemption would come too late")
        elif previous.reserved_workers and until_s is not None and self.now_s < until_s:
            self.reserve_reason = "held after realtime work that preemption could not serve"
        self.reserve_until_s = until_s if self.reserve_reason else None
        if self.reserve_reason is None:
            return frozenset()
        urgent_running = {live[i].job_id for i in staying if self.level(i) == 0}
        count = reserve_size(len(self.alive), self.policy.resource_reserve_ratio)
        return choose_reserved(self.alive, count, previous.reserved_workers, urgent_running)

    def _yield_s(self, staying: list[int]) -> float:
        """How long the slowest in-flight non-realtime job takes to yield: one block group of
        its next chunk."""
        live = self.sv.live
        worst = 0.0
        for i in staying:
            if self.level(i) > 0:
                worst = max(worst, self.chunk_s(i) / max(live[i].block_groups, 1))
        return worst

    def _arrival_slack_s(self, i: int) -> float:
        """A job's slack when it arrived: its deadline budget less its whole estimated work."""
        job = self.sv.live[i]
        return job.deadline_s - job.submitted_at_s - job.service_s - self.sv.remaining_s[i]

    # -- allocation --------------------------------------------------------------------------

    def _allocate(self, staying: list[int], pool: list[int], cap: int,
                  reserved: frozenset[str]) -> None:
        """The ``cap`` best-ranked jobs are the ones in flight. Waiting ones among them are
        released; in-flight ones outside them go to the standby queue (consumed last, so they
        still run on a worker nothing else wants); a running one yields its worker by
        preemption when a job in the top cannot wait for a worker to free (see
        :meth:`_displaces`). Submissions go straight to their class queue, so the in-flight
        set may be over-full here: this is where it is put back in the policy's order."""
        live = self.sv.live
        keys = self._keys(pool)
        batching = self.policy.batching
        shared = batching.enabled and any(live[i].batch_group is not None for i in pool)
        per_slot = batching.max_batch if shared else 1  # a slot may take this many jobs
        best = heapq.nsmallest(cap * per_slot + len(staying), range(len(pool)),
                               key=keys.__getitem__)
        candidates = [*staying, *(pool[k] for k in best)]
        if self._origin_waits():
            candidates.append(self.origin)  # type: ignore[arg-type]
        top = self._top(sorted(candidates, key=self.rank), cap, reserved)
        in_top = set(top)
        self.taken = [i for i in top if i not in self._staying_set]
        self.trimmed = [i for i in staying if i not in in_top]
        # Work on standby holds no slot but may hold a worker: it yields like the rest.
        on_standby = [i for i in self.sv.standby if live[i].state is JobState.RUNNING
                      and i not in in_top and not live[i].preempt_requested]
        running = [i for i in (*staying, *on_standby) if live[i].state is JobState.RUNNING]
        # a running batch holds one worker, however many jobs it carries
        workers_free = len(self.alive) - len({live[i].batch_id or i for i in running})
        needy = [slot.members[0] for slot in self.slots
                 if all(live[i].state is not JobState.RUNNING for i in slot.members)]
        holders = [i for i in (*self.trimmed, *on_standby) if live[i].state is JobState.RUNNING]
        self._displace(needy[max(workers_free, 0):], holders)
        self.trimmed = [i for i in self.trimmed if i not in self.victims]

    def _origin_waits(self) -> bool:
        origin = self.origin
        return origin is not None and origin not in self.blocked and origin not in self.expired \
            and origin not in self._staying_set and (
                origin in self.sv.waiting_realtime or origin in self.sv.waiting_other
                or origin in self.sv.suspended or origin in self.sv.standby)

    def _top(self, ordered: list[int], cap: int, reserved: frozenset[str]) -> list[int]:
        """``ordered`` packed into ``cap`` slots, best first (compatible jobs share a slot as a
        batch, see ``scheduler.batching``); while the reserve is held, work below the realtime
        level opens only the unreserved workers' slots."""
        room = cap
        if reserved:
            room = (len(self.alive) - len(reserved)) * self.policy.slots_per_worker
        packer = SlotPacker(self.policy.batching, cap, self.slack_s,
                            self.sv.remaining_s.__getitem__, self._batches_in_flight())
        top: list[int] = []
        for i in ordered:
            low = self.level(i) > 0
            slot = packer.add(i, self._batch_group(i), self._growth(i), self._batch_of(i),
                              may_open=not low or room > 0)
            if slot is None:
                continue
            top.append(i)
            if low and len(slot.members) == 1:
                room -= 1
        self.slots = packer.slots
        return top

    def _batches_in_flight(self) -> dict[str, tuple[tuple[str, str], list[int]]]:
        """batch id → (its group, its members staying in flight)."""
        found: dict[str, tuple[tuple[str, str], list[int]]] = {}
        for i in self._staying_set:
            batch_id, group = self._batch_of(i), self._batch_group(i)
            if batch_id is not None and group is not None:
                found.setdefault(batch_id, (group, []))[1].append(i)
        return found

    def _batch_group(self, i: int) -> tuple[str, str] | None:
        """(batch group, queue) of a job that may share its slot; None: it runs alone (the
        origin is never slowed by batching)."""
        job = self.sv.live[i]
        if job.batch_group is None or i == self.origin \
                or not self.policy.batching.pays(self._growth(i)):
            return None
        if i in self._staying_set and self._batch_of(i) is None:
            return None  # in flight on its own: its messages carry it alone
        return (job.batch_group, self._target_queue(i))

    def _growth(self, i: int) -> float:
        """How a batched step of the job's main chunk kind grows with the batch: the job's own
        figure (a simulated job), else as measured, else the policy's table."""
        job = self.sv.live[i]
        if job.batch_growth is not None:
            return job.batch_growth
        batching = self.policy.batching
        if batching.learn and job.remaining_units_by_key:
            key = max(job.remaining_units_by_key, key=lambda pair: pair[1])[0]
            if key not in self._learned:
                self._learned[key] = learned_growth(
                    self.snapshot.cost, key, batching.max_batch, self.policy.cost_min_samples)
            found = self._learned[key]
            if found is not None:
                return found
        return batching.growth_of(job.cost_key)

    def _batch_of(self, i: int) -> str | None:
        """The batch an in-flight job runs in (a job being preempted has left it)."""
        job = self.sv.live[i]
        if i in self._staying_set and not job.preempt_requested:
            return job.batch_id
        return None

    def _displace(self, challengers: list[int], holders: list[int]) -> None:
        """Challengers (best first) that no free worker serves take the workers of running
        jobs outside the top (worst first) by preemption — else the job that holds the worker
        and one of the top would share it chunk by chunk — unless a chunk ends in time: a job
        outside the top gives its worker up at its chunk's end anyway (its next chunk goes to
        standby), so a challenger whose slack outlasts that end waits for it."""
        live, limit = self.sv.live, self.policy.max_preemptions
        chunk_ends = sorted(self.chunk_s(i) for i in holders)
        holders = sorted((i for i in holders if live[i].preemptions < limit and i != self.origin),
                         key=self.rank, reverse=True)
        margin_s = self.policy.tick_interval_s
        for k, challenger in enumerate(challengers):
            if not holders:
                return
            if k < len(chunk_ends) and self.slack_s(challenger) >= chunk_ends[k] + margin_s:
                continue
            self.victims.append(holders.pop(0))

    def _fill_idle(self, staying: list[int], cap: int, standby: list[int]) -> list[int]:
        """Work conservation under overload: slots no runnable job wants go to suspended work,
        released to the standby queue (consumed last, so it yields to everything else)."""
        if not self.converging:
            return []
        in_flight = len(staying) - len(self.victims) - len(self.trimmed) + len(self.taken)
        idle = cap - in_flight - len(self.sv.standby) - len(standby)
        if idle <= 0:
            return []
        live = self.sv.live
        return heapq.nsmallest(idle, (i for i in self.sv.suspended if i not in self.excluded
                                      and i not in self.blocked),
                               key=lambda i: live[i].submitted_at_s)

    # -- output ------------------------------------------------------------------------------

    def _emit(self, top: list[int], suspend: list[int], standby: list[int], staying: list[int],
              reserved: frozenset[str], cap: int, restored: list[int]) -> TickPlan:
        live, scores = self.sv.live, self.scores
        origin = self.origin
        releases, requeues, retargets = self._moves(staying)
        releases += tuple(self._release(i, STANDBY_QUEUE) for i in restored)
        touched = [*self.taken, *(i for i in staying if i not in self.victims), *self.demoted]
        return TickPlan(
            policy=self.policy.policy,
            now_s=self.now_s,
            origin_id=None if origin is None else live[origin].job_id,
            origin_score=None if origin is None else scores[origin],
            top_scores=tuple((live[i].job_id, scores[i]) for i in top),
            releases=releases,
            atomic_release=False,
            requeues=requeues,
            retargets=retargets,
            preempt=_job_ids(live, self.victims),
            suspend=_job_ids(live, suspend),
            standby=_job_ids(live, standby),
            expire=tuple(Expiry(live[i].job_id, reason) for i, reason in self.expired.items()),
            levels=self._changed_marks(touched),
            reserved_workers=reserved,
            worker_queues=worker_queues(self.alive, reserved),
            admission=admission_status(self.admission, self.load, self.policy, self.now_s),
            capacity_slots=cap,
            state=self._next_state(reserved),
            estimates=self._first_estimates(),
            reserve_reason=self.reserve_reason,
            deferred=_job_ids(live, sorted(self.deferred)),
        )

    def _first_estimates(self) -> dict[str, float]:
        live, remaining = self.sv.live, self.sv.remaining_s
        return {live[i].job_id: live[i].service_s + remaining[i]
                for i in range(len(live)) if not live[i].estimated}

    def _release(self, i: int, queue: str) -> Release:
        job = self.sv.live[i]
        return Release(job.job_id, queue, estimate_s=job.service_s + self.sv.remaining_s[i])

    def _target_queue(self, i: int) -> str:
        return queue_for_level(self.level(i))

    def _moves(self, staying: list[int]) -> tuple[tuple[Release, ...], tuple[Requeue, ...],
                                                 tuple[Retarget, ...]]:
        live = self.sv.live
        releases: list[Release] = []
        requeues: list[Requeue] = []
        retargets: list[Retarget] = []
        leaving = {*self.victims, *self.trimmed}
        moving = [i for i in staying if i not in leaving]
        batches = self._batches_of_taken()
        for i in self.taken:
            job = live[i]
            if job.queue == STANDBY_QUEUE and job.state in (JobState.QUEUED, JobState.RUNNING):
                moving.append(i)
            else:
                batch, join = batches.get(i, (None, False))
                releases.append(replace(self._release(i, self._target_queue(i)),
                                        batch=batch, join=join))
        shared = Counter(live[i].batch_id for i in moving if live[i].batch_id is not None)
        for i in moving:
            job, target = live[i], self._target_queue(i)
            if i == self.origin and job.batch_group is not None and (
                    shared[job.batch_id] > 1 or job.queue == REALTIME_QUEUE):
                # the origin is never slowed by batching: its next chunk leaves the batch it
                # shares, ahead of everything (a chunk on another queue hops on its own)
                target = REALTIME_QUEUE
            if job.queue is None or job.queue == target:
                continue
            if job.state is JobState.QUEUED:
                requeues.append(Requeue(job.job_id, job.queue, target))
            else:
                retargets.append(Retarget(job.job_id, job.queue, target))
        return tuple(releases), tuple(requeues), tuple(retargets)

    def _batches_of_taken(self) -> dict[int, tuple[str, bool]]:
        """Released job → (its batch, whether that batch is in flight already). A new batch is
        named after its best-ranked member and the tick (unique: a job is released once per
        tick)."""
        live, taken = self.sv.live, set(self.taken)
        found: dict[int, tuple[str, bool]] = {}
        for slot in self.slots:
            if slot.group is None:
                continue
            batch, join = slot.batch_id, slot.batch_id is not None
            if batch is None:
                batch = f"{live[slot.members[0]].job_id}.{round(self.now_s * 1000)}"
            found.update((i, (batch, join)) for i in slot.members if i in taken)
        return found

    def _changed_marks(self, touched: list[int]) -> dict[str, LevelMark]:
        changed: dict[str, LevelMark] = {}
        for i in touched:
            job, mark = self.sv.live[i], self.mark(i)
            if job.level != mark.level or job.level_service_s != mark.service_mark_s:
                changed[job.job_id] = mark
        return changed

    def _next_state(self, reserved: frozenset[str]) -> PolicyState:
        previous = self.snapshot.state
        origin_id = None if self.origin is None else self.sv.live[self.origin].job_id
        since_s = previous.origin_since_s if origin_id == previous.origin_id else (
            None if origin_id is None else self.now_s)
        return PolicyState(origin_id=origin_id, origin_since_s=since_s, admission=self.admission,
                           reserve_until_s=self.reserve_until_s,
                           reserved_workers=tuple(sorted(reserved)))
