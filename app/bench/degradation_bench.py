"""Degradation before shedding, swept over effective load: the overload bench's workload
(``app.bench.overload_bench``) with a share of the jobs allowing a quality floor, each seeded
trace run twice — admission degrading the jobs that allow it (``scheduler.degradation``), and
not degrading at all — on the same arrivals.

A third arm degrades at each of ``gates`` (a lower ``degrade_load`` than the default 1.0):
how much of the gap the gate leaves.

Per point and arm: the share of all jobs done within their deadline (95 % Wilson interval,
pooled over the seeds) and per class; how many jobs ran degraded, the mean share of their
steps they kept, and how many were degraded without allowing it (must be 0); shed and expired
jobs. The headline is the ratio of deadlines met with degradation to without, per point.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from app.bench.overload_bench import NOTE, calibrate, overload_workload
from app.bench.overload_bench import run_arm as overload_run_arm
from app.bench.report import wilson_interval
from app.bench.sim_records import SimResult
from app.bench.sim_workload import SimArrival
from scheduler.lifecycle import SloClass
from scheduler.policy import OverloadMeasure

TARGETS = (0.8, 1.0, 1.3, 1.6)
ARMS: dict[str, tuple[bool, tuple[float | None, float | None], float | None]] = {
    "none": (False, (None, None), None),
    "degrade": (True, (None, None), None),
    "levels": (True, (0.65, 0.25), None),
    "levels_queued": (True, (0.65, 0.25), 0.8),
}
"""Per arm: floors given, the (cache share, smallest pixel share) they also allow, and the load
past which waiting jobs are degraded too. ``degrade``: steps only, at admission; ``levels``:
also a step cache (0.65 of a step: the measured step-time share of a first-block cache at
threshold 0.1 on the tiny pixart and wan recipes, docs/models.md) and down to a quarter of the
pixels; ``levels_queued``: those, and each tick past the convergence threshold (0.8) also the
waiting jobs whose full quality became late."""
GATES: tuple[float, ...] = ()
"""The extra ``degrade_load`` gates measured beside the default one (arm ``degrade_at_<g>``)."""
ALLOW_SHARE = 0.5
"""Share of jobs that give a quality floor."""
FLOOR = 0.5
"""Their floor: this share of their steps (rounded up)."""
GOAL = (1.3, 1.5)
"""At effective load 1.3, deadlines met with degradation ≥ 1.5 × without (a goal, not a test)."""


def floors(trace_jobs: Sequence[Any], seed: int, share: float = ALLOW_SHARE,
           floor: float = FLOOR) -> dict[int, int]:
    """The quality floor of each job that allows one (drawn apart from the trace's own draws,
    so both arms and every share see the same arrivals)."""
    rng = random.Random(f"floors-{seed}")
    return {job.index: max(1, math.ceil(floor * job.steps)) for job in trace_jobs
            if rng.random() < share}


def run_arm(compute_load: float, seed: int, jobs: int, workers: int, degrade: bool,
            gate: float | None = None, arm: str = "degrade") -> tuple[list[SimArrival], SimResult]:
    """One seeded trace at ``compute_load`` (the overload bench's arm), its floors given
    (``degrade``) or not; degraded past ``gate`` (None: the policy's ``degrade_load``); with
    the levels and queued degradation of ``arm`` (:data:`ARMS`)."""
    _, levels, queued = ARMS[arm]
    trace, result, _ = overload_run_arm(
        overload_workload(compute_load, seed, jobs, workers), OverloadMeasure.EFFECTIVE,
        floors=(lambda generated: floors(generated, seed)) if degrade else None,
        degrade_load=gate, levels=levels, degrade_queued_load=queued)
    return trace, result


def run_figures(trace: Sequence[SimArrival], result: SimResult, allowed: set[int]
                ) -> dict[str, Any]:
    """One run's counts: jobs and deadlines met per class and in all, degraded jobs (and
    those degraded without a floor), the share of steps the degraded kept, shed or expired."""
    def met(a: SimArrival) -> bool:
        finished = result.finished_s[a.index]
        return finished is not None and finished <= a.deadline_s + 1e-9

    classes = {cls.value: {"jobs": sum(1 for a in trace if a.shape.slo is cls),
                           "met": sum(1 for a in trace if a.shape.slo is cls and met(a))}
               for cls in SloClass}
    kept = [result.level_share.get(a.index, 1.0) for a in trace if a.index in result.degraded]
    return {"jobs": len(trace), "met": sum(1 for a in trace if met(a)), "classes": classes,
            "degraded": len(result.degraded),
            "degraded_without_floor": sum(1 for k in result.degraded if k not in allowed),
            "steps_kept_sum": sum(kept),
            "shed_or_expired": sum(1 for s in result.status if s in ("shed", "expired"))}


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one arm as one: counts summed, within-deadline shares with 95 % Wilson
    intervals, the mean share of steps degraded jobs kept."""
    total = {k: sum(r[k] for r in runs) for k in
             ("jobs", "met", "degraded", "degraded_without_floor", "shed_or_expired")}
    classes = {}
    for name in runs[0]["classes"]:
        jobs = sum(r["classes"][name]["jobs"] for r in runs)
        hits = sum(r["classes"][name]["met"] for r in runs)
        ci = wilson_interval(hits, jobs)
        classes[name] = {"jobs": jobs, "met": hits, "within_slo": hits / jobs if jobs else None,
                         "ci95": list(ci) if ci else None}
    ci = wilson_interval(total["met"], total["jobs"])
    kept = sum(r["steps_kept_sum"] for r in runs)
    return {**total, "within_slo": total["met"] / total["jobs"] if total["jobs"] else None,
            "ci95": list(ci) if ci else None, "classes": classes,
            "mean_work_kept": kept / total["degraded"] if total["degraded"] else None}


def run_degradation_bench(targets: Sequence[float] = TARGETS, seeds: int = 3, jobs: int = 600,
                          workers: int = 8, gates: Sequence[float] = GATES,
                          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep (module docstring): per target effective load, every arm on the same
    ``seeds`` traces; the ratio of deadlines met, degrade ÷ none (and per extra gate)."""
    started = time.perf_counter()
    points: list[dict[str, Any]] = []
    for target in targets:
        compute = calibrate(target, 1000, jobs, workers)
        arms = {arm: arm_figures(compute, seeds, jobs, workers, ARMS[arm][0], None, arm)
                for arm in ARMS}
        for gate in gates:
            arms[f"degrade_at_{gate:g}"] = arm_figures(compute, seeds, jobs, workers, True, gate)
        none = arms["none"]["met"]
        point = {"target_effective_load": target, "compute_load": compute, "arms": arms,
                 "met_ratio": arms["degrade"]["met"] / none if none else None,
                 "met_ratio_by_arm": {arm: ratio_ci(arms[arm], arms["none"])
                                      for arm in ARMS if arm != "none"},
                 "met_ratio_by_gate": {f"{gate:g}": arms[f"degrade_at_{gate:g}"]["met"] / none
                                       if none else None for gate in gates}}
        points.append(point)
        if progress is not None:
            progress(line(point))
    goal_point = next((p for p in points if p["target_effective_load"] == GOAL[0]), None)
    best = None if goal_point is None else goal_point["met_ratio_by_arm"]["levels_queued"]
    return {"simulated": True, "note": NOTE, "workers": workers, "jobs_per_trace": jobs,
            "seeds": seeds, "gates": list(gates), "allow_share": ALLOW_SHARE, "floor": FLOOR,
            "points": points,
            "goal": {"effective_load": GOAL[0], "met_ratio_at_least": GOAL[1],
                     "met_ratio": None if goal_point is None else goal_point["met_ratio"],
                     "met_ratio_levels_queued": best},
            "wall_s": time.perf_counter() - started}


def ratio_ci(arm: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """Deadlines met, ``arm`` ÷ ``base``, with a 95 % interval (Katz's log method for a ratio
    of two proportions; the arms share their arrivals, so it is conservative)."""
    a, n, b, m = arm["met"], arm["jobs"], base["met"], base["jobs"]
    if not (a and b and n and m):
        return None
    ratio = (a / n) / (b / m)
    half = 1.96 * math.sqrt(1 / a - 1 / n + 1 / b - 1 / m)
    return {"ratio": ratio, "ci95": [ratio * math.exp(-half), ratio * math.exp(half)]}


def arm_figures(compute: float, seeds: int, jobs: int, workers: int, degrade: bool,
                gate: float | None, arm: str = "degrade") -> dict[str, Any]:
    """One arm over the ``seeds`` traces, pooled."""
    runs = []
    for seed in range(1, seeds + 1):
        trace, result = run_arm(compute, seed, jobs, workers, degrade, gate, arm)
        allowed = {a.index for a in trace if a.min_steps is not None}
        runs.append(run_figures(trace, result, allowed))
    return pooled(runs)


def line(point: dict[str, Any]) -> str:
    """One printed row: the arms' within-deadline shares and the degraded counts."""
    arms, ratio = point["arms"], point["met_ratio"]
    if ratio is None:
        return f"E={point['target_effective_load']:.1f}: no deadline met without degradation"
    gated = "".join(
        f"; degrading past {gate}: {100 * arms[f'degrade_at_{gate}']['within_slo']:.1f}%"
        f" (x{r:.2f})" for gate, r in point["met_ratio_by_gate"].items() if r is not None)
    arm_ratios = "".join(f"; {arm} x{r['ratio']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
                         f" ({arms[arm]['degraded']} degraded)"
                         for arm, r in point["met_ratio_by_arm"].items() if r is not None)
    return (f"E={point['target_effective_load']:.1f}: met {100 * arms['none']['within_slo']:.1f}%"
            f" without, {100 * arms['degrade']['within_slo']:.1f}% with degradation "
            f"(x{ratio:.2f}); degraded {arms['degrade']['degraded']} "
            f"(without a floor: {arms['degrade']['degraded_without_floor']}), "
            f"shed/expired {arms['none']['shed_or_expired']} -> "
            f"{arms['degrade']['shed_or_expired']}{gated}{arm_ratios}")
