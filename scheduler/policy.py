"""PolicyConfig: every knob of the scheduling policy, as one immutable value."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from scheduler.batching import BatchingConfig
from scheduler.cost import CostModel
from scheduler.errors import InvalidPolicy
from scheduler.fairness import FairShareConfig
from scheduler.model import JobKind
from scheduler.recovery import RecoveryConfig


class PolicyKind(str, Enum):
    """Which planner runs the tick."""

    FIFO = "fifo"
    """Baseline: every job released at once, in arrival order, to ``batch``, as one atomic task."""
    PRIORITY = "priority"
    """Baseline: static class → queue, chunked; no aging, origin, reserve, preemption, overload."""
    EDF = "edf"
    """Baseline, step-preemptive: the in-flight slots go to the earliest absolute deadlines."""
    SRPT = "srpt"
    """Baseline, step-preemptive: the in-flight slots go to the least estimated remaining work."""
    LEAST_SLACK = "least_slack"
    """Baseline, step-preemptive: the in-flight slots go to the least slack (deadline − now −
    estimated remaining work)."""
    STEPLINE = "stepline"
    """Origin, MLFQ with skip-join and aging, reserve, preemption, overload convergence."""


class OverloadMeasure(str, Enum):
    """Which load figure overload convergence, admission and shedding go by
    (``scheduler.admission.LoadFigures``)."""

    EFFECTIVE = "effective"
    """Compute work plus the expected model loads (the cold loads waiting jobs need, or the
    load time the fleet is paying, whichever is more)."""
    COMPUTE = "compute"
    """Compute work only: loads do not count (kept for comparison)."""


@dataclass(frozen=True, slots=True)
class ScoreWeights:
    """Weight of each normalised score dimension; the score divides by their sum, so it is in
    [0, 1] and only the ratios matter."""

    tier: float = 0.15
    slo_class: float = 0.20
    slack: float = 0.25
    impact: float = 0.10
    wait: float = 0.10
    progress: float = 0.05
    remaining: float = 0.05
    preemptions: float = 0.05
    resource: float = 0.05

    def as_tuple(self) -> tuple[float, ...]:
        return (self.tier, self.slo_class, self.slack, self.impact, self.wait, self.progress,
                self.remaining, self.preemptions, self.resource)


def _default_impact() -> dict[JobKind, float]:
    # A stalled chat reply is seen at once; a late video is noticed least.
    return {JobKind.TEXT: 1.0, JobKind.IMAGE: 0.7, JobKind.SIMULATED: 0.5, JobKind.VIDEO: 0.4}


def _default_priors() -> dict[str, float]:
    # Seconds per cost unit (one denoising step = one unit): H100 figures of step-costs.md for
    # the production shapes; the tiny CPU recipes as measured here; a simulated job's units are
    # already seconds.
    return {"image-256": 0.010, "image-512": 0.03, "image-1024": 0.23, "video-480p": 1.3,
            "video-720p": 30.0, "text": 0.006, "simulated": 1.0, "dit-tiny": 0.005,
            "pixart-tiny": 0.005, "wan-tiny": 0.015, "mixtral-tiny": 0.004,
            "qwen3-moe-tiny": 0.002, "olmoe-tiny": 0.002}


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The scheduling policy's knobs. Built from settings by ``SchedulerSettings.to_policy``."""

    policy: PolicyKind = PolicyKind.STEPLINE
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    origin_threshold_idle: float = 0.6
    """Origin threshold at load 0: at low load only a job in real danger becomes the origin."""
    origin_threshold_loaded: float = 0.5
    """Origin threshold at load >= 1 (linear in between): under contention it is lower."""
    origin_margin: float = 0.05
    """A challenger must beat the incumbent origin by this much (hysteresis)."""
    level_quanta_s: tuple[float, float] = (1.0, 5.0)
    """Service quantum of levels 0 and 1 (level 2 has none); also the skip-join size bounds."""
    aging_bound_s: float = 20.0
    """A job waiting this long is promoted one level per bound and released ahead of others."""
    short_job_s: float = 5.0
    """Remaining work that scores half on the 'remaining' dimension (shorter scores higher)."""
    kind_impact: Mapping[JobKind, float] = field(default_factory=_default_impact)
    """SLO-violation impact per job kind, in [0, 1]."""
    slots_per_worker: int = 1
    """Jobs in flight (queued or running) per alive worker."""
    resource_reserve_ratio: float = 0.2
    """Share of workers realtime work may reclaim by preemption whatever the other jobs'
    slack; lent to other work meanwhile, and held idle only while preemption would come too
    late for a realtime deadline (a block group outlasts realtime work's slack)."""
    reserve_hold_s: float = 2.0
    """A held reserve stays this long after realtime/origin pressure ends."""
    hop_overhead_s: float = 0.005
    """Time between one chunk's end and the next one's start (commit, publish, claim): every
    chunk still to run adds it to a job's remaining time."""
    late_penalty: float = 4.0
    """Work past saving by its estimate, or deferred because the fleet cannot fit it with the
    work that can still make its deadline, ranks as on-time work this many times its size."""
    tick_interval_s: float = 0.1
    """How often the policy plans: a decision put off now is taken again this much later."""
    cost_min_samples: int = 3
    """A job is judged unable to meet its deadline (demoted, or shed when it asked to be) only
    on estimates backed by this many measured chunks of each kind it still has to run."""
    max_preemptions: int = 20
    """A job preempted this often is not preempted again."""
    convergence_threshold: float = 0.8
    convergence_hysteresis: float = 0.1
    """Convergence ends when load falls below threshold minus this."""
    load_horizon_s: float = 30.0
    """Load = outstanding work seconds ÷ (alive workers × this horizon)."""
    resume_per_tick: int = 4
    """Suspended or standby jobs restored per tick once load is low again."""
    expire_grace_s: float = 2.0
    """Under overload a job expires when its estimated finish passes deadline + grace."""
    shed_load: float = 1.5
    """Admission sheds new standard interactive work from this load."""
    batch_shed_load: float = 1.0
    """Admission sheds new standard batch work past this load (kept within [the convergence
    threshold, ``shed_load``]: batch is parked first, and refused before interactive work)."""
    degrade_load: float = 1.0
    """Past this load, admission runs a job that gave a quality floor at fewer steps when it
    is predicted to miss its deadline at full quality (``scheduler.degradation``)."""
    overload_measure: OverloadMeasure = OverloadMeasure.EFFECTIVE
    """The load figure convergence, admission and shedding go by."""
    load_window_s: float = 60.0
    """The window over which the load time workers paid is measured (the effective load's
    paid share: seconds loading ÷ worker seconds in the last window)."""
    max_retry_after_s: float = 300.0
    admission_status_ttl_s: float = 2.0
    """An admission status older than this is ignored by ``admit`` (fail open)."""
    top_scores: int = 16
    """How many of the highest scores a plan reports."""
    cost_priors_s_per_unit: Mapping[str, float] = field(default_factory=_default_priors)
    """Seconds per cost unit, keyed by cost_key prefix (the longest match wins)."""
    default_s_per_unit: float = 0.05
    cost_ewma_alpha: float = 0.2
    cost_prior_samples: int = 1
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """When the tick requeues lost, stuck, unpublished and parked chunks."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Which jobs share a worker slot as one batched forward (``scheduler.batching``)."""
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    """Tenant fair share within each class's band (``scheduler.fairness``)."""

    def __post_init__(self) -> None:
        for name, value, low, high in self._bounds():
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidPolicy(f"{name} must be in [{low}, {high}], got {value}")
        if sum(self.weights.as_tuple()) <= 0 or min(self.weights.as_tuple()) < 0:
            raise InvalidPolicy("score weights must be >= 0 with a positive sum")
        if not 0 < self.level_quanta_s[0] <= self.level_quanta_s[1]:
            raise InvalidPolicy(f"level_quanta_s must be increasing and > 0: {self.level_quanta_s}")
        if any(not 0 <= v <= 1 for v in self.kind_impact.values()):
            raise InvalidPolicy("kind_impact values must be in [0, 1]")

    def _bounds(self) -> tuple[tuple[str, float, float, float], ...]:
        return (
            ("origin_threshold_idle", self.origin_threshold_idle, 0.0, 1.0),
            ("origin_threshold_loaded", self.origin_threshold_loaded, 0.0, 1.0),
            ("origin_margin", self.origin_margin, 0.0, 1.0),
            ("aging_bound_s", self.aging_bound_s, 1e-3, 1e6),
            ("short_job_s", self.short_job_s, 1e-3, 1e6),
            ("cost_min_samples", self.cost_min_samples, 0, 1_000_000),
            ("hop_overhead_s", self.hop_overhead_s, 0.0, 60.0),
            ("tick_interval_s", self.tick_interval_s, 1e-3, 60.0),
            ("late_penalty", self.late_penalty, 1.0, 1e6),
            ("slots_per_worker", self.slots_per_worker, 1, 64),
            ("resource_reserve_ratio", self.resource_reserve_ratio, 0.0, 0.9),
            ("reserve_hold_s", self.reserve_hold_s, 0.0, 3600.0),
            ("max_preemptions", self.max_preemptions, 0, 1000),
            ("convergence_threshold", self.convergence_threshold, 1e-3, 10.0),
            ("convergence_hysteresis", self.convergence_hysteresis, 0.0,
             self.convergence_threshold),
            ("load_horizon_s", self.load_horizon_s, 1e-3, 86400.0),
            ("resume_per_tick", self.resume_per_tick, 0, 100000),
            ("expire_grace_s", self.expire_grace_s, 0.0, 86400.0),
            ("shed_load", self.shed_load, self.convergence_threshold, 1e6),
            ("batch_shed_load", self.batch_shed_load, 1e-3, 1e6),
            ("degrade_load", self.degrade_load, 0.0, 1e6),
            ("load_window_s", self.load_window_s, 1.0, 86400.0),
            ("max_retry_after_s", self.max_retry_after_s, 0.0, 86400.0),
            ("admission_status_ttl_s", self.admission_status_ttl_s, 0.0, 86400.0),
            ("top_scores", self.top_scores, 1, 10000),
        )

    def origin_threshold(self, load: float) -> float:
        """The origin threshold at ``load``: linear from idle (0) to loaded (>= 1)."""
        share = min(max(load, 0.0), 1.0)
        idle = self.origin_threshold_idle
        return idle + (self.origin_threshold_loaded - idle) * share

    def new_cost_model(self) -> CostModel:
        """An empty cost model with this policy's priors."""
        return CostModel(priors_s_per_unit=dict(self.cost_priors_s_per_unit),
                         default_s_per_unit=self.default_s_per_unit,
                         ewma_alpha=self.cost_ewma_alpha, prior_samples=self.cost_prior_samples)
