"""Overload with model loads counted: the many-model workload (``app.bench.models_workload``,
with a realtime share added) at a sweep of *effective* offered loads — compute work plus the
model loads the run paid, over the pool's capacity — each run twice on the same seeded traces:
admission and convergence going by the effective load, and by the compute load alone.

Per point and arm: the share of each class's jobs done within their deadline with a 95 %
Wilson interval (jobs pooled over the seeds), what became of the rest (shed at submit,
expired, unfinished), whether every shed or expired job was given a reason, and the offered
loads the arm met (compute, and effective as measured in its runs).

A target effective load E is reached by choosing the compute load: a pilot run at E / 1.1
measures the run's load seconds per execution second r, and the point runs at E / (1 + r)
(the effective offered load of each arm is reported as it came out).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from app.bench.models_sim import models_config, residency_for, sim_trace
from app.bench.models_workload import ModelJob, ModelsWorkload, generate_jobs, model_catalog
from app.bench.report import wilson_interval
from app.bench.sim_records import SimResult
from app.bench.sim_workload import SimArrival, sim_policy
from app.bench.simulate import ClusterSim
from scheduler.lifecycle import SloClass
from scheduler.policy import OverloadMeasure

TARGETS = (0.8, 1.0, 1.3)
MEASURES = (OverloadMeasure.EFFECTIVE, OverloadMeasure.COMPUTE)
PROTECTED = (SloClass.REALTIME, SloClass.INTERACTIVE)
GOALS = {0.8: 0.99, 1.0: 0.99, 1.3: 0.95}
"""Within-SLO share the protected classes aim at, by effective load (a benchmark goal, not a
test)."""
NOTE = ("simulated: the live tick's planner, admission and placement on a virtual clock; the "
        "workload's loads, sizes and job times are drawn from distributions shaped on the "
        "GenTD26 production trace's figures, not measured on this machine")


def overload_workload(load: float, seed: int, jobs: int, workers: int) -> ModelsWorkload:
    """The sweep's workload at compute load ``load``: 10 % realtime (due 2 × execution), 40 %
    interactive (3 ×), 50 % batch (10 ×)."""
    return ModelsWorkload(jobs=jobs, workers=workers, load=load, seed=seed,
                          realtime_share=0.1, interactive_share=0.4)


def run_arm(workload: ModelsWorkload, measure: OverloadMeasure, placement: str = "stepline",
            floors: Callable[[Sequence[ModelJob]], Mapping[int, int]] | None = None,
            degrade_load: float | None = None,
            levels: tuple[float | None, float | None] = (None, None),
            degrade_queued_load: float | None = None,
            ) -> tuple[list[SimArrival], SimResult, float]:
    """One seeded trace under ``measure``: its arrivals, the result and the arrival span.
    ``floors``: the quality floors the trace's jobs give, from its jobs (None: none);
    ``degrade_load``: the policy's gate for degrading them (None: the default); ``levels``: the
    cache share and smallest pixel share a job with a floor also allows; past
    ``degrade_queued_load`` waiting jobs are degraded too (``ClusterSim``)."""
    catalog = model_catalog(workload)
    jobs = generate_jobs(workload, catalog)
    median = sorted(m.bytes for m in catalog.models)[len(catalog.models) // 2]
    device = max(int(3.0 * median), max(m.bytes for m in catalog.models))
    residency = residency_for(placement, catalog, device, int(8.0 * median),
                              20.0 * workload.time_scale)
    config = models_config(workload, residency, jobs, 0.5 * workload.time_scale)
    trace = sim_trace(jobs, workload.seed, floors=None if floors is None else floors(jobs))
    if levels != (None, None):
        trace = [a if a.min_steps is None else replace(
            a, cache_share=levels[0], min_pixel_share=levels[1]) for a in trace]
    policy = replace(sim_policy(config, "stepline"), overload_measure=measure)
    if degrade_load is not None:
        policy = replace(policy, degrade_load=degrade_load)
    result = ClusterSim(config, trace, policy, degrade_queued_load=degrade_queued_load).run()
    return trace, result, max((a.arrival_s for a in trace), default=0.0)


def run_figures(trace: Sequence[SimArrival], result: SimResult, span_s: float,
                workers: int) -> dict[str, Any]:
    """One run's counts: per class jobs, met and outcomes; reasons given; jobs still
    unfinished when the run ended (after the last deadline: late without being shed); the
    offered loads."""
    classes: dict[str, dict[str, Any]] = {}
    for cls in SloClass:
        picked = [a for a in trace if a.shape.slo is cls]
        outcomes: dict[str, int] = {}
        for a in picked:
            outcomes[result.status[a.index]] = outcomes.get(result.status[a.index], 0) + 1
        met = sum(1 for a in picked if (f := result.finished_s[a.index]) is not None
                  and f <= a.deadline_s + 1e-9)
        classes[cls.value] = {"jobs": len(picked), "met": met, "outcomes": outcomes}
    ended = [a.index for a in trace if result.status[a.index] in ("shed", "expired")]
    exec_s = sum(sum(a.chunk_s) for a in trace)
    load_s = float(sum((result.residency or {}).get("per_job", {}).get("load_s", [])))
    capacity_s = max(workers * span_s, 1e-9)
    return {"classes": classes, "shed_or_expired": len(ended),
            "with_reason": sum(1 for k in ended if result.reasons.get(k)),
            "parked": sum(1 for a in trace if "held" in result.reasons.get(a.index, "")
                          and result.status[a.index] == "done"),
            "unfinished": sum(1 for a in trace
                              if result.status[a.index] not in ("done", "shed", "expired")),
            "compute_offered": exec_s / capacity_s,
            "effective_offered": (exec_s + load_s) / capacity_s,
            "shed_reason_example": next((result.reasons[k] for k in ended
                                         if result.reasons.get(k)), None)}


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one arm as one: counts summed, each class's within-SLO share with its 95 %
    Wilson interval over all its jobs, offered loads averaged."""
    classes: dict[str, Any] = {}
    for name in runs[0]["classes"]:
        jobs = sum(r["classes"][name]["jobs"] for r in runs)
        met = sum(r["classes"][name]["met"] for r in runs)
        outcomes: dict[str, int] = {}
        for r in runs:
            for key, n in r["classes"][name]["outcomes"].items():
                outcomes[key] = outcomes.get(key, 0) + n
        ci = wilson_interval(met, jobs)
        classes[name] = {"jobs": jobs, "met": met, "within_slo": met / jobs if jobs else None,
                         "ci95": list(ci) if ci else None,
                         "outcomes": dict(sorted(outcomes.items()))}
    summed = {key: sum(r[key] for r in runs)
              for key in ("shed_or_expired", "with_reason", "parked", "unfinished")}
    mean = {key: sum(r[key] for r in runs) / len(runs)
            for key in ("compute_offered", "effective_offered")}
    example = next((r["shed_reason_example"] for r in runs if r["shed_reason_example"]), None)
    return {"classes": classes, **summed, **mean, "shed_reason_example": example}


