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

Each step is a function of the values before it, returning a frozen value of its own: the
survey (``scheduler.survey``), the judgement (``scheduler.judgement``), the origin, levels and
ranking (``scheduler.ordering``), the flight and the allocation (``scheduler.allocation``), the
reserve (``scheduler.reserve``); this module turns them into the :class:`TickPlan`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.admission import admission_status, parked_reason
from scheduler.allocation import Allocation, Flight, allocate, fill_idle, plan_flight
from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot, JobView
from scheduler.ordering import Order, order_jobs
from scheduler.plan import Expiry, LevelMark, Release, Requeue, Retarget, TickPlan
from scheduler.policy import PolicyConfig
from scheduler.queues import REALTIME_QUEUE, STANDBY_QUEUE
from scheduler.reserve import Reserve, hold_reserve, worker_queues
from scheduler.state import PolicyState


def plan_stepline(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> TickPlan:
    """The Stepline policy's plan for this tick."""
    order = order_jobs(snapshot, policy, now_s)
    flight = plan_flight(order, policy)
    cap = len(order.alive) * policy.slots_per_worker
    reserve = hold_reserve(order, flight.staying, snapshot.state, policy, now_s)
    allocation = allocate(order, flight, reserve.workers, cap, policy)
    standby = (*flight.standby, *allocation.trimmed)
    restored = fill_idle(order, flight, allocation, standby, cap)
    return _Emit(order, flight, allocation, reserve, snapshot.state, policy, now_s).plan(
        standby, cap, restored)


def _job_ids(live: tuple[JobView, ...], indices: Iterable[int]) -> tuple[str, ...]:
    return tuple([live[i].job_id for i in indices])  # a list first: faster than a generator


@dataclass(frozen=True, slots=True)
class _Emit:
    """The tick's values written out as a plan: job indices become ids, moves become actions."""

    order: Order
    flight: Flight
    allocation: Allocation
    reserve: Reserve
    previous: PolicyState
    policy: PolicyConfig
    now_s: float
    estimates: dict[str, float] | None = None
    """The first estimates, when the caller has them already (else found here)."""

    def plan(self, standby: tuple[int, ...], cap: int, restored: tuple[int, ...]) -> TickPlan:
        order, allocation, policy = self.order, self.allocation, self.policy
        live, scores, judgement = order.survey.live, order.judgement.scores, order.judgement
        origin = order.levels.origin
        releases, requeues, retargets = self._moves()
        releases += tuple(self._release(i, STANDBY_QUEUE) for i in restored)
        victims = allocation.victims
        touched = [*allocation.taken, *(i for i in self.flight.staying if i not in victims),
                   *judgement.demoted]
        reserved = self.reserve.workers
        status = admission_status(judgement.admission, judgement.load, policy, self.now_s,
                                  judgement.figures)
        return TickPlan(
            policy=policy.policy,
            now_s=self.now_s,
            origin_id=None if origin is None else live[origin].job_id,
            origin_score=None if origin is None else scores[origin],
            top_scores=tuple((live[i].job_id, scores[i]) for i in order.origin.top),
            releases=releases,
            atomic_release=False,
            requeues=requeues,
            retargets=retargets,
            preempt=_job_ids(live, victims),
            suspend=_job_ids(live, self.flight.suspend),
            standby=_job_ids(live, standby),
            expire=tuple(Expiry(live[i].job_id, reason)
                         for i, reason in judgement.expired.items()),
            levels=self._changed_marks(touched),
            reserved_workers=reserved,
            worker_queues=worker_queues(order.alive, reserved),
            admission=status,
            suspend_reason=parked_reason(status, policy),
            capacity_slots=cap,
            state=self._next_state(),
            estimates=self._first_estimates() if self.estimates is None else self.estimates,
            fair_share=order.ranking.joined,
            reserve_reason=self.reserve.reason,
            deferred=_job_ids(live, sorted(judgement.deferred)),
        )

    def _first_estimates(self) -> dict[str, float]:
        live, remaining = self.order.survey.live, self.order.survey.remaining_s
        return {live[i].job_id: live[i].service_s + remaining[i]
                for i in range(len(live)) if not live[i].estimated}

    def _release(self, i: int, queue: str) -> Release:
        job, remaining_s = self.order.survey.live[i], self.order.survey.remaining_s[i]
        return Release(job.job_id, queue, estimate_s=job.service_s + remaining_s)

    def _moves(self) -> tuple[tuple[Release, ...], tuple[Requeue, ...], tuple[Retarget, ...]]:
        live, levels = self.order.survey.live, self.order.levels
        releases: list[Release] = []
        requeues: list[Requeue] = []
        retargets: list[Retarget] = []
        leaving = {*self.allocation.victims, *self.allocation.trimmed}
        moving = [i for i in self.flight.staying if i not in leaving]
        batches = self._batches_of_taken()
        for i in self.allocation.taken:
            job = live[i]
            if job.queue == STANDBY_QUEUE and job.state in (JobState.QUEUED, JobState.RUNNING):
                moving.append(i)
            else:
                batch, join = batches.get(i, (None, False))
                releases.append(Release(job.job_id, levels.queue(i), estimate_s=job.service_s
                                        + self.order.survey.remaining_s[i], batch=batch,
                                        join=join))
        shared = Counter(live[i].batch_id for i in moving if live[i].batch_id is not None)
        for i in moving:
            job, target = live[i], levels.queue(i)
            if i == levels.origin and job.batch_group is not None and (
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
        live, taken = self.order.survey.live, set(self.allocation.taken)
        found: dict[int, tuple[str, bool]] = {}
        for slot in self.allocation.slots:
            if slot.group is None:
                continue
            batch, join = slot.batch_id, slot.batch_id is not None
            if batch is None:
                batch = f"{live[slot.members[0]].job_id}.{round(self.now_s * 1000)}"
            found.update((i, (batch, join)) for i in slot.members if i in taken)
        return found

    def _changed_marks(self, touched: list[int]) -> dict[str, LevelMark]:
        live, levels = self.order.survey.live, self.order.levels
        changed: dict[str, LevelMark] = {}
        for i in touched:
            job, mark = live[i], levels.mark(i)
            if job.level != mark.level or job.level_service_s != mark.service_mark_s:
                changed[job.job_id] = mark
        return changed

    def _next_state(self) -> PolicyState:
        previous, origin = self.previous, self.order.levels.origin
        origin_id = None if origin is None else self.order.survey.live[origin].job_id
        since_s = previous.origin_since_s if origin_id == previous.origin_id else (
            None if origin_id is None else self.now_s)
        return PolicyState(origin_id=origin_id, origin_since_s=since_s,
                           admission=self.order.judgement.admission,
                           reserve_until_s=self.reserve.until_s,
                           reserved_workers=tuple(sorted(self.reserve.workers)))
