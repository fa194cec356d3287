"""Who holds the tick's slots: the flight (what leaves under overload, what stays, what competes)
and the allocation (the ``cap`` best-ranked jobs packed into slots, preemption victims)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from scheduler.batching import PlacedSlot, SlotPacker
from scheduler.lifecycle import JobState, SloClass
from scheduler.ordering import Order
from scheduler.policy import PolicyConfig
from scheduler.queues import LOWEST_LEVEL, STANDBY_QUEUE


@dataclass(frozen=True, slots=True)
class Flight:
    """The in-flight work before allocation, and the pool that competes for slots with it."""

    suspend: tuple[int, ...]
    """Overload: waiting batch-level work held back (→ SUSPENDED)."""
    standby: tuple[int, ...]
    """Overload: in-flight lowest-level work moved to the standby queue."""
    staying: tuple[int, ...]
    """In flight and not leaving: they keep their slot unless the allocation trims them."""
    staying_set: frozenset[int]
    excluded: frozenset[int]
    """Leaving, blocked, or the origin (placed apart: it ranks first)."""
    pool: tuple[int, ...]
    """Release candidates: waiting jobs not excluded, standby work, and once load is low
    again, a few suspended jobs."""


def plan_flight(order: Order, policy: PolicyConfig) -> Flight:
    """Under overload, batch-level work is held back and lowest-level in-flight work goes to
    standby; everything else in flight stays, and the rest competes."""
    judgement, survey = order.judgement, order.survey
    converging = judgement.converging
    suspend = _suspend(order) if converging else ()
    standby = tuple(i for i in survey.inflight if i not in judgement.expired
                    and order.levels.level(i) == LOWEST_LEVEL) if converging else ()
    gone = {*judgement.expired, *suspend, *standby, *judgement.blocked}
    staying = tuple(i for i in survey.inflight if i not in gone)
    if order.levels.origin is not None:
        gone.add(order.levels.origin)
    excluded = frozenset(gone)
    return Flight(suspend, standby, staying, frozenset(staying), excluded,
                  _pool(order, excluded, policy))


def _suspend(order: Order) -> tuple[int, ...]:
    """Overload: waiting batch work — batch class, or demoted to the batch level — is held
    back, unless it is the origin or something more urgent waits on it."""
    survey, levels = order.survey, order.levels
    live, batch, at_lowest = survey.live, SloClass.BATCH, levels.at_lowest
    kept = {*levels.inherited, *order.judgement.expired, levels.origin}
    held = [i for i in survey.waiting_other
            if i not in kept and (live[i].slo_class is batch or at_lowest(i))]
    # A realtime-class job too big for the realtime quantum skip-joins the batch level: under
    # overload it is held back like any other batch-level work.
    return (*held, *(i for i in survey.waiting_realtime if i not in kept and at_lowest(i)))


def _pool(order: Order, excluded: frozenset[int], policy: PolicyConfig) -> tuple[int, ...]:
    survey, converging = order.survey, order.judgement.converging
    pool = [i for i in (*survey.waiting_realtime, *survey.waiting_other) if i not in excluded]
    # Standby work competes like any other, except batch-level work while overload
    # convergence holds it back (it is restored a few jobs per tick once load is low).
    pool.extend(i for i in survey.standby if i not in excluded
                and not (converging and order.levels.level(i) == LOWEST_LEVEL))
    if not converging:
        pool.extend(_restorable(order, excluded, policy))
    return tuple(pool)


def _restorable(order: Order, excluded: frozenset[int], policy: PolicyConfig) -> list[int]:
    """Load is low again: a few suspended jobs compete for slots once more."""
    survey = order.survey
    live, remaining = survey.live, survey.remaining_s
    by_arrival = lambda i: live[i].submitted_at_s  # noqa: E731
    chosen: list[int] = []
    room = (policy.convergence_threshold - policy.convergence_hysteresis
            - order.judgement.load) * max(len(order.alive), 1) * policy.load_horizon_s
    resumable = (i for i in survey.suspended if i not in excluded)
    for i in heapq.nsmallest(policy.resume_per_tick, resumable, key=by_arrival):
        if remaining[i] > room:
            break
        room -= remaining[i]
        chosen.append(i)
    return chosen


@dataclass(frozen=True, slots=True)
class Allocation:
    """The in-flight work after this plan."""

    taken: tuple[int, ...]
    """Released into a slot (they were not in flight)."""
    trimmed: tuple[int, ...]
    """In flight but outside the top, not preempted: their next chunk goes to standby."""
    victims: tuple[int, ...]
    """Running jobs that yield their worker by preemption."""
    slots: tuple[PlacedSlot, ...]
    """One per worker's worth of work: a lone job or a batch of compatible jobs."""