def calibrate(target: float, seed: int, jobs: int, workers: int) -> float:
    """The compute load whose effective offered load comes near ``target`` (module
    docstring)."""
    trace, result, span_s = run_arm(overload_workload(target / 1.1, seed, jobs, workers),
                                    OverloadMeasure.EFFECTIVE)
    figures = run_figures(trace, result, span_s, workers)
    ratio = figures["effective_offered"] / max(figures["compute_offered"], 1e-9)
    return target / max(ratio, 1.0)


def goal_check(point: dict[str, Any]) -> dict[str, Any]:
    """Whether the effective arm met the protected classes' goal at this point, by its
    interval's centre (within_slo) and by its lower bound."""
    goal = GOALS.get(point["target_effective_load"])
    arm = point["arms"][OverloadMeasure.EFFECTIVE.value]
    shares = {c.value: arm["classes"][c.value]["within_slo"] for c in PROTECTED}
    return {"goal": goal, "within_slo": shares,
            "met": None if goal is None else all(s is not None and s >= goal
                                                  for s in shares.values())}


def run_overload_bench(targets: Sequence[float] = TARGETS, seeds: int = 3, jobs: int = 600,
                       workers: int = 8,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The sweep (module docstring): per target, both arms on the same ``seeds`` traces."""
    started = time.perf_counter()
    points = []
    for target in targets:
        compute = calibrate(target, 1000, jobs, workers)
        arms: dict[str, Any] = {}
        for measure in MEASURES:
            runs = [run_figures(*run_arm(overload_workload(compute, seed, jobs, workers),
                                         measure), workers) for seed in range(1, seeds + 1)]
            arms[measure.value] = pooled(runs)
            if progress is not None:
                progress(line(target, measure.value, arms[measure.value]))
        point = {"target_effective_load": target, "compute_load": compute, "arms": arms}
        points.append(point | {"goal": goal_check(point)})
    return {"simulated": True, "note": NOTE, "workers": workers, "jobs_per_trace": jobs,
            "seeds": seeds, "goals": {str(k): v for k, v in GOALS.items()}, "points": points,
            "wall_s": time.perf_counter() - started}


def line(target: float, measure: str, arm: dict[str, Any]) -> str:
    """One printed row: the arm's offered loads and each class's within-SLO share."""
    shares = " ".join(f"{name} {100 * c['within_slo']:.1f}%"
                      for name, c in arm["classes"].items() if c["within_slo"] is not None)
    return (f"E={target:.1f} {measure:9s} compute {arm['compute_offered']:.2f} effective "
            f"{arm['effective_offered']:.2f}: {shares}; shed/expired {arm['shed_or_expired']} "
            f"(reasons {arm['with_reason']}), unfinished {arm['unfinished']}")
