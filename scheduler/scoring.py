"""The origin score: a weighted sum of nine normalised dimensions, and origin selection.

Every dimension has a fixed scale (never min-max over the population), so one job's score does
not move because an unrelated job arrived; that keeps the origin steady between ticks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass

from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind, JobView, ResourceProfile, Tier
from scheduler.policy import PolicyConfig

_CLASS_VALUE = {SloClass.REALTIME: 1.0, SloClass.INTERACTIVE: 0.5, SloClass.BATCH: 0.0}


@dataclass(frozen=True, slots=True)
class ScoreDimensions:
    """One job's dimensions, each in [0, 1], 1 the most deserving; fields follow ScoreWeights."""

    tier: float
    """1 for a gold tenant."""
    slo_class: float
    """1 realtime, 0.5 interactive, 0 batch."""
    slack: float
    """Share of the deadline budget spent if the job ran to the end now; 1 = late already."""
    impact: float
    """How visible a miss is, by job kind."""
    wait: float
    """Time waiting ÷ aging bound; 0 while running."""
    progress: float
    """Chunks done ÷ chunks: nearly-done work is cheap to finish and costly to interrupt."""
    remaining: float
    """short_job_s ÷ (remaining_s + short_job_s): shorter work scores higher."""
    preemptions: float
    """Preemptions suffered ÷ bound."""
    resource: float
    """1 for memory-bound jobs, whose device state is costliest to checkpoint and move."""


def _clamp01(value: float) -> float:
    return 0.0 if value < 0.0 else (1.0 if value > 1.0 else value)


def score_dimensions(job: JobView, remaining_s: float, policy: PolicyConfig,
                     now_s: float) -> ScoreDimensions:
    """The readable definition of each dimension (:func:`score_jobs` is its fast twin)."""
    budget_s = job.deadline_s - job.submitted_at_s
    spent = (now_s + remaining_s - job.submitted_at_s) / budget_s if budget_s > 0 else 1.0
    wait_s = 0.0 if job.state is JobState.RUNNING else now_s - job.waiting_since_s
    return ScoreDimensions(
        tier=1.0 if job.tier is Tier.GOLD else 0.0,
        slo_class=_CLASS_VALUE[job.slo_class],
        slack=_clamp01(spent),
        impact=policy.kind_impact.get(job.kind, 0.5),
        wait=_clamp01(wait_s / policy.aging_bound_s),
        progress=job.next_chunk / job.num_chunks,
        remaining=policy.short_job_s / (remaining_s + policy.short_job_s),
        preemptions=_clamp01(job.preemptions / max(policy.max_preemptions, 1)),
        resource=1.0 if job.resource_profile is ResourceProfile.MEMORY else 0.0,
    )


def weighted_score(dimensions: ScoreDimensions, policy: PolicyConfig) -> float:
    """Σ wᵢ·dᵢ ÷ Σ wᵢ, in [0, 1]."""
    weights = policy.weights.as_tuple()
    values: tuple[float, ...] = astuple(dimensions)
    return sum(w * d for w, d in zip(weights, values, strict=True)) / sum(weights)


def score_job(job: JobView, remaining_s: float, policy: PolicyConfig, now_s: float) -> float:
    """The job's score in [0, 1]."""
    return score_jobs((job,), (remaining_s,), policy, now_s)[0]


