"""Stepline's planner: origin, MLFQ, reserve, preemption and overload convergence in one tick.

Slots: at most ``alive workers × slots_per_worker`` jobs are in flight (QUEUED or RUNNING, not on
standby, not being preempted). Releases fill free slots: the origin first, then realtime-level
work, then the rest. Realtime-level work that still waits may take slots from running lower work
by preemption until it holds ``realtime_min_share`` of them; while it waits, the rest may not grow
past the remaining share, nor past the unreserved workers' slots.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from scheduler.admission import (
    admission_status,
    expiry_reason,
    measure_load,
    next_admission_state,
)
from scheduler.inheritance import inherit_levels
from scheduler.lifecycle import JobState, SloClass
from scheduler.mlfq import aged_level, current_mark, mark_level
from scheduler.model import ClusterSnapshot, JobView, WorkerView
from scheduler.plan import Expiry, LevelMark, Release, Requeue, Retarget, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.preemption import pick_victims
from scheduler.queues import LOWEST_LEVEL, STANDBY_QUEUE, queue_for_level
from scheduler.reserve import choose_reserved, reserve_size, reserve_until_s, worker_queues
from scheduler.scoring import select_origin
from scheduler.state import AdmissionState, PolicyState
from scheduler.survey import Survey, survey_jobs

_EXCLUDED = -math.inf
_WAITING = frozenset({JobState.PENDING, JobState.PREEMPTED})


def realtime_guarantee(cap: int, share: float) -> int:
    """Slots realtime-level work may claim: ceil(share × cap), but one slot always stays open
    to the rest so that aged work can run (with two slots the floor is therefore one)."""
    wanted = math.ceil(round(share * cap, 9))
    return min(wanted, cap - 1) if cap >= 2 else wanted


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
        self.load = measure_load(self.sv.outstanding_s, len(self.alive), policy)
        self.admission = next_admission_state(snapshot.state.admission, self.load, policy)
        self.converging = self.admission is AdmissionState.CONVERGING
        self.marks: dict[int, LevelMark] = {}
        self.inherited: dict[int, int] = {}
        self.origin: int | None = None
        self.expired: dict[int, str] = {}
        self.demoted: set[int] = set()
        """Late under overload, not to be shed: at the lowest level, behind work that can
        still meet its deadline."""
        self.taken: list[int] = []
        self.victims: list[int] = []
        self.excluded: set[int] = set()

    def plan(self) -> TickPlan:
        self.expired = self._expire() if self.converging else {}
        top = self._top_and_origin()
        blocked = self._inherit()
        suspend = self._suspend() if self.converging else []
        standby = self._standby() if self.converging else []
        gone = {*self.expired, *suspend, *standby, *blocked}
        staying = [i for i in self.sv.inflight if i not in gone]
        # Pools exclude the origin too: it is placed alone. `gone` grows in place, not copied
        # (under overload it holds thousands of suspended jobs).
        if self.origin is not None:
            gone.add(self.origin)
        self.excluded = gone
        urgent_pool, rest_pool = self._pools()
        reserved = self._reserve(staying, urgent_pool)
        cap = len(self.alive) * self.policy.slots_per_worker
        rest_cap = (len(self.alive) - len(reserved)) * self.policy.slots_per_worker
        self._allocate(staying, urgent_pool, rest_pool, cap, rest_cap, blocked)
        return self._emit(top, suspend, standby, staying, reserved, cap)

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

    # -- steps -------------------------------------------------------------------------------

    def _expire(self) -> dict[int, str]:
        """Overload: a job that can no longer meet its deadline stops taking capacity from jobs
        that still can — shed with the reason if it asked to be, else demoted to the lowest
        level (where convergence holds it back until load falls) with no claim to the origin."""
        reasons: dict[int, str] = {}
        live = self.sv.live
        for i in self.sv.late:
            job = live[i]
            reason = expiry_reason(job, self.sv.remaining_s[i], self.load, self.policy,
                                   self.now_s)
            if reason is None:
                continue
            if job.shed_if_late:
                reasons[i] = reason
                self.scores[i] = -1.0
            else:
                self.demoted.add(i)
                self.marks[i] = LevelMark(LOWEST_LEVEL, job.service_s)
                self.scores[i] = 0.0
        return reasons

    def _top_and_origin(self) -> list[int]:
        scores, live = self.scores, self.sv.live
        top = [i for i in heapq.nlargest(self.policy.top_scores, range(len(scores)),
                                          key=scores.__getitem__) if scores[i] >= 0.0]
        incumbent = self.sv.incumbent
        held = None if incumbent is None or incumbent in self.expired else (
            live[incumbent].job_id, scores[incumbent])
        picked = select_origin([(live[i].job_id, scores[i]) for i in top[:1]], held,
                               self.policy.origin_threshold(self.load), self.policy.origin_margin)
        if picked is not None:
            self.origin = incumbent if held is not None and picked[0] == held[0] else top[0]
        return top

    def _inherit(self) -> set[int]:
        """Lower the level of jobs others wait on; return the waiting jobs that are blocked."""
        if not self.sv.with_deps:
            return set()
        live = self.sv.live
        index = {job.job_id: i for i, job in enumerate(live)}
        depends = {live[i].job_id: live[i].depends_on for i in self.sv.with_deps}
        for job in live:
            depends.setdefault(job.job_id, ())
        waiters = [(live[i].job_id, self.base_level(i)) for i in self.sv.with_deps]
        lowered = inherit_levels(waiters, depends, lambda job_id: self.base_level(index[job_id]))
        self.inherited = {index[job_id]: level for job_id, level in lowered.items()}
        return {i for i in self.sv.with_deps
                if live[i].state is not JobState.RUNNING and live[i].state is not JobState.QUEUED
                and any(dep in index for dep in live[i].depends_on)}

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

    def _pools(self) -> tuple[list[int], list[int]]:
        """Release candidates: realtime-level ones and the rest (the origin is placed alone).
        Excluded jobs stay in the pools; :meth:`_priorities` ranks them out (cheaper than
        filtering 10 000 indices)."""
        promoted = {i for i, level in self.inherited.items()
                    if level == 0 and self.sv.live[i].state in _WAITING}
        urgent = list(promoted)
        rest = self.sv.waiting_other
        if promoted:
            rest = [i for i in rest if i not in promoted]
        rest_realtime: list[int] = []
        live, remaining = self.sv.live, self.sv.remaining_s
        quantum0_s = self.policy.level_quanta_s[0]
        for i in self.sv.waiting_realtime:
            if i in self.excluded or i in promoted:
                continue
            # Fast path, same answer as level(): a new realtime job that fits the first
            # quantum joins level 0, and nothing can move it lower.
            if (live[i].level is None and remaining[i] <= quantum0_s) or self.level(i) == 0:
                urgent.append(i)
            else:
                rest_realtime.append(i)
        if not self.converging:
            for i in self._restorable(self.excluded):
                (urgent if self.level(i) == 0 else rest_realtime).append(i)
        return urgent, [*rest, *rest_realtime] if rest_realtime else rest

    def _restorable(self, excluded: set[int]) -> list[int]:
        """Load is low again: a few standby and suspended jobs compete for slots once more."""
        budget = self.policy.resume_per_tick
        live, remaining = self.sv.live, self.sv.remaining_s
        by_arrival = lambda i: live[i].submitted_at_s  # noqa: E731
        chosen = heapq.nsmallest(budget, (i for i in self.sv.standby if i not in excluded),
                                 key=by_arrival)
        room = (self.policy.convergence_threshold - self.policy.convergence_hysteresis
                - self.load) * max(len(self.alive), 1) * self.policy.load_horizon_s
        resumable = (i for i in self.sv.suspended if i not in excluded)
        for i in heapq.nsmallest(budget - len(chosen), resumable, key=by_arrival):
            if remaining[i] > room:
                break
            room -= remaining[i]
            chosen.append(i)
        return chosen

    def _reserve(self, staying: list[int], urgent_pool: list[int]) -> frozenset[str]:
        urgent_running = {self.sv.live[i].job_id for i in staying if self.level(i) == 0}
        pressure = self.origin is not None or bool(urgent_running) or bool(urgent_pool)
        until_s = reserve_until_s(pressure, self.snapshot.state.reserve_until_s, self.policy,
                                  self.now_s)
        self.reserve_until_s = until_s
        active = pressure or (until_s is not None and self.now_s < until_s)
        count = reserve_size(len(self.alive), self.policy.resource_reserve_ratio) if active else 0
        return choose_reserved(self.alive, count, self.snapshot.state.reserved_workers,
                               urgent_running)

    def _allocate(self, staying: list[int], urgent_pool: list[int], rest_pool: list[int],
                  cap: int, rest_cap: int, blocked: set[int]) -> None:
        urgent_in = sum(1 for i in staying if self.level(i) == 0)
        counts = [urgent_in, len(staying) - urgent_in]  # in flight: realtime-level, rest
        free = cap - len(staying)
        free = self._place_origin(staying, free, counts, blocked)
        priority = self._priorities()
        urgent = self._best(urgent_pool, cap, priority)
        now = min(len(urgent), max(free, 0))
        self.taken.extend(urgent[:now])
        free -= now
        counts[0] += now
        guarantee = realtime_guarantee(cap, self.policy.realtime_min_share)
        claim = min(len(urgent) - now, max(0, guarantee - counts[0])) if free >= 0 else 0
        rest_running = [i for i in staying if i not in self.victims and self.level(i) > 0]
        victims = self._preempt(rest_running, claim)
        self.taken.extend(urgent[now:now + len(victims)])
        counts[0] += len(victims)
        counts[1] -= len(victims)
        waiting_urgent = len(urgent) > now + len(victims)
        limit = min(rest_cap, cap - guarantee if waiting_urgent else cap)
        room = min(max(free, 0), max(0, limit - counts[1]))
        self.taken.extend(self._best(rest_pool, room, priority))

    def _place_origin(self, staying: list[int], free: int, counts: list[int],
                      blocked: set[int]) -> int:
        """The origin takes a slot first, preempting whatever it must."""
        origin = self.origin
        if origin is None or origin in blocked or origin in self.expired or not (
                origin in self.sv.waiting_realtime or origin in self.sv.waiting_other
                or origin in self.sv.suspended or origin in self.sv.standby):
            return free
        if free <= 0:
            for victim in self._preempt(staying, 1 - free):
                counts[0 if self.level(victim) == 0 else 1] -= 1
                free += 1
        if free > 0:
            self.taken.append(origin)
            counts[0] += 1
            free -= 1
        return free

    def _preempt(self, candidates: Sequence[int], count: int) -> list[int]:
        if count <= 0:
            return []
        live = self.sv.live
        by_id = {live[i].job_id: i for i in candidates
                 if live[i].state is JobState.RUNNING and i != self.origin}
        pairs = [(live[i], self.scores[i]) for i in by_id.values()]
        chosen = [by_id[job_id] for job_id in
                  pick_victims(pairs, count, self.policy.max_preemptions)]
        self.victims.extend(chosen)
        return chosen

    def _priorities(self) -> list[float]:
        """Release order: the score, except that aged jobs come first, longest wait first;
        excluded jobs rank below everything and are dropped by :meth:`_best`."""
        priority = self.scores.copy()
        bound_s, live = self.policy.aging_bound_s, self.sv.live
        for i in self.sv.aged:
            priority[i] = 1.0 + (self.now_s - live[i].waiting_since_s) / bound_s
        for i in self.excluded:
            priority[i] = _EXCLUDED
        return priority

    @staticmethod
    def _best(pool: list[int], count: int, priority: list[float]) -> list[int]:
        best = heapq.nlargest(count, pool, key=priority.__getitem__)
        return [i for i in best if priority[i] != _EXCLUDED]

    # -- output ------------------------------------------------------------------------------

    def _emit(self, top: list[int], suspend: list[int], standby: list[int], staying: list[int],
              reserved: frozenset[str], cap: int) -> TickPlan:
        live, scores = self.sv.live, self.scores
        origin = self.origin
        releases, requeues, retargets = self._moves(staying)
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
        )

    def _target_queue(self, i: int) -> str:
        return queue_for_level(self.level(i))

    def _moves(self, staying: list[int]) -> tuple[tuple[Release, ...], tuple[Requeue, ...],
                                                 tuple[Retarget, ...]]:
        live = self.sv.live
        releases: list[Release] = []
        requeues: list[Requeue] = []
        retargets: list[Retarget] = []
        moving = [i for i in staying if i not in self.victims]
        for i in self.taken:
            job = live[i]
            if job.queue == STANDBY_QUEUE and job.state in (JobState.QUEUED, JobState.RUNNING):
                moving.append(i)
            else:
                releases.append(Release(job.job_id, self._target_queue(i)))
        for i in moving:
            job, target = live[i], self._target_queue(i)
            if job.queue is None or job.queue == target:
                continue
            if job.state is JobState.QUEUED:
                requeues.append(Requeue(job.job_id, job.queue, target))
            else:
                retargets.append(Retarget(job.job_id, job.queue, target))
        return tuple(releases), tuple(requeues), tuple(retargets)

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