def allocate(order: Order, flight: Flight, reserved: frozenset[str], cap: int,
             policy: PolicyConfig) -> Allocation:
    """The ``cap`` best-ranked jobs are the ones in flight. Waiting ones among them are
    released; in-flight ones outside them go to the standby queue (consumed last, so they still
    run on a worker nothing else wants); a running one yields its worker by preemption when a
    job in the top cannot wait for a worker to free (see :func:`_displace`). Submissions go
    straight to their class queue, so the in-flight set may be over-full here: this is where it
    is put back in the policy's order."""
    return allocate_ranked(order, flight, ranked_candidates(order, flight, cap, policy),
                           reserved, cap, policy)


def ranked_candidates(order: Order, flight: Flight, cap: int, policy: PolicyConfig) -> list[int]:
    """The in-flight work and the best-ranked of the pool (as many as the slots could take,
    batched), with the origin if it waits: best rank first."""
    staying, pool = flight.staying, flight.pool
    keys = order.ranking.keys(pool)
    best = heapq.nsmallest(cap * jobs_per_slot(order, pool, policy) + len(staying),
                           range(len(pool)), key=keys.__getitem__)
    candidates = [*staying, *(pool[k] for k in best)]
    origin = order.levels.origin
    if origin is not None and origin_waits(order, flight, origin):
        candidates.append(origin)
    return sorted(candidates, key=order.ranking.rank)


def jobs_per_slot(order: Order, pool: tuple[int, ...], policy: PolicyConfig) -> int:
    """How many jobs a slot may take: a batch's worth once any job of the pool may batch."""
    live, batching = order.survey.live, policy.batching
    shared = batching.enabled and any(live[i].batch_group is not None for i in pool)
    return batching.max_batch if shared else 1


def allocate_ranked(order: Order, flight: Flight, ranked: list[int], reserved: frozenset[str],
                    cap: int, policy: PolicyConfig) -> Allocation:
    """:func:`allocate` once the candidates are ranked (:func:`ranked_candidates`)."""
    live, staying = order.survey.live, flight.staying
    top, slots = _Packing(order, flight, policy).pack(ranked, cap, reserved)
    in_top = set(top)
    taken = tuple(i for i in top if i not in flight.staying_set)
    trimmed = [i for i in staying if i not in in_top]
    # Work on standby holds no slot but may hold a worker: it yields like the rest.
    on_standby = [i for i in order.survey.standby if live[i].state is JobState.RUNNING
                  and i not in in_top and not live[i].preempt_requested]
    running = [i for i in (*staying, *on_standby) if live[i].state is JobState.RUNNING]
    # a running batch holds one worker, however many jobs it carries
    workers_free = len(order.alive) - len({live[i].batch_id or i for i in running})
    needy = [slot.members[0] for slot in slots
             if all(live[i].state is not JobState.RUNNING for i in slot.members)]
    holders = [i for i in (*trimmed, *on_standby) if live[i].state is JobState.RUNNING]
    victims = _displace(order, needy[max(workers_free, 0):], holders, policy)
    return Allocation(taken, tuple(i for i in trimmed if i not in victims), victims, slots)


def origin_waits(order: Order, flight: Flight, origin: int) -> bool:
    survey, judgement = order.survey, order.judgement
    return origin not in judgement.blocked and origin not in judgement.expired \
        and origin not in flight.staying_set and (
            origin in survey.waiting_realtime or origin in survey.waiting_other
            or origin in survey.suspended or origin in survey.standby)


def _displace(order: Order, challengers: list[int], holders: list[int],
              policy: PolicyConfig) -> tuple[int, ...]:
    """Challengers (best first) that no free worker serves take the workers of running jobs
    outside the top (worst first) by preemption — else the job that holds the worker and one
    of the top would share it chunk by chunk — unless a chunk ends in time: a job outside the
    top gives its worker up at its chunk's end anyway (its next chunk goes to standby), so a
    challenger whose slack outlasts that end waits for it."""
    live, ranking, limit = order.survey.live, order.ranking, policy.max_preemptions
    chunk_ends = sorted(ranking.chunk_s(i) for i in holders)
    origin = order.levels.origin
    holders = sorted((i for i in holders if live[i].preemptions < limit and i != origin),
                     key=ranking.rank, reverse=True)
    margin_s = policy.tick_interval_s
    victims: list[int] = []
    for k, challenger in enumerate(challengers):
        if not holders:
            break
        if k < len(chunk_ends) and ranking.slack_s(challenger) >= chunk_ends[k] + margin_s:
            continue
        victims.append(holders.pop(0))
    return tuple(victims)


