"""The order of one tick: the origin, each job's MLFQ level (aged, inherited) and its rank, as
values built once the judgement is settled (so no answer depends on when it is asked)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler.batching import GrowthTable
from scheduler.fairness import (
    FairJob,
    FairKey,
    Joined,
    ServiceLedger,
    TenantKey,
    fair_keys,
    in_flight_charges,
    join,
    urgency,
)
from scheduler.inheritance import inherit_levels
from scheduler.judgement import Judgement, judge
from scheduler.lifecycle import JobState, SloClass
from scheduler.mlfq import aged_level, current_mark, mark_level
from scheduler.model import ClusterSnapshot, JobView, WorkerView
from scheduler.placement import slack_s
from scheduler.plan import LevelMark
from scheduler.policy import PolicyConfig
from scheduler.queues import LOWEST_LEVEL, queue_for_level
from scheduler.scoring import select_origin
from scheduler.survey import Survey, survey_jobs

_ORIGIN, _ON_TIME = 0, 1
"""Rank bands, best first: the origin, then everything else by key."""

Rank = tuple[float, ...]
"""(band, key, tie-break): smaller ranks first; under fair share (band, fair key, key,
tie-break), the fair key being :data:`scheduler.fairness.FairKey`."""

BAND_NAMES = tuple(c.value for c in sorted(SloClass, key=lambda c: c.rank))
"""The fair share's band of each class rank (``scheduler.fairness``)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """The highest origin scores of the tick and the job chosen as its origin."""

    top: tuple[int, ...]
    """Highest judged scores first (at most ``policy.top_scores``, none below zero)."""
    index: int | None


def choose_origin(survey: Survey, judgement: Judgement, policy: PolicyConfig,
                  top: tuple[int, ...] | None = None) -> Origin:
    """The incumbent keeps the origin unless a challenger beats it by the margin; shed,
    demoted, deferred and blocked work never takes it. ``top``: :func:`top_scores`, when the
    caller found it already."""
    scores, live = judgement.scores, survey.live
    if top is None:
        top = top_scores(scores, policy)
    incumbent = survey.incumbent
    held = None if incumbent is None or incumbent in judgement.expired or (
        incumbent in judgement.deferred or incumbent in judgement.demoted) else (
        live[incumbent].job_id, scores[incumbent])
    candidates = [(live[i].job_id, scores[i]) for i in top[:1]
                  if i not in judgement.blocked and i not in judgement.deferred]
    picked = select_origin(candidates, held, policy.origin_threshold(judgement.load),
                           policy.origin_margin)
    if picked is None:
        return Origin(top, None)
    return Origin(top, incumbent if held is not None and picked[0] == held[0] else top[0])


def top_scores(scores: Sequence[float], policy: PolicyConfig) -> tuple[int, ...]:
    """The ``policy.top_scores`` highest scores, highest first (ties: the earlier job), none
    below zero."""
    return tuple(i for i in heapq.nlargest(policy.top_scores, range(len(scores)),
                                           key=scores.__getitem__) if scores[i] >= 0.0)


@dataclass(frozen=True, slots=True)
class Levels:
    """Each job's MLFQ level this tick: its mark, aged while it waits; 0 for the origin; the
    lowest for demoted work; lowered by inheritance for work others wait on."""

    survey: Survey
    policy: PolicyConfig
    now_s: float
    origin: int | None
    demoted: frozenset[int]
    inherited: Mapping[int, int]
    """Job → the level it inherits from more urgent work waiting on it."""

    def mark(self, i: int) -> LevelMark:
        """The job's MLFQ mark now (demoted work marked at the lowest level)."""
        job = self.survey.live[i]
        if i in self.demoted:
            return LevelMark(LOWEST_LEVEL, job.service_s)
        return current_mark(job, self.work_s(i), self.policy)

    def work_s(self, i: int) -> float:
        """The job's remaining work as its MLFQ level judges its size: the survey's remaining
        seconds without the cold load it expects (``JobView.load_s``: a one-off cost of where
        it runs, which placement may avoid, not work of its own)."""
        load_s = self.survey.live[i].load_s
        remaining_s = self.survey.remaining_s[i]
        return remaining_s - load_s if load_s > 0.0 else remaining_s

    def base_level(self, i: int) -> int:
        """MLFQ level after aging; 0 for the origin; inheritance not applied."""
        if i == self.origin:
            return 0
        if i in self.demoted:
            return LOWEST_LEVEL
        job = self.survey.live[i]
        level = mark_level(job, self.work_s(i), self.policy)
        if level == 0 or job.state is JobState.RUNNING:
            return level
        return aged_level(level, self.now_s - job.waiting_since_s, job.slo_class, self.policy)

    def level(self, i: int) -> int:
        """Effective level: MLFQ, aged, origin, inherited — the job's queue follows it."""
        own = self.base_level(i)
        return min(own, self.inherited.get(i, own)) if self.inherited else own

    def queue(self, i: int) -> str:
        """The queue the job's level publishes to."""
        return queue_for_level(self.level(i))

    def at_lowest(self, i: int) -> bool:
        """``level(i) == LOWEST_LEVEL``, fast for new jobs: a job joins the lowest level when
        it is batch or does not fit the second quantum, and one aging bound of waiting lifts
        it."""
        if i in self.demoted:
            return True
        job = self.survey.live[i]
        if job.level is None:
            fits = self.work_s(i) <= self.policy.level_quanta_s[1]
            if fits and job.slo_class is not SloClass.BATCH:
                return False
            return self.now_s - job.waiting_since_s < self.policy.aging_bound_s
        return self.level(i) == LOWEST_LEVEL


