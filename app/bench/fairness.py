"""``stepline bench --fairness``: tenant fair share in the simulator (the live tick's planner).

N tenants of one tier (standard) submit the same mix — 70 % interactive 512² images (20 steps),
30 % batch 1024² images (28 steps) — as Poisson arrivals; one floods at ``flood`` times the
others' rate, the whole offered load ``load`` times the pool's capacity. Each seeded trace runs
under the fair order (``scheduler.fair_share.enabled``) and the unfair one, and the light
tenants' trace alone (no flood) under the fair order.

Per run, while arrivals last: each tenant's share of the worker-seconds served beside its
max-min fair share (water-filling the pool's worker-seconds over the tenants' offered work,
equal weights), Jain's index of served ÷ fair share, the light tenants' interactive p95 latency
with the flood over without it, and the jobs completed under the fair order over the unfair
one. Ratios are per seed, reported as the mean with a 95 % t-interval over the seeds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from app.bench.report import mean_ci, percentile
from app.bench.sim_records import SimResult
from app.bench.sim_workload import CLASS_TARGET_S, MIX, SimArrival, SimConfig, sim_policy
from app.bench.simulate import ClusterSim
from scheduler.fairness import FairShareConfig, jain_index
from scheduler.lifecycle import SloClass
from scheduler.model import Tier

SHAPES = ((MIX[1], 0.7), (MIX[3], 0.3))
"""(shape, share of a tenant's jobs): interactive image-512, batch image-1024."""
GOALS = {"jain": 0.95, "light_p95_ratio": 1.2, "throughput_ratio": 0.95}
NOTE = ("simulated: the live tick's planner and apply loop on a virtual clock, chunk times "
        "the cost model's H100 priors with 10 % jitter; not measured on this machine")


def mean_service_s() -> float:
    return sum(shape.service_s * share for shape, share in SHAPES)


def fairness_trace(tenants: int, flood: float, load: float, workers: int, duration_s: float,
                   seed: int, with_flood: bool = True) -> list[SimArrival]:
    """The seeded arrivals of every tenant (``t0`` floods), in arrival order."""
    rate = load * workers / ((tenants - 1 + flood) * mean_service_s())
    drawn: list[tuple[float, str, int]] = []
    for k in range(tenants):
        if k == 0 and not with_flood:
            continue
        rng = random.Random(f"{seed}-{k}")
        at, own = 0.0, rate * (flood if k == 0 else 1.0)
        while True:
            at += rng.expovariate(own)
            if at >= duration_s:
                break
            drawn.append((at, f"t{k}", rng.randrange(1 << 30)))
    trace: list[SimArrival] = []
    for at, tenant, draw in sorted(drawn):
        rng = random.Random(draw)
        shape = rng.choices([s for s, _ in SHAPES], [w for _, w in SHAPES])[0]
        base_s = shape.units_per_chunk * shape.s_per_unit
        chunk_s = tuple(base_s * (1.0 + 0.1 * (2.0 * rng.random() - 1.0))
                        for _ in range(shape.chunks))
        trace.append(SimArrival(len(trace), at, shape, Tier.STANDARD, chunk_s,
                                at + CLASS_TARGET_S[shape.slo], tenant=tenant))
    return trace


def max_min_shares(demand: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair worker-seconds (equal weights): water-filling ``capacity`` over
    ``demand``."""
    shares: dict[str, float] = {}
    left, pending = capacity, sorted(demand, key=demand.__getitem__)
    while pending:
        even = left / len(pending)
        tenant = pending[0]
        if demand[tenant] <= even:
            shares[tenant] = demand[tenant]
            left -= demand[tenant]
            pending.pop(0)
        else:
            for t in pending:
                shares[t] = even
            break
    return shares


def run_arm(trace: Sequence[SimArrival], config: SimConfig, fair: bool) -> SimResult:
    policy = sim_policy(config, "stepline")
    policy = replace(policy, fair_share=FairShareConfig(enabled=fair))
    return ClusterSim(config, trace, policy).run()


def _light_p95(trace: Sequence[SimArrival], result: SimResult) -> float | None:
    latencies = [f - a.arrival_s for a in trace if a.tenant != "t0"
                 and a.shape.slo is SloClass.INTERACTIVE
                 and (f := result.finished_s[a.index]) is not None]
    return percentile(latencies, 95)


def run_figures(trace: Sequence[SimArrival], result: SimResult,
                config: SimConfig) -> dict[str, Any]:
    """One run's shares, Jain's index, light p95 and completed jobs."""
    demand: dict[str, float] = {}
    for a in trace:
        demand[a.tenant or ""] = demand.get(a.tenant or "", 0.0) + sum(a.chunk_s)
    served = {t: result.served_s.get(t, 0.0) for t in sorted(demand)}
    total = sum(served.values()) or 1.0
    fair = max_min_shares(demand, sum(served.values()))
    return {"served_share": {t: s / total for t, s in served.items()},
            "fair_share": {t: fair[t] / total for t in served},
            "weight_share": {t: 1.0 / len(served) for t in served},
            "jain": jain_index([served[t] / fair[t] for t in served if fair[t] > 0]),
            "light_interactive_p95_s": _light_p95(trace, result),
            "completed": sum(1 for f in result.finished_s if f is not None),
            "jobs": len(trace)}


def run_fairness_bench(tenants: int = 4, flood: float = 10.0, load: float = 1.3,
                       workers: int = 8, duration_s: float = 60.0, seeds: int = 5,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The bench (module docstring)."""
    if not 2 <= tenants <= 8:
        raise ValueError("tenants must be 2..8")
    started = time.perf_counter()
    config = SimConfig(workers=workers, duration_s=duration_s, drain_s=60.0)
    runs = []
    for seed in range(1, seeds + 1):
        trace = fairness_trace(tenants, flood, load, workers, duration_s, seed)
        quiet = fairness_trace(tenants, flood, load, workers, duration_s, seed, False)
        fair = run_figures(trace, run_arm(trace, config, True), config)
        unfair = run_figures(trace, run_arm(trace, config, False), config)
        alone = run_figures(quiet, run_arm(quiet, config, True), config)
        base = alone["light_interactive_p95_s"]
        runs.append({"seed": seed, "fair": fair, "unfair": unfair, "no_flood": alone,
                     "light_p95_ratio": (fair["light_interactive_p95_s"] or 0.0) / base
                     if base else None,
                     "light_p95_ratio_unfair": (unfair["light_interactive_p95_s"] or 0.0)
                     / base if base else None,
                     "throughput_ratio": fair["completed"] / max(unfair["completed"], 1)})
        if progress is not None:
            progress(f"seed {seed}: Jain fair {fair['jain']:.3f} unfair {unfair['jain']:.3f}; "
                     f"light p95 {fair['light_interactive_p95_s']} vs no flood {base}; "
                     f"completed {fair['completed']} vs {unfair['completed']}")

    def ci(key: str, arm: str | None = None) -> dict[str, float] | None:
        values = [r[arm][key] if arm else r[key] for r in runs]
        kept = [v for v in values if v is not None]
        return mean_ci(kept) if kept else None

    summary = {"jain_fair": ci("jain", "fair"), "jain_unfair": ci("jain", "unfair"),
               "light_p95_ratio": ci("light_p95_ratio"),
               "light_p95_ratio_unfair": ci("light_p95_ratio_unfair"),
               "throughput_ratio": ci("throughput_ratio"),
               "flood_served_share_fair": mean_ci([r["fair"]["served_share"]["t0"]
                                                   for r in runs]),
               "flood_served_share_unfair": mean_ci([r["unfair"]["served_share"]["t0"]
                                                     for r in runs]),
               "flood_fair_share": mean_ci([r["fair"]["fair_share"]["t0"] for r in runs])}
    return {"simulated": True, "note": NOTE, "tenants": tenants, "flood": flood, "load": load,
            "workers": workers, "duration_s": duration_s, "seeds": seeds, "goals": GOALS,
            "summary": summary, "runs": runs, "wall_s": time.perf_counter() - started}
