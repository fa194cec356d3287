"""Load, overload convergence with hysteresis, admission of new jobs and shedding late work.

Load is outstanding work divided by what the alive workers can do within ``load_horizon_s``
(capacity C = max(workers, 1) × horizon): 1.0 means the fleet needs the whole horizon to clear
what it holds. Two figures are measured (:class:`LoadFigures`):

- **compute load** = (D − K) / C: the compute work only, where D is the demand within the
  horizon (remaining seconds of every live, non-suspended job, work due later pro rata, less
  what batching saves) and K the part of D that is the waiting jobs' expected cold loads
  (``JobView.load_s``, pro rata alike);
- **effective load** = (D + max(P − K, 0)) / C = compute + max(K, P) / C: compute plus the
  expected loads, where P = p × C is what the fleet pays loading models over a horizon at the
  rate it paid over the last ``load_window_s`` (p: the share of the alive workers' time spent
  in loads then, :func:`paid_load_share`). K counts the loads the queue is known to need; P
  also counts those no waiting job shows (a resumed job whose model was evicted, thrash
  between models). Both estimate the loads of the next horizon, so the larger counts, not the
  sum (the known cold loads of the queue are among those the paid rate extrapolates).

Convergence, admission and shedding use the figure ``policy.overload_measure`` names (the
effective load by default); the published status carries both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from scheduler.lifecycle import SloClass
from scheduler.model import JobView, Tier, WorkerView
from scheduler.plan import AdmissionStatus
from scheduler.policy import OverloadMeasure, PolicyConfig, PolicyKind
from scheduler.state import AdmissionState


class Admission(str, Enum):
    """What the submit path does with a new job."""

    ADMIT = "admit"
    """Store it PENDING; the tick releases it."""
    SUSPEND = "suspend"
    """Store it SUSPENDED; it is released once convergence ends."""
    SHED_OVERLOAD = "shed_overload"
    """Refuse it (HTTP 429 with Retry-After)."""


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """``admit``'s answer; ``retry_after_s`` is set when shed, ``reason`` always."""

    verdict: Admission
    retry_after_s: float
    reason: str


def measure_load(outstanding_s: float, alive_workers: int, policy: PolicyConfig) -> float:
    """Outstanding work ÷ (workers × horizon); with no worker alive, as if there were one."""
    return outstanding_s / (max(alive_workers, 1) * policy.load_horizon_s)


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """One tick's load, split (the module docstring has the formulas)."""

    compute: float
    """Outstanding compute work ÷ capacity, no loads."""
    effective: float
    """Compute plus the expected loads (never below ``compute``)."""
    cold: float
    """The waiting jobs' expected cold loads ÷ capacity (K / C)."""
    paid: float
    """The share of the alive workers' time spent loading over the last window (p)."""

    def governing(self, policy: PolicyConfig) -> float:
        """The figure convergence, admission and shedding use."""
        return self.compute if policy.overload_measure is OverloadMeasure.COMPUTE \
            else self.effective


def measure_loads(demand_s: float, cold_s: float, paid_share: float, alive_workers: int,
                  policy: PolicyConfig) -> LoadFigures:
    """The load figures from the demand D (``demand_s``, cold loads included), its cold loads
    K (``cold_s``) and the paid share p; with no worker alive, as if there were one. With no
    load paid (p = 0) the effective load is D / C, the same float as :func:`measure_load`."""
    capacity_s = max(alive_workers, 1) * policy.load_horizon_s
    extra_s = max(paid_share * capacity_s - cold_s, 0.0)
    return LoadFigures(compute=max(demand_s - cold_s, 0.0) / capacity_s,
                       effective=(demand_s + extra_s) / capacity_s,
                       cold=cold_s / capacity_s, paid=paid_share)


def paid_load_share(workers: Iterable[WorkerView], window_s: float, now_s: float) -> float:
    """The share of the alive workers' time in ``[now_s − window_s, now_s]`` spent in the loads
    their views report (``WorkerView.loads``: each load spans ``[end − seconds, end]``; only
    its part inside the window counts, so a load under way counts up to now), each worker's
    share at most 1; 0.0 with no worker alive."""
    start_s = now_s - window_s
    alive = 0
    paid_s = 0.0
    for worker in workers:
        if not worker.alive:
            continue
        alive += 1
        spent_s = 0.0
        for end_s, seconds in worker.loads:
            spent_s += max(min(end_s, now_s) - max(end_s - seconds, start_s), 0.0)
        paid_s += min(spent_s, window_s)
    return paid_s / (alive * window_s) if alive else 0.0


def next_admission_state(previous: AdmissionState, load: float,
                         policy: PolicyConfig) -> AdmissionState:
    """Converge above the threshold; open again only below threshold − hysteresis."""
    if load > policy.convergence_threshold:
        return AdmissionState.CONVERGING
    if previous is AdmissionState.CONVERGING and (
            load >= policy.convergence_threshold - policy.convergence_hysteresis):
        return AdmissionState.CONVERGING
    return AdmissionState.OPEN


