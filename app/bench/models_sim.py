"""The many-model workload in the simulator: its jobs as a simulated trace, the placement
policies compared (model-oblivious, route-to-warm LRU, Stepline, and an oracle), the figures the
issue asks for per policy, and the highest load each holds at a target attainment.

Every policy runs the same Stepline planner on the same seeded trace on the same simulated
hardware (device budget, host tier); they differ only in where a released chunk goes, what a
worker evicts, whether the planner is told a job's expected load, and staging:

- ``oblivious``: any worker takes a released chunk from its class queue (the placement before
  residency); per-worker LRU eviction.
- ``warm``: a released chunk goes to an idle worker holding its model, else to its class
  queue; per-worker LRU (Ray Serve's model multiplexing: LRU per replica, routed to a replica
  that holds the model).
- ``stepline``: :func:`scheduler.placement.place` (the soonest expected start counting the
  load, waiting for a warm worker soon free, a load charged the reloads it causes); cost-aware
  eviction (expected reuse × reload cost, as ``workers.residency``); the planner counts a cold
  job's expected load into its remaining time; models whose queue builds are staged into host
  memory.
- ``oracle``: every load takes no time (a cluster whose every worker holds every model), under
  the same planner. Not a bound on every schedule: a bound on what cold starts cost this
  planner.

The queue mechanics are common to all four (``app.bench.simulate``, with residency): a job's
next chunk stays on the worker that ran its last one (its own queue ``<w>.<class>``, as the
live affinity queues), and so does a chunk the plan moves to standby (``<w>.standby``, before
the shared standby queue); a chunk placed on a busy worker waits in ``<w>.<class>.placed``,
after that worker's own queue, so the job there finishes first instead of sharing the worker
chunk by chunk; a parked chunk moves to its class queue after ``park_max_wait_s`` (20 s at
scale 1, about a p75 load). A job pays its model's load again only when it is preempted or
parked too long and resumes elsewhere, or its model was evicted meanwhile.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from app.bench.models_workload import (
    Catalog,
    ModelJob,
    ModelsWorkload,
    generate_jobs,
    model_catalog,
)
from app.bench.report import mean_ci, percentile, wilson_interval
from app.bench.sim_records import SimResult
from app.bench.sim_residency import GB, ResidencyConfig
from app.bench.sim_workload import Shape, SimArrival, SimConfig, sim_policy
from app.bench.simulate import ClusterSim
from scheduler import JobKind, PolicyConfig, Tier
from scheduler.lifecycle import SloClass
from scheduler.placement import PlacementPolicy

COST_KEY = "image-1024"
"""The cost key a simulated diffusion step is learned under."""
PLACEMENTS = ("oblivious", "warm", "stepline", "oracle")
CLASSES = (SloClass.INTERACTIVE, SloClass.BATCH)
NOTE = ("simulated: the live tick's planner and scheduler.placement.place on a virtual "
        "clock; model loads, sizes and job times are drawn from distributions shaped on the "
        "GenTD26 production trace's figures (Lin et al., SoCC '25), not measured on this machine")


def sim_trace(jobs: Sequence[ModelJob], seed: int = 1, jitter: float = 0.1,
              floors: Mapping[int, int] | None = None) -> list[SimArrival]:
    """The workload's jobs as simulated arrivals: one chunk per denoising step, each step's
    true time the job's ``step_s`` with ``jitter``; the cost units a job declares are its step
    time at the cost key's prior (what a recipe's shape tells the live cost model). ``floors``:
    the quality floor (``min_steps``) of the jobs, by index, that allow degradation."""
    rng = random.Random(f"trace-{seed}")
    s_per_unit = PolicyConfig().new_cost_model().prior_s_per_unit(COST_KEY)
    trace: list[SimArrival] = []
    for job in jobs:
        shape = Shape(job.model, 0.0, job.slo, JobKind.IMAGE, COST_KEY, job.steps,
                      job.step_s / s_per_unit, s_per_unit, 1, deadline_s=job.slo_s)
        chunk_s = tuple(job.step_s * (1.0 + jitter * (2.0 * rng.random() - 1.0))
                        for _ in range(job.steps))
        trace.append(SimArrival(job.index, job.arrival_s, shape, Tier.STANDARD, chunk_s,
                                job.deadline_s, job.model, job.adapters,
                                min_steps=(floors or {}).get(job.index)))
    return trace


def residency_for(placement: str, catalog: Catalog, device_budget_bytes: int,
                  host_budget_bytes: int, park_max_wait_s: float) -> ResidencyConfig:
    """The residency and placement of one compared policy (see the module docstring)."""
    common: dict[str, Any] = {"catalog": catalog, "device_budget_bytes": device_budget_bytes,
                              "host_budget_bytes": host_budget_bytes,
                              "park_max_wait_s": park_max_wait_s}
    if placement == "oblivious":
        return ResidencyConfig(placement=PlacementPolicy.OBLIVIOUS, eviction="lru",
                               loads_in_plan=False, **common)
    if placement == "warm":
        return ResidencyConfig(placement=PlacementPolicy.WARM, eviction="lru",
                               loads_in_plan=False, **common)
    if placement == "stepline":
        return ResidencyConfig(placement=PlacementPolicy.STEPLINE, eviction="cost",
                               stage=host_budget_bytes > 0, **common)
    if placement == "oracle":
        return ResidencyConfig(placement=PlacementPolicy.OBLIVIOUS, eviction="lru",
                               free_loads=True, loads_in_plan=False, **common)
    raise ValueError(f"unknown placement {placement!r}; use {', '.join(PLACEMENTS)}")


def models_config(workload: ModelsWorkload, residency: ResidencyConfig, jobs: Sequence[ModelJob],
                  tick_s: float, hop_s: float | None = None) -> SimConfig:
    """A simulated run long enough for every arrival and for the last job's batch deadline;
    ``hop_s``: the overhead each chunk pays (None: the simulator's default)."""
    last = max((j.arrival_s for j in jobs), default=0.0)
    drain_s = max((j.deadline_s - last for j in jobs), default=0.0) + 1.0
    config = SimConfig(workers=workload.workers, rate_per_s=workload.rate_per_s(),
                       duration_s=last + 1e-6, drain_s=drain_s, seed=workload.seed,
                       tick_s=tick_s, residency=residency)
    return config if hop_s is None else replace(config, dispatch_overhead_s=hop_s)


def run_placement(workload: ModelsWorkload, placement: str, *, device_models: float = 3.0,
                  host_models: float = 8.0, tick_s: float = 0.5,
                  park_max_wait_s: float = 20.0, slots_per_worker: int = 1,
                  warmup: float = 0.0,
                  jobs: Sequence[ModelJob] | None = None,
                  catalog: Catalog | None = None,
                  scheduler: Mapping[str, float] | None = None) -> dict[str, Any]:
    """One policy on the workload's seeded trace: the figures of :func:`placement_figures`.
    Budgets are in models of the catalog's median size (``host_models`` 0: no host tier);
    ``warmup``: the share of the first jobs run but not measured;
    ``park_max_wait_s`` and ``tick_s`` are on the workload's clock at ``time_scale`` 1;
    ``scheduler``: scheduler settings by name to run with (:func:`with_scheduler`)."""
    catalog = catalog or model_catalog(workload)
    jobs = list(jobs) if jobs is not None else generate_jobs(workload, catalog)
    median = sorted(m.bytes for m in catalog.models)[len(catalog.models) // 2]
    largest = max(m.bytes for m in catalog.models)
    device = max(int(device_models * median), largest)
    residency = residency_for(placement, catalog, device, int(host_models * median),
                              park_max_wait_s * workload.time_scale)
    config = models_config(workload, residency, jobs, tick_s * workload.time_scale)
    trace = sim_trace(jobs, workload.seed)
    policy = with_scheduler(replace(sim_policy(config, "stepline"),
                                    slots_per_worker=slots_per_worker), scheduler)
    result = ClusterSim(config, trace, policy).run()
    return placement_figures(trace, result, config, int(warmup * len(jobs))) | {
        "device_budget_gb": device / GB * workload.byte_scale ** -1,
        "host_budget_gb": int(host_models * median) / GB * workload.byte_scale ** -1}


SCHEDULER_FIELDS = {"realtime_quantum": "level_quanta_s[0]",
                    "interactive_quantum": "level_quanta_s[1]",
                    "aging_bound": "aging_bound_s"}
"""The scheduler settings (``tasks.settings.scheduler``, ``STEPLINE_SCHEDULER__<NAME>`` live)
a benchmark may set, and the policy field each becomes."""


def with_scheduler(policy: PolicyConfig, scheduler: Mapping[str, float] | None) -> PolicyConfig:
    """``policy`` with the scheduler settings named in ``scheduler`` (:data:`SCHEDULER_FIELDS`)
    as the live settings would turn them into it."""
    if not scheduler:
        return policy
    unknown = set(scheduler) - set(SCHEDULER_FIELDS)
    if unknown:
        raise ValueError(f"unknown scheduler settings {sorted(unknown)}; "
                         f"use {', '.join(SCHEDULER_FIELDS)}")
    quanta = list(policy.level_quanta_s)
    quanta[0] = scheduler.get("realtime_quantum", quanta[0])
    quanta[1] = scheduler.get("interactive_quantum", quanta[1])
    return replace(policy, level_quanta_s=(quanta[0], quanta[1]),
                   aging_bound_s=scheduler.get("aging_bound", policy.aging_bound_s))


def group_figures(jobs: int, met: int, latencies_s: Sequence[float]) -> dict[str, Any]:
    """One group's row (simulated or live): ``met`` of ``jobs`` within their deadline, with a
    Wilson interval, and the p95 latency of the ``latencies_s`` of those that finished."""
    ci = wilson_interval(met, jobs)
    return {"jobs": jobs, "met": met, "attainment": met / jobs if jobs else None,
            "ci95": list(ci) if ci else None, "p95_latency_s": percentile(list(latencies_s), 95),
            "unfinished": jobs - len(latencies_s)}


def placement_figures(trace: Sequence[SimArrival], result: SimResult, config: SimConfig,
                      warmup: int = 0) -> dict[str, Any]:
    """Over the jobs after the first ``warmup`` (a pool starts with empty memories; the
    production pool the figures describe is warm): per class and overall, SLO attainment with
    its 95 % Wilson interval and p95 latency; base and adapter loads per 100 jobs (each load
    counted against the job whose chunk paid it); the share of the time those jobs held a
    worker that went to loading; the share whose first chunk started on a worker holding their
    base. ``load_share_of_capacity`` is over the whole run."""
    measured = [a for a in trace if a.index >= warmup]
    groups: dict[str, Any] = {}  # each with its jobs' outcomes: done, shed, expired, ...
    for name, picked in (("all", measured),
                         *((c.value, [a for a in measured if a.shape.slo is c])
                           for c in CLASSES)):
        met = sum(1 for a in picked if (f := result.finished_s[a.index]) is not None
                  and f <= a.deadline_s + 1e-9)
        lat = sorted(f - a.arrival_s for a in picked
                     if (f := result.finished_s[a.index]) is not None)
        groups[name] = group_figures(len(picked), met, lat)
        groups[name]["outcomes"] = {
            status: sum(1 for a in picked if result.status[a.index] == status)
            for status in sorted({result.status[a.index] for a in picked})}
    res = result.residency or {}
    per_job = res.get("per_job", {})
    n = max(len(measured), 1)

    def total(key: str) -> float:
        values = per_job.get(key)
        return float(sum(values[a.index] for a in measured)) if values else 0.0

    load_s = total("load_s")
    exec_s = sum(sum(a.chunk_s) for a in measured)
    warm = per_job.get("started_warm") or []
    started = [warm[a.index] for a in measured if warm and warm[a.index] is not None]
    capacity_s = max(result.capacity_s, 1e-9)
    return {
        "groups": groups,
        "measured_jobs": len(measured), "warmup_jobs": warmup,
        "base_loads_per_100": 100.0 * total("base_loads") / n,
        "host_loads_per_100": 100.0 * total("host_loads") / n,
        "resume_loads_per_100": 100.0 * total("resume_loads") / n,
        "adapter_loads_per_100": 100.0 * total("adapter_loads") / n,
        "load_share_of_busy": load_s / max(load_s + exec_s, 1e-9),
        "load_share_of_capacity": float(res.get("load_s", 0.0)) / capacity_s,
        "utilisation": result.busy_s / capacity_s,
        "warm_start_share": sum(started) / len(started) if started else None,
        "staged": res.get("staged", 0),
        "parked_recovered": res.get("parked_recovered", 0),
        "preemptions": result.preemptions,
        "peak_device_bytes": res.get("peak_device_bytes"),
        "device_budget_bytes": res.get("device_budget_bytes"),
        "wall_s": result.wall_s,
    }


WEIGHTED = ("base_loads_per_100", "host_loads_per_100", "resume_loads_per_100",
            "adapter_loads_per_100", "load_share_of_busy", "load_share_of_capacity",
            "utilisation", "warm_start_share")
"""Per-job rates and shares :func:`pool_figures` averages, each trace weighted by its measured
jobs."""
SUMMED = ("measured_jobs", "warmup_jobs", "staged", "parked_recovered", "preemptions", "wall_s")


def pool_figures(per_trace: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's :func:`placement_figures` over several traces of a row, as one: each
    group's jobs, met and unfinished summed (attainment and its Wilson interval over all those
    jobs), its p95 latency the mean of the traces' p95s; rates and shares (:data:`WEIGHTED`)
    averaged with each trace weighted by its measured jobs; counts summed; peak bytes the
    highest. ``trace_attainment`` keeps each trace's overall attainment and
    ``trace_mean`` its mean with a 95 % t-interval over the traces: the Wilson interval treats
    jobs as independent, but within a trace they share its overload episodes (one trace of 1 500
    jobs at 8 workers and load 0.8 gave 90.1 % where three others gave 96.5-97.4 %), so only the
    spread between traces says how far a row's figure would move on another."""
    if not per_trace:
        raise ValueError("pool_figures needs at least one trace's figures")
    first = per_trace[0]
    weights = [max(f["measured_jobs"], 0) for f in per_trace]
    groups: dict[str, Any] = {}
    for name in first["groups"]:
        jobs = sum(f["groups"][name]["jobs"] for f in per_trace)
        met = sum(f["groups"][name]["met"] for f in per_trace)
        p95s = [p for f in per_trace if (p := f["groups"][name]["p95_latency_s"]) is not None]
        ci = wilson_interval(met, jobs)
        groups[name] = {"jobs": jobs, "met": met, "attainment": met / jobs if jobs else None,
                        "ci95": list(ci) if ci else None,
                        "p95_latency_s": sum(p95s) / len(p95s) if p95s else None,
                        "unfinished": sum(f["groups"][name]["unfinished"] for f in per_trace),
                        "outcomes": _summed(f["groups"][name].get("outcomes", {})
                                            for f in per_trace)}
    pooled: dict[str, Any] = {k: v for k, v in first.items() if k not in groups}
    pooled["groups"] = groups
    for key in WEIGHTED:
        values = [(f[key], w) for f, w in zip(per_trace, weights, strict=True)
                  if f.get(key) is not None]
        weight = sum(w for _, w in values)
        pooled[key] = sum(v * w for v, w in values) / weight if values and weight else None
    for key in SUMMED:
        pooled[key] = sum(f.get(key) or 0 for f in per_trace)
    peaks = [f["peak_device_bytes"] for f in per_trace if f.get("peak_device_bytes")]
    pooled["peak_device_bytes"] = max(peaks) if peaks else first.get("peak_device_bytes")
    attained = [f["groups"]["all"]["attainment"] or 0.0 for f in per_trace]
    spread = mean_ci(attained)
    pooled["traces"] = len(per_trace)
    pooled["trace_attainment"] = attained
    pooled["trace_mean"] = {"mean": spread["mean"], "ci95": [spread["lo"], spread["hi"]]}
    return pooled


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def paired_points(mine: Sequence[float], other: Sequence[float],
                  scale: float = 100.0) -> dict[str, Any]:
    """``mine`` less ``other``, trace by trace, in points (attainments as fractions: ``scale``
    100; already in per cent: 1): the mean difference with its 95 % t-interval over the
    traces, and on how many ``mine`` was ahead."""
    diffs = [scale * (a - b) for a, b in zip(mine, other, strict=True)]
    if not diffs:
        raise ValueError("paired_points needs at least one trace")
    ci = mean_ci(diffs)
    return {"mean_points": ci["mean"], "ci95": [ci["lo"], ci["hi"]],
            "ahead": sum(d > 0 for d in diffs), "traces": len(diffs)}


def max_load_at(workload: ModelsWorkload, placement: str, target: float = 0.99,
                lo: float = 0.1, hi: float = 1.3, steps: int = 5, seeds: int = 1,
                **run: Any) -> dict[str, Any]:
    """The highest offered load (by bisection over ``[lo, hi]``, ``steps`` probes) at which
    ``placement``'s overall attainment stays at ``target`` or above. Each probe runs ``seeds``
    fresh traces (the workload's seed and the next ones) at that load and pools their jobs:
    at 99 % of a few hundred measured jobs one job either way moves a single trace's verdict,
    and the bisection with it. 0 when even ``lo`` misses it."""
    probes: list[dict[str, Any]] = []

    def holds(load: float) -> bool:
        met = jobs = 0
        for k in range(seeds):
            figures = run_placement(replace(workload, load=load, seed=workload.seed + k),
                                    placement, **run)
            overall = figures["groups"]["all"]
            met, jobs = met + overall["met"], jobs + overall["jobs"]
        attained = met / jobs if jobs else 0.0
        ci = wilson_interval(met, jobs)
        probes.append({"load": load, "attainment": attained, "jobs": jobs,
                       "ci95": list(ci) if ci else None})
        return attained >= target

    if not holds(lo):
        return {"max_load": 0.0, "probes": probes, "seeds": seeds}
    for _ in range(steps):
        if hi - lo < 1e-3:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return {"max_load": lo, "resolution": hi - lo, "probes": probes, "seeds": seeds}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None if a is None or b is None or a else 0.0 if a == 0 else math.inf
    return a / b
