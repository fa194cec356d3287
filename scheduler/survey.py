"""Two walks of the snapshot's jobs: the partition by state and the estimates that a tick
needs, then the live jobs' scores and values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from scheduler.admission import paid_load_share
from scheduler.cost import CostModel
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import ClusterSnapshot, JobView, ResourceProfile, Tier, WorkerView
from scheduler.policy import PolicyConfig
from scheduler.queues import STANDBY_QUEUE
from scheduler.scoring import ScoreTerms


class _RateTable:
    """Fleet seconds per cost unit, computed once per distinct cost key per tick."""

    __slots__ = ("_cost", "_devices", "_min_samples", "confident", "rates")

    def __init__(self, cost: CostModel, devices: Sequence[str], min_samples: int) -> None:
        self._cost = cost
        self._devices = devices
        self._min_samples = min_samples
        self.rates: dict[str, float] = {}
        self.confident: dict[str, bool] = {}
        """Per cost key: every device in use has measured ``min_samples`` chunks of it."""

    def learn(self, cost_key: str) -> float:
        # Each distinct device once, then the fleet mean over workers in their order (the same
        # sum as CostModel.fleet_seconds_per_unit, without a prior lookup per worker).
        devices = self._devices
        if devices:
            per_device = {d: self._cost.seconds_per_unit(cost_key, d) for d in set(devices)}
            rate = sum([per_device[d] for d in devices]) / len(devices)
        else:
            rate = self._cost.seconds_per_unit(cost_key)
        self.rates[cost_key] = rate
        self.confident[cost_key] = all(
            self._cost.samples(cost_key, d) >= self._min_samples for d in set(devices)
        ) if devices else self._cost.samples(cost_key) >= self._min_samples
        return rate

    def remaining_s(self, job: JobView) -> tuple[float, bool]:
        """A job split by chunk kind: each kind's units at its own rate, and whether every
        kind's estimate is backed by enough measurements."""
        rates, confident, total, sure = self.rates, self.confident, 0.0, True
        for key, units in job.remaining_units_by_key:
            rate = rates.get(key)
            if rate is None:
                rate = self.learn(key)
            total += units * rate
            sure = sure and (units <= 0.0 or confident[key])
        return total, sure


JOB_VALUE: Mapping[tuple[SloClass, Tier], float] = MappingProxyType({
    (cls, tier): value * (2.0 if tier is Tier.GOLD else 1.0)
    for cls, value in ((SloClass.REALTIME, 4.0), (SloClass.INTERACTIVE, 2.0),
                       (SloClass.BATCH, 1.0))
    for tier in Tier})
"""What meeting a job's deadline is worth relative to others, by (class, tier): its class,
doubled for a gold tenant. The order weighs remaining work by it, and deferral drops the least
value per second of work first."""

_VALUE_BY_TIER: dict[Tier, dict[SloClass, float]] = {
    tier: {cls: value for (cls, of), value in JOB_VALUE.items() if of is tier} for tier in Tier}
""":data:`JOB_VALUE` by tier, then class, read only: two lookups of a member (whose hash its
string keeps) cost less than building and hashing a pair, once per job and tick."""


@dataclass(frozen=True, slots=True)
class Survey:
    """Live jobs, what each is estimated to need and be worth, and index tuples into them."""

    live: tuple[JobView, ...]
    remaining_s: tuple[float, ...]
    values: tuple[float, ...]
    """Each live job's :data:`JOB_VALUE`."""
    scores: tuple[float, ...]
    """Each live job's origin score (:func:`scheduler.scoring.score_jobs`, computed inline), as
    the survey found it (the judgement lowers those of late and deferred work)."""
    waiting_realtime: tuple[int, ...]
    """PENDING or PREEMPTED realtime-class jobs."""
    waiting_other: tuple[int, ...]
    suspended: tuple[int, ...]
    inflight: tuple[int, ...]
    """QUEUED or RUNNING, not on standby and not being preempted: they hold a slot."""
    standby: tuple[int, ...]
    aged: tuple[int, ...]
    """Waiting jobs that have waited at least the aging bound."""
    late: tuple[int, ...]
    """Jobs whose estimated finish passes deadline + grace, on estimates backed by enough
    measurements (``policy.cost_min_samples`` of each chunk kind still to run)."""
    with_deps: tuple[int, ...]
    outstanding_s: float
    """Remaining work of every live job not suspended that is due within the load horizon
    (work due later counts pro rata: horizon ÷ time to its deadline)."""
    cold_s: float
    """The part of ``outstanding_s`` that is expected cold loads (``JobView.load_s``, counted
    pro rata alike)."""
    paid_share: float
    """The share of the alive workers' time spent loading models over the last
    ``load_window_s`` (:func:`scheduler.admission.paid_load_share`)."""
    incumbent: int | None
    """Last tick's origin, if it is still live."""