@dataclass(frozen=True, slots=True)
class _Packing:
    """How the ranked candidates share slots (see ``scheduler.batching``)."""

    order: Order
    flight: Flight
    policy: PolicyConfig

    def pack(self, ordered: list[int], cap: int,
             reserved: frozenset[str]) -> tuple[list[int], tuple[PlacedSlot, ...]]:
        """``ordered`` packed into ``cap`` slots, best first (compatible jobs share a slot as a
        batch); while the reserve is held, work below the realtime level opens only the
        unreserved workers' slots."""
        room = cap
        if reserved:
            room = (len(self.order.alive) - len(reserved)) * self.policy.slots_per_worker
        survey, levels, growths = self.order.survey, self.order.levels, self.order.growths
        packer = SlotPacker(self.policy.batching, cap, self.order.ranking.slack_s,
                            survey.remaining_s.__getitem__, self._batches_in_flight())
        top: list[int] = []
        for i in ordered:
            low = levels.level(i) > 0
            slot = packer.add(i, self._batch_group(i), growths.of(survey.live[i]),
                              self._batch_of(i), may_open=not low or room > 0)
            if slot is None:
                continue
            top.append(i)
            if low and len(slot.members) == 1:
                room -= 1
        return top, packer.placed()

    def _batches_in_flight(self) -> dict[str, tuple[tuple[str, str], list[int]]]:
        """batch id → (its group, its members staying in flight)."""
        found: dict[str, tuple[tuple[str, str], list[int]]] = {}
        for i in self.flight.staying_set:
            batch_id, group = self._batch_of(i), self._batch_group(i)
            if batch_id is not None and group is not None:
                found.setdefault(batch_id, (group, []))[1].append(i)
        return found

    def _batch_group(self, i: int) -> tuple[str, str] | None:
        """(batch group, queue) of a job that may share its slot; None: it runs alone (the
        origin is never slowed by batching)."""
        order = self.order
        job = order.survey.live[i]
        if job.batch_group is None or i == order.levels.origin \
                or not self.policy.batching.pays(order.growths.of(job)):
            return None
        if i in self.flight.staying_set and self._batch_of(i) is None:
            return None  # in flight on its own: its messages carry it alone
        if job.queue == STANDBY_QUEUE and job.state in (JobState.QUEUED, JobState.RUNNING):
            return None  # restored from standby by a move, which carries it alone
        return (job.batch_group, order.levels.queue(i))

    def _batch_of(self, i: int) -> str | None:
        """The batch an in-flight job runs in (a job being preempted has left it)."""
        job = self.order.survey.live[i]
        if i in self.flight.staying_set and not job.preempt_requested:
            return job.batch_id
        return None


def idle_slots(order: Order, flight: Flight, allocation: Allocation, standby: tuple[int, ...],
               cap: int) -> int:
    """Slots :func:`fill_idle` may give to suspended work: under overload convergence, the
    capacity no in-flight, taken or standby work holds (0 otherwise)."""
    if not order.judgement.converging:
        return 0
    in_flight = (len(flight.staying) - len(allocation.victims) - len(allocation.trimmed)
                 + len(allocation.taken))
    return cap - in_flight - len(order.survey.standby) - len(standby)


def fill_idle(order: Order, flight: Flight, allocation: Allocation, standby: tuple[int, ...],
              cap: int) -> tuple[int, ...]:
    """Work conservation under overload: slots no runnable job wants go to suspended work,
    released to the standby queue (consumed last, so it yields to everything else)."""
    idle = idle_slots(order, flight, allocation, standby, cap)
    if idle <= 0:
        return ()
    live, blocked = order.survey.live, order.judgement.blocked
    return tuple(heapq.nsmallest(idle, (i for i in order.survey.suspended
                                        if i not in flight.excluded and i not in blocked),
                                 key=lambda i: live[i].submitted_at_s))
