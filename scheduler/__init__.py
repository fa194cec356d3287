"""The scheduling policy, pure: ``plan_tick(snapshot, policy, now_s) -> TickPlan``."""

from scheduler.admission import Admission, AdmissionDecision, admit
from scheduler.cost import CostEstimate, CostModel
from scheduler.incremental import IncrementalPlanner
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import ClusterSnapshot, JobKind, JobView, ResourceProfile, Tier, WorkerView
from scheduler.plan import (
    AdmissionStatus,
    Expiry,
    LevelMark,
    Release,
    Requeue,
    Retarget,
    TickPlan,
)
from scheduler.policy import PolicyConfig, PolicyKind, ScoreWeights
from scheduler.state import AdmissionState, PolicyState
from scheduler.submission import SubmitAction, SubmitDecision, decide_submit
from scheduler.tick import check_plan_invariants, plan_tick

__all__ = [
    "Admission",
    "AdmissionDecision",
    "AdmissionState",
    "AdmissionStatus",
    "ClusterSnapshot",
    "CostEstimate",
    "CostModel",
    "Expiry",
    "IncrementalPlanner",
    "JobKind",
    "JobState",
    "JobView",
    "LevelMark",
    "PolicyConfig",
    "PolicyKind",
    "PolicyState",
    "Release",
    "Requeue",
    "ResourceProfile",
    "Retarget",
    "ScoreWeights",
    "SloClass",
    "SubmitAction",
    "SubmitDecision",
    "TickPlan",
    "Tier",
    "WorkerView",
    "admit",
    "check_plan_invariants",
    "decide_submit",
    "plan_tick",
]
