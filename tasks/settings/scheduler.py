"""Settings of the SLO scheduler (``scheduler:`` in configs/default.yaml)."""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.batching import BatchingConfig
from scheduler.fairness import FairShareConfig
from scheduler.lifecycle import SloClass
from scheduler.model import JobKind
from scheduler.policy import OverloadMeasure, PolicyConfig, PolicyKind, ScoreWeights
from tasks.settings.durations import Seconds


class SloClassSettings(BaseModel):
    """Latency target of one SLO class."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    target_s: float = Field(gt=0, le=86400)
    """End-to-end latency target of a job of this class (a submission's default deadline).
    Seconds, in (0, 86400]: a day, so that a target given in milliseconds is refused."""


def _default_classes() -> dict[str, SloClassSettings]:
    return {
        "realtime": SloClassSettings(target_s=1.0),
        "interactive": SloClassSettings(target_s=5.0),
        "batch": SloClassSettings(target_s=60.0),
    }


class ScoreWeightSettings(BaseModel):
    """Weights of the origin score's dimensions; only their ratios matter. Each is a weight in
    [0, 1], and at least one is above 0."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tier: float = Field(default=0.15, ge=0, le=1)
    """Weight of gold tenants over standard ones, in [0, 1]."""
    slo_class: float = Field(default=0.20, ge=0, le=1)
    """Weight of realtime over interactive over batch, in [0, 1]."""
    slack: float = Field(default=0.25, ge=0, le=1)
    """Weight of the share of the deadline budget already spent (estimated finish against
    deadline), in [0, 1]."""
    impact: float = Field(default=0.10, ge=0, le=1)
    """Weight of how visible an SLO miss is, by job kind (``kind_impact``), in [0, 1]."""
    wait: float = Field(default=0.10, ge=0, le=1)
    """Weight of the time waiting, relative to the aging bound, in [0, 1]."""
    progress: float = Field(default=0.05, ge=0, le=1)
    """Weight of the share of chunks done, in [0, 1]."""
    remaining: float = Field(default=0.05, ge=0, le=1)
    """Weight of the shortness of the remaining work, in [0, 1]."""
    preemptions: float = Field(default=0.05, ge=0, le=1)
    """Weight of the preemptions already suffered, relative to ``max_preemptions``, in
    [0, 1]."""
    resource: float = Field(default=0.05, ge=0, le=1)
    """Weight of memory-bound jobs (costlier to checkpoint and move) over compute-bound ones,
    in [0, 1]."""

    @model_validator(mode="after")
    def _some_weight(self) -> ScoreWeightSettings:
        if sum(self.model_dump().values()) <= 0:
            raise ValueError("at least one score weight must be above 0")
        return self


KindName = Literal["text", "image", "video", "simulated"]

Impact = Annotated[float, Field(ge=0, le=1)]
"""How visible an SLO miss of a job kind is: a fraction, in [0, 1]."""
Growth = Annotated[float, Field(ge=0, le=4)]
"""A batched step's slowdown per extra member, relative to a lone step: a ratio in [0, 4]."""
SecondsPerUnit = Annotated[float, Field(gt=0, le=3600)]
"""Seconds per cost unit, in (0, 3600]: an hour per denoising step is past any real model."""
FairWeight = Annotated[float, Field(gt=0, le=1000)]
"""A tier's relative share (only ratios matter), in (0, 1000]."""


def _default_impact() -> dict[KindName, float]:
    return {"text": 1.0, "image": 0.7, "simulated": 0.5, "video": 0.4}


def _default_priors() -> dict[str, float]:
    return dict(PolicyConfig().cost_priors_s_per_unit)  # one list of priors, in the policy


def _default_growth() -> dict[str, float]:
    return dict(BatchingConfig().growth)  # one table, in the policy


class BatchingSettings(BaseModel):
    """Step-level batching: compatible jobs' steps share one forward on a worker."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Let the scheduler pack compatible jobs (same model and shape) into one batched task."""
    max_batch: int = Field(default=8, ge=1, le=256)
    """Most jobs in one batched forward. Jobs, in [1, 256]."""
    realtime_exact: bool = True
    """Realtime jobs run alone unless they say ``exact: false``, as a batched forward's
    numerics differ slightly from a lone one's."""
    growth: dict[str, Growth] = Field(default_factory=_default_growth)
    """Per cost-key prefix (longest match wins): a batched step's slowdown per extra member,
    relative to a lone step (0: free, 1: no gain, so never batched). Each a ratio, in
    [0, 4]."""
    default_growth: float = Field(default=1.0, ge=0, le=4)
    """The growth of a cost key no entry of ``growth`` matches (1: batching gains nothing). A
    ratio, in [0, 4]."""
    learn: bool = True
    """Prefer the growth measured from batched steps, once enough are timed (per chunk kind,
    against lone steps of the same kind), to the table above."""

    def to_config(self) -> BatchingConfig:
        return BatchingConfig(enabled=self.enabled, max_batch=self.max_batch,
                              growth=dict(self.growth), default_growth=self.default_growth,
                              learn=self.learn)


TierName = Literal["gold", "standard"]


def _default_fair_weights() -> dict[TierName, float]:
    return {"gold": FairShareConfig().weight("gold"),
            "standard": FairShareConfig().weight("standard")}  # one table, in the policy


class FairShareSettings(BaseModel):
    """Tenant fair share within each class's band (``scheduler.fairness``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Order each class's band by the tenants' counters, least first: measured worker-seconds
    in the band over the tier's weight, plus the join rule's lift (a tenant that becomes active
    joins at the least standing, counter plus in-flight charges, of those who stayed). A job
    whose slack no longer covers its next chunk still goes first. Off: value-weighted
    remaining work alone. At 10 000 live jobs it costs the held tick 1.3x (1.4x when no view
    changed; docs/scheduling.md, ``tests/bench/bench_tick.py --fair-share``)."""
    weights: dict[TierName, FairWeight] = Field(default_factory=_default_fair_weights)
    """Each tier's relative share of a band while its tenants are backlogged (gold 2,
    standard 1: a gold tenant gets twice a standard one's worker-seconds); a tier not named
    weighs 1. Each a weight (only ratios matter), in (0, 1000]."""

    def to_config(self) -> FairShareConfig:
        return FairShareConfig(enabled=self.enabled,
                               weights={str(tier): w for tier, w in self.weights.items()})


class SchedulerSettings(BaseModel):
    """The scheduling policy's knobs; the reference design's values are the defaults. A load
    is outstanding work seconds over the alive workers' capacity (``load_horizon``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: Literal["fifo", "priority", "edf", "srpt", "least_slack", "stepline"] = "stepline"
    """Which policy plans the ticks: Stepline's, or a baseline (plain FIFO, static class
    priority, or step-preemptive earliest-deadline, shortest-remaining or least-slack first)."""
    origin_detection_interval: Seconds = Field(default=0.1, gt=0, le=10)
    """How often beat sends the scheduler tick (the origin is re-scored every tick). Seconds,
    in (0, 10]."""
    resource_reserve_ratio: float = Field(default=0.2, ge=0, le=0.9)
    """Share of workers realtime work may reclaim by preemption; lent to other work meanwhile,
    held idle only while preemption would come too late for a realtime deadline. A fraction,
    in [0, 0.9]."""
    preemption_timeout: Seconds = Field(default=0.05, gt=0, le=60)
    """How long a preempted job may take to stop (one block group should fit inside). Seconds,
    in (0, 60]."""
    yield_to_waiting: bool = True
    """A worker's chunk yields at its next block-group boundary when a queue the worker takes
    first (a more urgent class) holds work, without waiting for the tick's preempt flag; the
    job stays in flight and resumes from that boundary (``tasks.protocol``)."""
    convergence_threshold: float = Field(default=0.8, gt=0, le=1)
    """Load above which overload convergence pauses batch work. A load, in (0, 1]."""
    slo_classes: dict[str, SloClassSettings] = Field(default_factory=_default_classes)
    """Latency target per class (``realtime``, ``interactive``, ``batch``; none larger than a
    less urgent class's); batch's target is a floor ("> 10 s"), the default deadline."""

    score_weights: ScoreWeightSettings = Field(default_factory=ScoreWeightSettings)
    """Weights of the origin score's nine dimensions."""
    origin_threshold_idle: float = Field(default=0.6, ge=0, le=1)
    """Score a job needs to become the origin when the fleet is idle. A score, in [0, 1]."""
    origin_threshold_loaded: float = Field(default=0.5, ge=0, le=1)
    """Score a job needs to become the origin at load 1 or more (linear in between). A score,
    in [0, 1]."""
    origin_margin: float = Field(default=0.05, ge=0, le=1)
    """Hysteresis: a challenger must beat the current origin's score by this much. A score, in
    [0, 1]."""
    realtime_quantum: Seconds = Field(default=1.0, gt=0, le=3600)
    """Service a job may use at the realtime level before it is demoted. Seconds, in
    (0, 3600], and at most ``interactive_quantum``."""
    interactive_quantum: Seconds = Field(default=5.0, gt=0, le=86400)
    """Service a job may use at the interactive level before it is demoted to batch. Seconds,
    in (0, 86400]."""
    aging_bound: Seconds = Field(default=20.0, gt=0, le=86400)
    """Waiting this long promotes a job one level and releases it ahead of fresher work.
    Seconds, in (0, 86400]."""
    short_job: Seconds = Field(default=5.0, gt=0, le=86400)
    """Remaining work that scores half on the 'remaining' dimension. Seconds, in (0, 86400]."""
    kind_impact: dict[KindName, Impact] = Field(default_factory=_default_impact)
    """Impact of an SLO miss per job kind. Each a fraction, in [0, 1]."""
    slots_per_worker: int = Field(default=1, ge=1, le=64)
    """Jobs in flight (queued or running) per alive worker. Jobs, in [1, 64]."""
    reserve_hold: Seconds = Field(default=2.0, ge=0, le=3600)
    """The reserve stays this long after the last realtime or origin work. Seconds, in
    [0, 3600]."""
    max_preemptions: int = Field(default=20, ge=0, le=1000)
    """A job preempted this many times is not preempted again. Preemptions, in [0, 1000]."""
    convergence_hysteresis: float = Field(default=0.1, ge=0, le=1)
    """Convergence ends only once load is below the threshold minus this. A load, in [0, 1],
    and at most ``convergence_threshold``."""
    load_horizon: Seconds = Field(default=30.0, gt=0, le=86400)
    """Load = outstanding work seconds ÷ (alive workers × this horizon). Seconds, in
    (0, 86400]."""
    resume_per_tick: int = Field(default=4, ge=0, le=100000)
    """Suspended or standby jobs restored per tick once load is low again. Jobs, in
    [0, 100000]."""
    expire_grace: Seconds = Field(default=2.0, ge=0, le=86400)
    """Under overload a job whose estimated finish passes deadline + grace expires. Seconds,
    in [0, 86400]."""
    shed_load: float = Field(default=1.5, gt=0, le=1e6)
    """Admission refuses new standard interactive work from this load. A load, in (0, 1e6]
    (a very large one sheds nothing), and at least ``convergence_threshold``."""
    batch_shed_load: float = Field(default=1.0, gt=0, le=1e6)
    """Admission refuses new standard batch work (429 with Retry-After) past this load, taken
    within [convergence_threshold, shed_load]: batch is parked first, and refused no later
    than interactive work. A load, in (0, 1e6]."""
    degrade_load: float = Field(default=1.0, ge=0, le=1e6)
    """Load past which admission runs a job that gave a ``quality_floor`` at fewer steps,
    when it is predicted to miss its deadline at full quality; a job without a floor is
    never degraded. A load, in [0, 1e6]."""
    overload_measure: Literal["effective", "compute"] = "effective"
    """The load convergence, admission and shedding go by: ``effective`` counts model loads
    as work (the waiting jobs' expected cold loads, or the load time workers paid over the
    last ``load_window``, whichever is more); ``compute`` counts compute work only."""
    load_window: Seconds = Field(default=60.0, ge=1, le=86400)
    """The window over which the load time workers paid is measured (from their heartbeats'
    recent loads). Seconds, in [1, 86400]."""
    max_retry_after: Seconds = Field(default=300.0, ge=0, le=86400)
    """Upper bound of the Retry-After a shed submission is given. Seconds, in [0, 86400]."""
    admission_status_ttl: Seconds = Field(default=2.0, ge=0, le=86400)
    """An admission status older than this is ignored by the submit path (fail open).
    Seconds, in [0, 86400]."""
    top_scores: int = Field(default=16, ge=1, le=10000)
    """How many of the highest scores each plan reports. Jobs, in [1, 10000]."""
    cost_priors: dict[str, SecondsPerUnit] = Field(default_factory=_default_priors)
    """Seconds per cost unit by cost-key prefix (longest match wins) until measured
    (the reference step costs). Each in (0, 3600]."""
    default_cost: float = Field(default=0.05, gt=0, le=3600)
    """Seconds per cost unit for a cost key no prior matches, in (0, 3600]."""
    cost_ewma_alpha: float = Field(default=0.2, gt=0, le=1)
    """Weight of a new chunk timing once the running mean has enough samples. A fraction, in
    (0, 1]."""
    cost_prior_samples: int = Field(default=1, ge=0, le=1000)
    """How many measurements the prior counts for. Samples, in [0, 1000]."""
    hop_overhead: Seconds = Field(default=0.005, ge=0, le=60)
    """Time from one chunk's end to the next one's start (commit, publish, claim), added to
    a job's remaining time per chunk left (``stepline bench`` measures it). Seconds, in
    [0, 60]."""
    late_penalty: float = Field(default=4.0, ge=1, le=1e6)
    """Work past saving (or that the fleet cannot fit with the work that can still make its
    deadline) ranks as on-time work this many times its size. A factor, in [1, 1e6]."""
    cost_min_samples: int = Field(default=3, ge=0, le=1_000_000)
    """Measured chunks of each remaining kind a job's estimate needs before the job may be
    judged unable to meet its deadline (demoted, or shed if it asked to be). Chunks, in
    [0, 1000000]."""
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    """Step-level batching of compatible jobs."""
    fair_share: FairShareSettings = Field(default_factory=FairShareSettings)
    """Tenant fair share within each class's band."""

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerSettings:
        if self.shed_load < self.convergence_threshold:
            raise ValueError("shed_load must be >= convergence_threshold")
        if self.convergence_hysteresis > self.convergence_threshold:
            raise ValueError("convergence_hysteresis must be <= convergence_threshold")
        if self.realtime_quantum > self.interactive_quantum:
            raise ValueError("realtime_quantum must be <= interactive_quantum")
        self._check_classes()
        return self

    def _check_classes(self) -> None:
        """Only the three classes have targets, and a more urgent class's is no larger."""
        order = [c.value for c in SloClass]
        unknown = sorted(set(self.slo_classes) - set(order))
        if unknown:
            raise ValueError(f"slo_classes: no class {unknown}; the classes are {order}")
        targets = [(name, self.slo_classes[name].target_s) for name in order
                   if name in self.slo_classes]
        for (urgent, sooner), (lax, later) in pairwise(targets):
            if sooner > later:
                raise ValueError(f"slo_classes: {urgent}'s target_s ({sooner:g}) must be <= "
                                 f"{lax}'s ({later:g})")

    def to_policy(self) -> PolicyConfig:
        """The pure scheduler's configuration built from these settings."""
        return PolicyConfig(
            policy=PolicyKind(self.policy),
            weights=ScoreWeights(**self.score_weights.model_dump()),
            origin_threshold_idle=self.origin_threshold_idle,
            origin_threshold_loaded=self.origin_threshold_loaded,
            origin_margin=self.origin_margin,
            level_quanta_s=(self.realtime_quantum, self.interactive_quantum),
            aging_bound_s=self.aging_bound,
            short_job_s=self.short_job,
            kind_impact={JobKind(kind): value for kind, value in self.kind_impact.items()},
            slots_per_worker=self.slots_per_worker,
            resource_reserve_ratio=self.resource_reserve_ratio,
            reserve_hold_s=self.reserve_hold,
            max_preemptions=self.max_preemptions,
            convergence_threshold=self.convergence_threshold,
            convergence_hysteresis=self.convergence_hysteresis,
            load_horizon_s=self.load_horizon,
            resume_per_tick=self.resume_per_tick,
            expire_grace_s=self.expire_grace,
            shed_load=self.shed_load,
            batch_shed_load=self.batch_shed_load,
            degrade_load=self.degrade_load,
            overload_measure=OverloadMeasure(self.overload_measure),
            load_window_s=self.load_window,
            max_retry_after_s=self.max_retry_after,
            admission_status_ttl_s=self.admission_status_ttl,
            top_scores=self.top_scores,
            cost_priors_s_per_unit=dict(self.cost_priors),
            default_s_per_unit=self.default_cost,
            cost_ewma_alpha=self.cost_ewma_alpha,
            cost_prior_samples=self.cost_prior_samples,
            cost_min_samples=self.cost_min_samples,
            late_penalty=self.late_penalty,
            hop_overhead_s=self.hop_overhead,
            tick_interval_s=self.origin_detection_interval,
            batching=self.batching.to_config(),
            fair_share=self.fair_share.to_config(),
        )