def survey_jobs(snapshot: ClusterSnapshot, alive: Sequence[WorkerView], policy: PolicyConfig,
                now_s: float) -> Survey:
    """Walk the jobs, estimating, partitioning and scoring them (the tick's hot path: every
    attribute read here costs 10 000 times, so each of the two walks binds what it reads into
    locals once per tick)."""
    part = _estimate(snapshot, alive, policy, now_s)
    live = part.live
    scores, values = _score(live, part.remaining_s, policy, now_s)
    return Survey(
        live=tuple(live), remaining_s=tuple(part.remaining_s), values=tuple(values),
        scores=tuple(scores), waiting_realtime=tuple(part.waiting_realtime),
        waiting_other=tuple(part.waiting_other), suspended=tuple(part.suspended),
        inflight=tuple(part.inflight), standby=tuple(part.standby), aged=tuple(part.aged),
        late=tuple(part.late), with_deps=tuple(part.with_deps),
        outstanding_s=part.outstanding_s, cold_s=part.cold_s,
        paid_share=paid_load_share(alive, policy.load_window_s, now_s),
        incumbent=part.incumbent)


@dataclass(slots=True)
class _Estimates:
    """The live jobs in snapshot order, each one's remaining seconds, the survey's index lists
    into them, and the demand within the load horizon (see :class:`Survey`)."""

    live: list[JobView] = field(default_factory=list)
    remaining_s: list[float] = field(default_factory=list)
    waiting_realtime: list[int] = field(default_factory=list)
    waiting_other: list[int] = field(default_factory=list)
    inflight: list[int] = field(default_factory=list)
    standby: list[int] = field(default_factory=list)
    suspended: list[int] = field(default_factory=list)
    aged: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    with_deps: list[int] = field(default_factory=list)
    outstanding_s: float = 0.0
    cold_s: float = 0.0
    incumbent: int | None = None