def settle_levels(survey: Survey, judgement: Judgement, origin: Origin, policy: PolicyConfig,
                  now_s: float) -> Levels:
    """The levels, with inheritance: a job others wait on runs at the most urgent waiter's
    level."""
    own = Levels(survey, policy, now_s, origin.index, judgement.demoted, {})
    if not survey.with_deps:
        return own
    live = survey.live
    index = {job.job_id: i for i, job in enumerate(live)}
    depends = {live[i].job_id: live[i].depends_on for i in survey.with_deps}
    for job in live:
        depends.setdefault(job.job_id, ())
    waiters = [(live[i].job_id, own.base_level(i)) for i in survey.with_deps]
    lowered = inherit_levels(waiters, depends, lambda job_id: own.base_level(index[job_id]))
    return Levels(survey, policy, now_s, origin.index, judgement.demoted,
                  {index[job_id]: level for job_id, level in lowered.items()})


@dataclass(frozen=True, slots=True)
class Ranking:
    """Where each job stands in the tick's order (see ``scheduler.planner``): the origin first;
    then shortest value-weighted remaining work first, with aging, where late and deferred work
    counts ``late_penalty`` times its size; work others wait on before everything else."""

    survey: Survey
    levels: Levels
    behind: frozenset[int]
    """Demoted or deferred: ranked as late work."""
    policy: PolicyConfig
    now_s: float
    fair: Sequence[FairKey] | None = None
    """Under fair share, each job's place in its band's fair order (:func:`fair_order`),
    ranked before its key; None: the key alone."""
    joined: Joined | None = None
    """Under fair share, this tick's join (``scheduler.fairness.join``) that the fair order
    read its counters from: the plan carries it for the caller to persist."""

    def slack_s(self, i: int) -> float:
        """Deadline − now − estimated remaining work."""
        return slack_s(self.survey.live[i].deadline_s, self.now_s, self.survey.remaining_s[i])

    def chunk_s(self, i: int) -> float:
        """Estimated time of the job's next chunk (the mean chunk when its size is unknown)."""
        job, remaining_s = self.survey.live[i], self.survey.remaining_s[i]
        if job.next_chunk_cost_units > 0 and job.remaining_cost_units > 0:
            return remaining_s * job.next_chunk_cost_units / job.remaining_cost_units
        return remaining_s / max(job.num_chunks - job.next_chunk, 1)

    def rank(self, i: int) -> Rank:
        """The readable rank of job ``i`` (:meth:`keys` is its fast twin for many jobs)."""
        rank = self._rank(i)
        if self.fair is None or rank[0] == _ORIGIN:
            return rank
        return (rank[0], *self.fair[i], *rank[1:])

    def _rank(self, i: int) -> tuple[int, float, float]:
        remaining_s = self.survey.remaining_s[i]
        job = self.survey.live[i]
        tie = remaining_s / self.survey.values[i]
        levels = self.levels
        if i == levels.origin:
            return (_ORIGIN, 0.0, tie)
        slack = self.slack_s(i)
        if i in self.behind or slack < 0.0:
            # Past saving by the estimate (however few measurements back it: this only
            # orders, it marks and sheds nothing), or deferred: it ranks as on-time work
            # ``late_penalty`` times its size — still before long work that has slack to
            # spare, never before short work that can make its deadline.
            waited_s = 0.0 if job.state is JobState.RUNNING else max(
                self.now_s - job.waiting_since_s, 0.0)
            aged = 1.0 + waited_s / self.policy.aging_bound_s
            return (_ON_TIME, tie * self.policy.late_penalty / aged, tie)
        if levels.inherited and levels.inherited.get(i, LOWEST_LEVEL) < levels.base_level(i):
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
        return (_ON_TIME, remaining_s / self.survey.values[i] * aged, slack)

    def keys(self, indices: Sequence[int]) -> list[tuple[float, ...]]:
        """``rank(i)[1:]`` of many jobs, none of them the origin, inlined: the pool may hold
        10 000 of them (a property test holds it equal to :meth:`rank`)."""
        if self.levels.inherited:
            return [self.rank(i)[1:] for i in indices]
        own = self._keys(indices)
        if self.fair is None:
            return own  # type: ignore[return-value]
        fair = self.fair
        return [(*fair[i], *key) for i, key in zip(indices, own, strict=True)]

    def _keys(self, indices: Sequence[int]) -> list[tuple[float, float]]:
        live, remaining, values = self.survey.live, self.survey.remaining_s, self.survey.values
        now_s, bound_s, penalty = self.now_s, self.policy.aging_bound_s, self.policy.late_penalty
        behind = self.behind
        running = JobState.RUNNING
        keys: list[tuple[float, float]] = []
        append = keys.append
        for i in indices:
            job = live[i]
            rem = remaining[i]
            tie = rem / values[i]
            waited_s = 0.0 if job.state is running else now_s - job.waiting_since_s
            slack = slack_s(job.deadline_s, now_s, rem)
            if slack < 0.0 or i in behind:
                aged = 1.0 + (waited_s if waited_s > 0.0 else 0.0) / bound_s
                append((tie * penalty / aged, tie))
            else:
                append((rem / values[i] * (bound_s / waited_s if waited_s > bound_s else 1.0),
                        slack))
        return keys


