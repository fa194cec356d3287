"""The judgement of a tick: the load, and which jobs are shed, demoted, blocked or deferred before
anything is ordered (each a value of its own; the survey's scores are copied, never rewritten)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.admission import LoadFigures, expiry_reason, measure_loads, next_admission_state
from scheduler.batching import GrowthTable, batch_slowdown
from scheduler.lifecycle import JobState
from scheduler.policy import PolicyConfig
from scheduler.state import AdmissionState
from scheduler.survey import Survey


@dataclass(frozen=True, slots=True)
class Judgement:
    """What the tick holds against each job before ordering it (indices into the survey)."""

    load: float
    """The figure overload goes by (``figures.governing(policy)``)."""
    admission: AdmissionState
    expired: Mapping[int, str]
    """Shed under overload, with the reason (jobs that asked to be, past saving)."""
    demoted: frozenset[int]
    """Cannot meet the deadline even if run alone now: lowest level, behind everything that
    still can, no claim to the origin. (Its iteration order is the order the plan's level
    marks list them in.)"""
    blocked: frozenset[int]
    """Waiting jobs whose dependencies are still live: they cannot run yet."""
    deferred: frozenset[int]
    """Could meet the deadline alone, but the fleet cannot fit it with the on-time work."""
    scores: tuple[float, ...]
    """The survey's origin scores, with shed work at -1 and demoted or deferred work at most 0
    (no claim to the origin)."""
    figures: LoadFigures
    """The compute and effective loads."""

    @property
    def converging(self) -> bool:
        return self.admission is AdmissionState.CONVERGING


def judge(survey: Survey, previous: AdmissionState, workers: int, growths: GrowthTable,
          policy: PolicyConfig, now_s: float) -> Judgement:
    """The load figures on ``workers`` alive workers and the admission state the governing one
    leads to; then late work shed or demoted, blocked work, and the work the fleet cannot fit
    deferred."""
    figures = measure_loads(
        survey.outstanding_s - batching_gain_s(survey, growths, policy, now_s), survey.cold_s,
        survey.paid_share, workers, policy)
    load = figures.governing(policy)
    admission = next_admission_state(previous, load, policy)
    converging = admission is AdmissionState.CONVERGING
    expired, demoted = _judge_late(survey, load, converging, policy, now_s)
    blocked = _blocked(survey)
    deferred = _defer_overcommitted(
        survey, {*survey.suspended, *demoted, *blocked, *expired}, workers, now_s)
    scores = list(survey.scores)
    for i in expired:
        scores[i] = -1.0
    for i in demoted:
        scores[i] = 0.0
    for i in deferred:
        scores[i] = min(scores[i], 0.0)  # no claim to the origin
    return Judgement(load, admission, expired, demoted, blocked, deferred, tuple(scores),
                     figures)


def batching_gain_s(survey: Survey, growths: GrowthTable, policy: PolicyConfig,
                    now_s: float) -> float:
    """Worker time batching saves on the outstanding work: a group of n jobs runs in batches of
    b = min(n, max_batch), each job's step costing (1 + growth·(b − 1)) / b of a lone step
    (demand counted as the survey counts it: work due past the horizon pro rata)."""
    batching, live = policy.batching, survey.live
    if not batching.enabled or not any(job.batch_group for job in live):
        return 0.0
    groups: dict[str, list[int]] = {}
    for i, job in enumerate(live):
        if job.batch_group is not None and job.state is not JobState.SUSPENDED:
            groups.setdefault(job.batch_group, []).append(i)
    horizon_s, gain_s = policy.load_horizon_s, 0.0
    for members in groups.values():
        growth = growths.of(live[members[0]])
        size = min(len(members), batching.max_batch)
        if size < 2 or not batching.pays(growth):
            continue
        saved = 1.0 - batch_slowdown(growth, size) / size
        for i in members:
            rem, due_in_s = survey.remaining_s[i], live[i].deadline_s - now_s
            gain_s += saved * (rem if due_in_s <= horizon_s else rem * horizon_s / due_in_s)
    return gain_s


def _judge_late(survey: Survey, load: float, converging: bool, policy: PolicyConfig,
                now_s: float) -> tuple[dict[int, str], frozenset[int]]:
    """A job that can no longer meet its deadline even if run alone now stops taking capacity
    from jobs that still can: demoted to the lowest level with no claim to the origin — or,
    under overload, shed with the reason if it asked to be. Only estimates backed by enough
    measurements judge a job (``Survey.late``)."""
    live = survey.live
    expired: dict[int, str] = {}
    demoted: list[int] = []
    for i in survey.late:
        job = live[i]
        reason = expiry_reason(job, survey.remaining_s[i], load, policy, now_s)
        if reason is None:
            continue
        if job.shed_if_late and converging:
            expired[i] = reason
        else:
            demoted.append(i)
    return expired, frozenset(demoted)


def _blocked(survey: Survey) -> frozenset[int]:
    if not survey.with_deps:
        return frozenset()
    live = survey.live
    ids = {job.job_id for job in live}
    return frozenset(i for i in survey.with_deps
                     if live[i].state is not JobState.RUNNING
                     and live[i].state is not JobState.QUEUED
                     and any(dep in ids for dep in live[i].depends_on))


def _defer_overcommitted(survey: Survey, skip: set[int], workers: int,
                         now_s: float) -> frozenset[int]:
    """Moore-Hodgson on the fleet: walk the runnable jobs by deadline, adding up their work at
    the fleet's rate; whenever a job would finish past its deadline, defer the job of least
    value per second of work seen so far until the rest fit. What stays is the largest set of
    jobs (by value) the fleet can finish on time together."""
    live, remaining, values = survey.live, survey.remaining_s, survey.values
    deadlines = [job.deadline_s for job in live]
    order = [i for i in range(len(live)) if i not in skip]
    order.sort(key=deadlines.__getitem__)
    rate = max(workers, 1)
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    deferred: list[int] = []
    work_s = 0.0
    for i in order:
        work_s += remaining[i]
        push(heap, (-remaining[i] / values[i], i))
        room_s = (deadlines[i] - now_s) * rate
        while work_s > room_s and heap:
            _, j = pop(heap)
            work_s -= remaining[j]
            deferred.append(j)
    return frozenset(deferred)