@dataclass(frozen=True, slots=True)
class ScoreTerms:
    """The weights of :func:`score_jobs` divided by their sum, hoisted once per tick; the
    survey's fused pass reads them too, so both compute the same floats."""

    gold: float
    realtime: float
    interactive: float
    memory: float
    slack: float
    wait_max: float
    wait_per_s: float
    progress: float
    short: float
    """``remaining`` weight × short_job_s: the term is ``short / (remaining_s + short_job_s)``."""
    short_s: float
    preemptions_max: float
    per_preemption: float
    max_preemptions: int
    aging_bound_s: float
    impact: Mapping[JobKind, float]

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> ScoreTerms:
        w = policy.weights
        total = sum(w.as_tuple())
        max_pre = max(policy.max_preemptions, 1)
        return cls(
            gold=w.tier / total, realtime=w.slo_class / total,
            interactive=w.slo_class * 0.5 / total, memory=w.resource / total,
            slack=w.slack / total, wait_max=w.wait / total,
            wait_per_s=w.wait / total / policy.aging_bound_s, progress=w.progress / total,
            short=w.remaining / total * policy.short_job_s, short_s=policy.short_job_s,
            preemptions_max=w.preemptions / total, per_preemption=w.preemptions / total / max_pre,
            max_preemptions=max_pre, aging_bound_s=policy.aging_bound_s,
            impact={kind: w.impact / total * policy.kind_impact.get(kind, 0.5)
                    for kind in JobKind},
        )


def score_jobs(jobs: Sequence[JobView], remaining_s: Sequence[float], policy: PolicyConfig,
               now_s: float) -> list[float]:
    """Scores of many jobs at once: :func:`score_dimensions` and :func:`weighted_score` fused,
    with every constant hoisted. The tick itself scores in :func:`scheduler.survey.survey_jobs`,
    the same formula inlined into its walk of the live jobs."""
    t = ScoreTerms.from_policy(policy)
    w_gold, w_rt, w_ia, w_mem = t.gold, t.realtime, t.interactive, t.memory
    w_slack, w_wait_max, w_wait, w_prog = t.slack, t.wait_max, t.wait_per_s, t.progress
    w_short, short_s, w_pre_max, w_pre = t.short, t.short_s, t.preemptions_max, t.per_preemption
    max_pre, bound_s, impact = t.max_preemptions, t.aging_bound_s, t.impact
    gold, rt, ia, mem, running = (Tier.GOLD, SloClass.REALTIME, SloClass.INTERACTIVE,
                                  ResourceProfile.MEMORY, JobState.RUNNING)
    scores: list[float] = []
    append = scores.append
    for job, rem in zip(jobs, remaining_s, strict=True):
        cls = job.slo_class
        score = ((w_gold if job.tier is gold else 0.0)
                 + (w_rt if cls is rt else (w_ia if cls is ia else 0.0))
                 + (w_mem if job.resource_profile is mem else 0.0)
                 + impact[job.kind])
        sub = job.submitted_at_s
        budget = job.deadline_s - sub
        spent = (now_s + rem - sub) / budget if budget > 0.0 else 1.0
        score += w_slack if spent >= 1.0 else (w_slack * spent if spent > 0.0 else 0.0)
        if job.state is not running:
            waited = now_s - job.waiting_since_s
            score += w_wait_max if waited >= bound_s else (
                w_wait * waited if waited > 0.0 else 0.0)
        pre = job.preemptions
        score += (w_prog * job.next_chunk / job.num_chunks + w_short / (rem + short_s)
                  + (w_pre_max if pre >= max_pre else w_pre * pre))
        append(score)
    return scores


def select_origin(candidates: Iterable[tuple[str, float]], incumbent: tuple[str, float] | None,
                  threshold: float, margin: float) -> tuple[str, float] | None:
    """The origin among ``(job_id, score)`` candidates.

    The incumbent (still live, with its current score) stays while it scores at least
    ``threshold - margin`` and no challenger beats it by ``margin`` or more; otherwise the best
    candidate at or above ``threshold`` takes over; otherwise there is no origin.
    """
    best = max(candidates, key=lambda pair: pair[1], default=None)
    if incumbent is not None and _holds(incumbent, best, threshold, margin):
        return incumbent
    if best is not None and best[1] >= threshold:
        return best
    return None


def _holds(incumbent: tuple[str, float], best: tuple[str, float] | None, threshold: float,
           margin: float) -> bool:
    if incumbent[1] < threshold - margin:
        return False
    return best is None or best[0] == incumbent[0] or best[1] < incumbent[1] + margin