def retry_after_s(load: float, policy: PolicyConfig) -> float:
    """Time for the fleet to work the load down to where convergence ends."""
    excess = load - (policy.convergence_threshold - policy.convergence_hysteresis)
    return min(max(excess * policy.load_horizon_s, 1.0), policy.max_retry_after_s)


def admission_status(state: AdmissionState, load: float, policy: PolicyConfig,
                     now_s: float, figures: LoadFigures | None = None) -> AdmissionStatus:
    """The status a plan publishes for the submit path: ``load`` the governing figure, and
    the effective and compute loads of ``figures`` when measured."""
    wait_s = retry_after_s(load, policy) if state is AdmissionState.CONVERGING else 0.0
    if figures is None:
        return AdmissionStatus(state=state, load=load, retry_after_s=wait_s,
                               measured_at_s=now_s)
    return AdmissionStatus(state=state, load=load, retry_after_s=wait_s, measured_at_s=now_s,
                           compute_load=figures.compute, effective_load=figures.effective)


def describe_load(status: AdmissionStatus) -> str:
    """The load figures of ``status`` in words: ``effective load 1.12 (compute 0.85)``, or
    ``load 1.12`` from a status that does not split them."""
    if status.effective_load is None or status.compute_load is None:
        return f"load {status.load:.2f}"
    return f"effective load {status.effective_load:.2f} (compute {status.compute_load:.2f})"


def parked_reason(status: AdmissionStatus, policy: PolicyConfig) -> str:
    """What a job suspended by overload convergence has on its event stream."""
    return (f"overload convergence: held back at {describe_load(status)}, above the "
            f"threshold {policy.convergence_threshold:.2f}; resumes once it falls below "
            f"{policy.convergence_threshold - policy.convergence_hysteresis:.2f}")


def admit(job: JobView, status: AdmissionStatus, policy: PolicyConfig,
          now_s: float) -> AdmissionDecision:
    """Admission of a new job given the last tick's status. A status older than
    ``admission_status_ttl_s`` is ignored (the scheduler is down: store the job and let the
    next tick decide). Classes are protected in order: standard batch work is refused past
    ``batch_shed_load``, standard interactive work from ``shed_load``; gold work is never shed,
    nor realtime work: it takes its slots by preemption, so the backlog that overload measures
    — demoted late work included — does not stand in its way. Batch work not refused waits
    suspended while converging."""
    if policy.policy is not PolicyKind.STEPLINE:
        return AdmissionDecision(Admission.ADMIT, 0.0, "baseline policy admits everything")
    if now_s - status.measured_at_s > policy.admission_status_ttl_s:
        return AdmissionDecision(Admission.ADMIT, 0.0, "admission status stale; admitted")
    shed = _shed_above(job, policy)
    if shed is not None and (status.load >= shed if job.slo_class is not SloClass.BATCH
                             else status.load > shed):
        wait_s = retry_after_s(status.load, policy)
        return AdmissionDecision(Admission.SHED_OVERLOAD, wait_s, (
            f"overloaded ({describe_load(status)}, {job.slo_class.value} work refused past "
            f"{shed:.2f}); retry in {wait_s:.0f}s"))
    if status.state is AdmissionState.CONVERGING and job.slo_class is SloClass.BATCH:
        return AdmissionDecision(Admission.SUSPEND, 0.0,
                                 f"overload convergence ({describe_load(status)}): batch held")
    return AdmissionDecision(Admission.ADMIT, 0.0, "admitted")


def _shed_above(job: JobView, policy: PolicyConfig) -> float | None:
    """The load from which admission refuses ``job`` (None: never): batch work's limit is
    ``batch_shed_load`` kept within [convergence threshold, ``shed_load``], so batch work is
    parked before it is refused, and refused no later than interactive work."""
    if job.tier is Tier.GOLD or job.slo_class is SloClass.REALTIME:
        return None
    if job.slo_class is not SloClass.BATCH:
        return policy.shed_load
    return min(max(policy.batch_shed_load, policy.convergence_threshold), policy.shed_load)


def expiry_reason(job: JobView, remaining_s: float, load: float, policy: PolicyConfig,
                  now_s: float) -> str | None:
    """Why the job must be shed, or None while it can still meet its deadline (+ grace)."""
    finish_s = now_s + remaining_s
    if finish_s <= job.deadline_s + policy.expire_grace_s:
        return None
    left_s = job.deadline_s - now_s
    return (f"cannot meet its deadline under overload (load {load:.2f}): needs "
            f"~{remaining_s:.1f}s more, deadline in {left_s:.1f}s "
            f"(+{policy.expire_grace_s:.1f}s grace)")
