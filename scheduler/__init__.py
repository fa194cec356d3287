"""The scheduling policy, pure: ``plan_tick(snapshot, policy, now_s) -> TickPlan``.

The names below are loaded on first use (PEP 562): importing one small module of the package
(``scheduler.lifecycle`` for the command line's choices) does not import the whole planner.
Type checkers see ordinary imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.admission import Admission, AdmissionDecision, admit
    from scheduler.cost import CostEstimate, CostModel
    from scheduler.incremental import IncrementalPlanner
    from scheduler.lifecycle import JobState, SloClass
    from scheduler.model import (
        ClusterSnapshot,
        JobKind,
        JobView,
        ResourceProfile,
        Tier,
        WorkerView,
    )
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

_HOMES: dict[str, tuple[str, ...]] = {
    "scheduler.admission": ("Admission", "AdmissionDecision", "admit"),
    "scheduler.cost": ("CostEstimate", "CostModel"),
    "scheduler.incremental": ("IncrementalPlanner",),
    "scheduler.lifecycle": ("JobState", "SloClass"),
    "scheduler.model": ("ClusterSnapshot", "JobKind", "JobView", "ResourceProfile", "Tier",
                        "WorkerView"),
    "scheduler.plan": ("AdmissionStatus", "Expiry", "LevelMark", "Release", "Requeue",
                       "Retarget", "TickPlan"),
    "scheduler.policy": ("PolicyConfig", "PolicyKind", "ScoreWeights"),
    "scheduler.state": ("AdmissionState", "PolicyState"),
    "scheduler.submission": ("SubmitAction", "SubmitDecision", "decide_submit"),
    "scheduler.tick": ("check_plan_invariants", "plan_tick"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

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


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is an ordinary global
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
