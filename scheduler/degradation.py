"""Degradation before shedding: under overload, run a job that allows it at a lower level.

A job may give a quality floor (``min_steps``; for image and video jobs also a step cache it
accepts and a smallest size). Its levels are (steps, cache, size), each priced from the cost
model (:class:`QualityLadder`). When the governing load is past ``degrade_load`` and the job is
predicted to miss its deadline at full quality, admission picks the level of most work, not
below the floor, with which it is predicted to make it (the cheapest level when none makes it:
it also takes the least from the fleet). A job
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

from dataclasses import dataclass

from scheduler.policy import PolicyConfig

Size = tuple[int, int]
"""An image's (height, width) in pixels."""


@dataclass(frozen=True, slots=True)
class Level:
    """One way to run a job: ``steps`` denoising steps, with the step cache ``cache`` (None:
    every block of every step runs), at ``size`` (None: the size it asked for)."""

    steps: int
    cache: str | None = None
    size: Size | None = None


@dataclass(frozen=True, slots=True)
class QualityLadder:
    """A job's levels: any step count from ``min_steps`` to ``full_steps``, uncached or (when
    the job allows ``cache``) cached, at its own size or one of the smaller ``sizes`` it
    allows. A level costs ``fixed_s + steps × step_s × c × p`` seconds of work (fixed: encode
    and decode; ``c`` is ``cache_fraction`` for a cached level, else 1; ``p`` the level's pixels
    over the job's own)."""

    full_steps: int
    min_steps: int
    step_s: float
    """Seconds of one step (all its model evaluations)."""
    fixed_s: float = 0.0
    """Seconds of the chunks every level runs once (encode, decode)."""
    cache: str | None = None
    """The step cache the job allows (None: it runs uncached); the job asked for none."""
    cache_fraction: float = 1.0
    """A cached step's share of an uncached one's time (the cost model's measure)."""
    full_size: Size | None = None
    """The size the job asked for (None: a job without a size)."""
    sizes: tuple[Size, ...] = ()
    """The smaller sizes it allows, each on the model's size grid."""

    def work_s(self, steps: int) -> float:
        return self.fixed_s + steps * self.step_s

    def level_work_s(self, level: Level) -> float:
        """Seconds of work of ``level`` (the class docstring's formula)."""
        fraction = self.cache_fraction if level.cache is not None else 1.0
        pixels = 1.0
        if level.size is not None and self.full_size is not None:
            pixels = (level.size[0] * level.size[1]) / (self.full_size[0] * self.full_size[1])
        return self.fixed_s + level.steps * self.step_s * fraction * pixels

    def levels(self) -> list[Level]:
        """Every level below full quality the job allows, most work first (then most steps:
        of two levels of equal work, the one that keeps more steps)."""
        caches: tuple[str | None, ...] = (None,) if self.cache is None else (None, self.cache)
        sizes: tuple[Size | None, ...] = (None, *self.sizes)
        full = Level(self.full_steps)
        out = [Level(steps, cache, size) for steps in range(self.min_steps, self.full_steps + 1)
               for cache in caches for size in sizes]
        out = [level for level in out if level != full]
        out.sort(key=lambda level: (-self.level_work_s(level), -level.steps))
        return out


@dataclass(frozen=True, slots=True)
class Degradation:
    """Admission's choice for a job that allows it: run ``steps`` of ``full_steps``, with the
    step cache ``cache`` (None: uncached) at ``size`` (None: its own size)."""

    steps: int
    full_steps: int
    reason: str
    meets: bool = True
    """Predicted to make its deadline at this level (False: the floor, predicted late even so).
    A job that meets it is admitted where it would have been shed at full quality."""
    cache: str | None = None
    size: Size | None = None
    work_share: float = 1.0
    """The level's predicted work over full quality's."""

    @property
    def level(self) -> Level:
        return Level(self.steps, self.cache, self.size)

    def as_json(self) -> dict[str, object]:
        body: dict[str, object] = {"steps": self.steps, "full_steps": self.full_steps,
                                   "reason": self.reason, "meets": self.meets}
        if self.cache is not None:
            body["step_cache"] = self.cache
        if self.size is not None:
            body["height"], body["width"] = self.size
        if self.work_share != 1.0:
            body["work_share"] = round(self.work_share, 4)
        return body


MAX_UTILISATION = 0.95
"""The load the prediction caps utilisation at (a stretch of at most 20)."""


def stretch(load: float) -> float:
    """Predicted finish ÷ work at ``load``: ``1 / (1 − ρ)``, ρ = min(load, MAX_UTILISATION)."""
    return 1.0 / (1.0 - min(max(load, 0.0), MAX_UTILISATION))


def describe(level: Level, full_steps: int) -> str:
    """``12 of 20 steps, first_block cache, 48x48``: a level in words."""
    parts = [f"{level.steps} of {full_steps} steps"]
    if level.cache is not None:
        parts.append(f"{level.cache} cache")
    if level.size is not None:
        parts.append(f"{level.size[0]}x{level.size[1]}")
    return ", ".join(parts)


def choose_level(ladder: QualityLadder, deadline_in_s: float, load: float,
                 policy: PolicyConfig) -> Degradation | None:
    """The degraded level of a job due in ``deadline_in_s`` seconds at governing ``load``, or
    None to run it at full quality (the load is not past ``policy.degrade_load``, the job
    allows nothing lower, or it is predicted to make its deadline as it is). The level is the
    one of most work predicted to make it (the least degradation that saves the job); the
    cheapest level the job allows when none does (it also takes the least from the fleet)."""
    if load <= policy.degrade_load:
        return None
    levels = ladder.levels()
    if not levels:
        return None
    factor = stretch(load)
    work_s = ladder.work_s(ladder.full_steps)
    full_s = factor * work_s
    if full_s <= deadline_in_s:
        return None
    on_time = [lv for lv in levels if factor * ladder.level_work_s(lv) <= deadline_in_s]
    meets = bool(on_time)
    chosen = on_time[0] if meets else levels[-1]
    verdict = "predicted to make it" if meets else "its floor, predicted late even so"
    share = ladder.level_work_s(chosen) / work_s if work_s > 0 else 1.0
    reason = (f"degraded to {describe(chosen, ladder.full_steps)} at load {load:.2f}: "
              f"predicted {full_s:.3g}s at full quality ({factor:.3g} x {work_s:.3g}s of work) "
              f"against a deadline in {deadline_in_s:.3g}s; {share:.0%} of the work is "
              f"{verdict}")
    return Degradation(chosen.steps, ladder.full_steps, reason, meets, chosen.cache,
                       chosen.size, share)


def choose_steps(ladder: QualityLadder, deadline_in_s: float, load: float,
                 policy: PolicyConfig) -> Degradation | None:
    """:func:`choose_level` (the name of the steps-only ladder, kept for its callers)."""
    return choose_level(ladder, deadline_in_s, load, policy)
