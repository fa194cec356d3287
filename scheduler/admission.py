"""Load, overload convergence with hysteresis, admission of new jobs and shedding late work.

Load is the estimated outstanding work (remaining seconds of every live, non-suspended job)
divided by what the alive workers can do within ``load_horizon_s``: 1.0 means the fleet needs
the whole horizon to clear what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.lifecycle import SloClass
from scheduler.model import JobView, Tier
from scheduler.plan import AdmissionStatus
from scheduler.policy import PolicyConfig, PolicyKind
from scheduler.state import AdmissionState


class Admission(str, Enum):
    """What the submit path does with a new job."""

    ADMIT = "admit"
    """Store it PENDING; the tick releases it."""
    SUSPEND = "suspend"
    """Store it SUSPENDED; it is released once convergence ends."""
    SHED_OVERLOAD = "shed_overload"
    """Refuse it (HTTP 503 with Retry-After)."""


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """``admit``'s answer; ``retry_after_s`` is set when shed, ``reason`` always."""

    verdict: Admission
    retry_after_s: float
    reason: str


def measure_load(outstanding_s: float, alive_workers: int, policy: PolicyConfig) -> float:
    """Outstanding work ÷ (workers × horizon); with no worker alive, as if there were one."""
    return outstanding_s / (max(alive_workers, 1) * policy.load_horizon_s)


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
                     now_s: float) -> AdmissionStatus:
    """The status a plan publishes for the submit path."""
    wait_s = retry_after_s(load, policy) if state is AdmissionState.CONVERGING else 0.0
    return AdmissionStatus(state=state, load=load, retry_after_s=wait_s, measured_at_s=now_s)


def admit(job: JobView, status: AdmissionStatus, policy: PolicyConfig,
          now_s: float) -> AdmissionDecision:
    """Admission of a new job given the last tick's status. A status older than
    ``admission_status_ttl_s`` is ignored (the scheduler is down: store the job and let the
    next tick decide). Gold work is never shed, nor realtime work: it takes its slots by
    preemption, so the backlog that overload measures — demoted late work included — does not
    stand in its way. Batch work waits suspended while converging."""
    if policy.policy is not PolicyKind.STEPLINE:
        return AdmissionDecision(Admission.ADMIT, 0.0, "baseline policy admits everything")
    if now_s - status.measured_at_s > policy.admission_status_ttl_s:
        return AdmissionDecision(Admission.ADMIT, 0.0, "admission status stale; admitted")
    if (status.load >= policy.shed_load and job.tier is not Tier.GOLD
            and job.slo_class is not SloClass.REALTIME):
        wait_s = retry_after_s(status.load, policy)
        return AdmissionDecision(Admission.SHED_OVERLOAD, wait_s,
                                 f"overloaded (load {status.load:.2f}); retry in {wait_s:.0f}s")
    if status.state is AdmissionState.CONVERGING and job.slo_class is SloClass.BATCH:
        return AdmissionDecision(Admission.SUSPEND, 0.0,
                                 f"overload convergence (load {status.load:.2f}): batch held")
    return AdmissionDecision(Admission.ADMIT, 0.0, "admitted")


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