def _estimate(snapshot: ClusterSnapshot, alive: Sequence[WorkerView], policy: PolicyConfig,
              now_s: float) -> _Estimates:
    """The live jobs partitioned by state, and what each is estimated to need, in one walk of
    the snapshot's jobs."""
    out = _Estimates()
    table = _RateTable(snapshot.cost, [w.device for w in alive], policy.cost_min_samples)
    rates, confident, incumbent_id = table.rates, table.confident, snapshot.state.origin_id
    bound_s, grace_s, hop_s = policy.aging_bound_s, policy.expire_grace_s, policy.hop_overhead_s
    horizon_s = policy.load_horizon_s
    pending, preempted, suspended = JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED
    queued, running, realtime = JobState.QUEUED, JobState.RUNNING, SloClass.REALTIME
    # bound appends: one attribute lookup per tick instead of one per job
    add_live, add_remaining = out.live.append, out.remaining_s.append
    add_waiting_rt, add_waiting_other = out.waiting_realtime.append, out.waiting_other.append
    add_inflight, add_standby = out.inflight.append, out.standby.append
    add_suspended, add_with_deps = out.suspended.append, out.with_deps.append
    add_aged, add_late = out.aged.append, out.late.append
    outstanding = cold = 0.0
    index = -1
    for job in snapshot.jobs:
        state = job.state
        if state is pending or state is preempted:
            index += 1
            (add_waiting_rt if job.slo_class is realtime else add_waiting_other)(index)
            if now_s - job.waiting_since_s >= bound_s:
                add_aged(index)
        elif state is queued or state is running:
            index += 1
            if not job.preempt_requested:
                (add_standby if job.queue == STANDBY_QUEUE else add_inflight)(index)
        elif state is suspended:
            index += 1
            add_suspended(index)
        else:
            continue
        if job.remaining_units_by_key:
            rem, sure = table.remaining_s(job)
        else:
            cost_key = job.cost_key
            try:
                rem = job.remaining_cost_units * rates[cost_key]
            except KeyError:  # first job of this cost key in the tick (a plain dict stays fast)
                rem = job.remaining_cost_units * table.learn(cost_key)
            sure = confident[cost_key]
        rem += (job.num_chunks - job.next_chunk) * hop_s
        load_s = job.load_s
        if load_s > 0.0:  # a cold start ahead (0.0 added is the same float as none)
            rem += load_s
        add_live(job)
        add_remaining(rem)
        deadline = job.deadline_s
        if state is not suspended:
            # Demand within the horizon: work due later counts pro rata (a video due in five
            # minutes is not an overload of the next thirty seconds).
            due_in_s = deadline - now_s
            if due_in_s <= horizon_s:
                outstanding += rem
                if load_s > 0.0:
                    cold += load_s
            else:
                outstanding += rem * horizon_s / due_in_s
                if load_s > 0.0:
                    cold += load_s * horizon_s / due_in_s
        if now_s + rem > deadline + grace_s and sure:
            add_late(index)
        if job.depends_on:
            add_with_deps(index)
        if job.job_id == incumbent_id:
            out.incumbent = index
    out.outstanding_s, out.cold_s = outstanding, cold
    return out


def _score(live: list[JobView], remaining_s: list[float], policy: PolicyConfig,
           now_s: float) -> tuple[list[float], list[float]]:
    """Each live job's origin score (``score_jobs``' formula, term for term:
    test_survey_scores_equal_score_jobs holds them equal) and its :data:`JOB_VALUE`, in one
    walk of the live jobs."""
    scores: list[float] = []
    values: list[float] = []
    add_score, add_value, value_by_tier = scores.append, values.append, _VALUE_BY_TIER
    running, realtime, interactive = JobState.RUNNING, SloClass.REALTIME, SloClass.INTERACTIVE
    gold, memory, bound_s = Tier.GOLD, ResourceProfile.MEMORY, policy.aging_bound_s
    t = ScoreTerms.from_policy(policy)
    w_gold, w_rt, w_ia, w_mem = t.gold, t.realtime, t.interactive, t.memory
    w_slack, w_wait_max, w_wait, w_prog = t.slack, t.wait_max, t.wait_per_s, t.progress
    w_short, short_s, w_pre_max, w_pre = t.short, t.short_s, t.preemptions_max, t.per_preemption
    max_pre, impact = t.max_preemptions, t.impact
    for job, rem in zip(live, remaining_s, strict=True):
        cls, tier = job.slo_class, job.tier
        add_value(value_by_tier[tier][cls])
        # Each term is >= 0.0 and x + 0.0 == x exactly: a zero term is skipped, not added, and
        # the sum is still score_jobs' float, term for term, in the same order.
        score = w_gold if tier is gold else 0.0
        if cls is realtime:
            score += w_rt
        elif cls is interactive:
            score += w_ia
        if job.resource_profile is memory:
            score += w_mem
        score += impact[job.kind]
        sub = job.submitted_at_s
        budget = job.deadline_s - sub
        if budget <= 0.0:
            score += w_slack
        else:
            spent = (now_s + rem - sub) / budget
            if spent >= 1.0:
                score += w_slack
            elif spent > 0.0:
                score += w_slack * spent
        if job.state is not running:
            waited = now_s - job.waiting_since_s
            if waited >= bound_s:
                score += w_wait_max
            elif waited > 0.0:
                score += w_wait * waited
        tail = w_short / (rem + short_s)
        done = job.next_chunk
        if done:
            tail = w_prog * done / job.num_chunks + tail
        pre = job.preemptions
        if pre:
            tail += w_pre_max if pre >= max_pre else w_pre * pre
        add_score(score + tail)
    return scores, values
