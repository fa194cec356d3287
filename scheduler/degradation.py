"""Degradation before shedding: under overload, run a job that allows it at fewer steps.

A job may give a quality floor (``min_steps``). When the governing load is past
``degrade_load`` and the job is predicted to miss its deadline at full quality, admission picks
the most steps, not below the floor, with which it is predicted to make it (the floor when no
level makes it: the cheapest the job allows, which also takes the least from the fleet). A job
without a floor is never degraded. A job degraded to a level predicted to make its deadline is
admitted where admission would have shed it at full quality (``scheduler.submission``):
shedding with a reason stays the last resort, for the jobs no allowed level saves.

The prediction is deliberately simple, and the same in the live submit path and the simulator:
the fleet shares its capacity between the jobs it holds, so at utilisation ρ a job of ``w``
seconds of work finishes in about ``w / (1 − ρ)`` (the mean response time of a
processor-sharing queue), with ρ the governing load capped at ``MAX_UTILISATION`` (past 1 the
queue has no steady state; the cap keeps the prediction finite). A plain backlog model (wait
``max(L − 1, 0) × horizon``, then run) was measured first and degraded almost nothing: the load
a new job sees is below 1 most of the time even at an offered load of 1.3, yet a third of the
jobs miss (docs/overload.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.policy import PolicyConfig


@dataclass(frozen=True, slots=True)
class QualityLadder:
    """A job's levels: any step count from ``min_steps`` to ``full_steps``, each costing
    ``fixed_s + steps × step_s`` seconds of work (fixed: encode and decode)."""

    full_steps: int
    min_steps: int
    step_s: float
    """Seconds of one step (all its model evaluations)."""
    fixed_s: float = 0.0
    """Seconds of the chunks every level runs once (encode, decode)."""

    def work_s(self, steps: int) -> float:
        return self.fixed_s + steps * self.step_s


@dataclass(frozen=True, slots=True)
class Degradation:
    """Admission's choice for a job that allows it: run ``steps`` of ``full_steps``."""

    steps: int
    full_steps: int
    reason: str
    meets: bool = True
    """Predicted to make its deadline at ``steps`` (False: the floor, predicted late even so).
    A job that meets it is admitted where it would have been shed at full quality."""

    def as_json(self) -> dict[str, object]:
        return {"steps": self.steps, "full_steps": self.full_steps, "reason": self.reason,
                "meets": self.meets}


MAX_UTILISATION = 0.95
"""The load the prediction caps utilisation at (a stretch of at most 20)."""


def stretch(load: float) -> float:
    """Predicted finish ÷ work at ``load``: ``1 / (1 − ρ)``, ρ = min(load, MAX_UTILISATION)."""
    return 1.0 / (1.0 - min(max(load, 0.0), MAX_UTILISATION))


def choose_steps(ladder: QualityLadder, deadline_in_s: float, load: float,
                 policy: PolicyConfig) -> Degradation | None:
    """The degraded level of a job due in ``deadline_in_s`` seconds at governing ``load``, or
    None to run it at full quality (the load is not past ``policy.degrade_load``, the job
    allows nothing lower, or it is predicted to make its deadline as it is)."""
    if ladder.min_steps >= ladder.full_steps or load <= policy.degrade_load:
        return None
    factor = stretch(load)
    full_s = factor * ladder.work_s(ladder.full_steps)
    if full_s <= deadline_in_s:
        return None
    room_s = deadline_in_s / factor - ladder.fixed_s
    fits = math.floor(room_s / ladder.step_s) if ladder.step_s > 0 else ladder.full_steps
    steps = min(max(fits, ladder.min_steps), ladder.full_steps - 1)
    meets = fits >= ladder.min_steps
    verdict = "predicted to make it" if meets else "its floor, predicted late even so"
    work_s = ladder.work_s(ladder.full_steps)
    reason = (f"degraded to {steps} of {ladder.full_steps} steps at load {load:.2f}: predicted "
              f"{full_s:.3g}s at full quality ({factor:.3g} x {work_s:.3g}s of work) against a "
              f"deadline in {deadline_in_s:.3g}s; {steps} steps is {verdict}")
    return Degradation(steps, ladder.full_steps, reason, meets)