@dataclass(frozen=True, slots=True)
class Order:
    """Everything the tick knows about each job before it allocates slots."""

    alive: tuple[WorkerView, ...]
    survey: Survey
    judgement: Judgement
    origin: Origin
    levels: Levels
    ranking: Ranking
    growths: GrowthTable
    """Batched-step growth per job (a memo of the cost model, shared by the load and the
    packing)."""


def order_jobs(snapshot: ClusterSnapshot, policy: PolicyConfig, now_s: float) -> Order:
    """Survey, judge, choose the origin, settle the levels and rank: the steps before
    allocation, each a value built from the ones before it."""
    alive = tuple(w for w in snapshot.workers if w.alive)
    survey = survey_jobs(snapshot, alive, policy, now_s)
    growths = GrowthTable(snapshot.cost, policy.batching, policy.cost_min_samples)
    judgement = judge(survey, snapshot.state.admission, len(alive), growths, policy, now_s)
    origin = choose_origin(survey, judgement, policy)
    levels = settle_levels(survey, judgement, origin, policy, now_s)
    ranking = Ranking(survey, levels, judgement.demoted | judgement.deferred, policy, now_s)
    if policy.fair_share.enabled:
        ranking = with_fair_share(ranking, snapshot.service)
    return Order(alive, survey, judgement, origin, levels, ranking, growths)


def with_fair_share(ranking: Ranking, ledger: ServiceLedger | None) -> Ranking:
    """``ranking`` with this tick's join and its fair order (:func:`fair_order`)."""
    everyone = range(len(ranking.survey.live))
    if ranking.levels.inherited:
        within: Sequence[tuple[float, ...]] = [ranking.rank(i)[1:] for i in everyone]
    else:
        within = ranking.keys(everyone)
    return fair_order(ranking, ledger, within)


def fair_order(ranking: Ranking, ledger: ServiceLedger | None,
               within: Sequence[tuple[float, ...]]) -> Ranking:
    """``ranking`` with the join (its active set: the tenants of work that contends for a
    worker; their standings: the counters plus their in-flight charges) and each live job's
    :data:`~scheduler.fairness.FairKey`: its class's band, its urgency (its slack against its
    next chunk; late, demoted and deferred work past saving; work others wait on urgent), its
    start tag in its tenant's queue, warm or cold. ``within``: :meth:`Ranking.keys` of every
    job without fair share (a tenant's own order)."""
    survey, levels, policy = ranking.survey, ranking.levels, ranking.policy
    config = policy.fair_share
    inherited = levels.inherited
    queued, running = JobState.QUEUED, JobState.RUNNING
    jobs: list[FairJob] = []
    for i, job in enumerate(survey.live):
        chunk_s = ranking.chunk_s(i)
        if inherited and inherited.get(i, LOWEST_LEVEL) < levels.base_level(i):
            urgent = 0
        else:
            urgent = urgency(ranking.slack_s(i), chunk_s, i in ranking.behind)
        jobs.append(FairJob(job.slo_class.rank, job.tenant, config.weight(job.tier.value),
                            urgent, job.state is queued or job.state is running, chunk_s,
                            job.load_s <= 0.0))
    # a standing counts the chunks running, not those queued: submission queues a job at
    # once, so a tenant's whole backlog would count and lift a joiner by it (minus its own)
    running_jobs = [fair for fair, job in zip(jobs, survey.live, strict=True)
                    if job.state is running]
    joined = join(ledger or ServiceLedger(), active_tenants(survey.live), config,
                  in_flight_charges(running_jobs, BAND_NAMES))
    counters = joined.ledger.virtual(config)
    keys = fair_keys(jobs, [(k[0], k[1]) for k in within], counters, BAND_NAMES)
    return replace(ranking, fair=tuple(keys), joined=joined)


_CONTENDING = frozenset({JobState.PENDING, JobState.PREEMPTED, JobState.QUEUED, JobState.RUNNING})


def active_tenants(jobs: Sequence[JobView]) -> frozenset[TenantKey]:
    """(band, tenant) of every live job that contends for a worker (suspended work does not:
    the tick holds it back whatever its tenant)."""
    contending = _CONTENDING
    return frozenset({(job.slo_class.value, job.tenant) for job in jobs
                      if job.state in contending})
