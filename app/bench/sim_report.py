"""Simulated runs over policies and their report: every policy (and the clairvoyant oracles) on
one seeded trace, per-class figures (SLO attainment, latency quantiles, goodput), the planner's
tick times, the policies' estimate error, the whole study as written to ``simulation.json``,
and its summary table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from app.bench.oracle import Discipline, OracleJob, mean_response_lower_bound_s, run_oracle
from app.bench.report import percentile
from app.bench.sim_records import SimResult
from app.bench.sim_workload import (
    CLASS_TARGET_S,
    MIX,
    URGENT,
    SimArrival,
    SimConfig,
    generate_trace,
    offered_load,
    sim_policy,
)
from app.bench.simulate import ClusterSim

NOTE = ("simulated: a discrete-event model of the adapter, the workers and the Celery queues "
        "driving the live tick's planner on a virtual clock; chunk times are published H100 step "
        "figures (cost-model priors) with jitter, not measurements of this machine")
SIM_POLICIES = ("fifo", "priority", "edf", "srpt", "least_slack", "stepline")
ORACLES = ("oracle-edf", "oracle-srpt")
ALL_POLICIES = (*SIM_POLICIES, *ORACLES)
GROUPS = ("urgent", "realtime", "interactive", "batch", "all")
"""Report rows: ``urgent`` is the realtime jobs with an SLO under 100 ms (stress test only)."""


def simulate_policy(config: SimConfig, trace: Sequence[SimArrival], policy: str) -> SimResult:
    """One policy (or oracle) on ``trace``."""
    if policy in ORACLES:
        return _oracle_result(config, trace, Discipline(policy.removeprefix("oracle-")))
    return ClusterSim(config, trace, sim_policy(config, policy)).run()


def _oracle_result(config: SimConfig, trace: Sequence[SimArrival],
                   discipline: Discipline) -> SimResult:
    started = time.perf_counter()
    jobs = [OracleJob(a.arrival_s, sum(a.chunk_s), a.deadline_s) for a in trace]
    finished = run_oracle(jobs, config.workers, discipline, config.end_s, config.fail_at_s)
    status = ["done" if f is not None else "unfinished" for f in finished]
    busy_s = sum(min(j.size_s, config.end_s - j.arrival_s) for j in jobs)
    fail_s = config.fail_at_s
    capacity_s = config.workers * config.end_s - (
        config.end_s - fail_s if fail_s is not None else 0.0)
    return SimResult(finished, status, min(busy_s, capacity_s), 0.0, 0.0, capacity_s,
                     wall_s=time.perf_counter() - started)


def group_metrics(trace: Sequence[SimArrival], result: SimResult, duration_s: float,
                  end_s: float) -> dict[str, dict[str, Any]]:
    """Per report row: attainment (met ÷ submitted jobs due by the end of the run), latency
    quantiles of completed jobs, goodput (jobs meeting their SLO per second of arrivals) and
    what happened to the rest."""
    rows: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        picked = [a for a in trace if group == "all" or a.group == group]
        if not picked:
            continue
        lat = sorted(f - a.arrival_s for a in picked
                     if (f := result.finished_s[a.index]) is not None)
        met = sum(1 for a in picked if (f := result.finished_s[a.index]) is not None
                  and f <= a.deadline_s + 1e-9)
        counts = {s: sum(1 for a in picked if result.status[a.index] == s)
                  for s in ("shed", "expired", "unfinished")}
        # unfinished when the run ended but not yet due: neither met nor missed
        undecided = sum(1 for a in picked if result.status[a.index] == "unfinished"
                        and a.deadline_s > end_s)
        rows[group] = {
            "submitted": len(picked), "completed": len(lat), "met_slo": met,
            "undecided": undecided,
            "slo_attainment": met / max(len(picked) - undecided, 1),
            "p50_latency_s": percentile(lat, 50), "p95_latency_s": percentile(lat, 95),
            "p99_latency_s": percentile(lat, 99),
            "mean_latency_s": statistics.fmean(lat) if lat else None,
            "goodput_jobs_per_s": met / duration_s, **counts,
        }
    return rows


def estimate_error(config: SimConfig, trace: Sequence[SimArrival],
                   result: SimResult) -> dict[str, Any] | None:
    """|first estimate − true service| ÷ true service (chunk times plus one hop each) over the
    jobs the policy estimated: p50, p95 and how many."""
    hop_s = config.dispatch_overhead_s
    errors = sorted(abs(est - true_s) / true_s
                    for a, est in zip(trace, result.first_estimates_s, strict=False)
                    if est is not None and (true_s := sum(a.chunk_s) + len(a.chunk_s) * hop_s) > 0)
    if not errors:
        return None
    return {"jobs": len(errors), "p50": percentile(errors, 50), "p95": percentile(errors, 95)}


def _tick_stats(result: SimResult) -> dict[str, Any] | None:
    if not result.tick_ms:
        return None
    ordered = sorted(result.tick_ms)
    return {"ticks": len(ordered), "p50_ms": percentile(ordered, 50),
            "p99_ms": percentile(ordered, 99), "max_ms": ordered[-1],
            "mean_ms": statistics.fmean(ordered), "max_jobs_in_snapshot": max(result.tick_jobs)}


def policy_report(config: SimConfig, trace: Sequence[SimArrival],
                  result: SimResult) -> dict[str, Any]:
    capacity_s = max(result.capacity_s, 1e-9)
    return {
        "simulated": True,
        "groups": group_metrics(trace, result, config.duration_s, config.end_s),
        "utilisation": result.busy_s / capacity_s,
        "dispatch_overhead_share": result.overhead_s / capacity_s,
        "lost_work_s": result.lost_s,
        "preemptions": result.preemptions,
        "plan_tick": _tick_stats(result),
        "estimate_error": estimate_error(config, trace, result),
        "wall_s": result.wall_s,
    }


def run_config(config: SimConfig, policies: Sequence[str]) -> dict[str, Any]:
    """Every policy on one seeded trace."""
    trace = generate_trace(config)
    jobs = [OracleJob(a.arrival_s, sum(a.chunk_s), a.deadline_s) for a in trace]
    return {
        "simulated": True,
        "note": NOTE,
        "workers": config.workers, "rate_per_s": config.rate_per_s,
        "duration_s": config.duration_s, "drain_s": config.drain_s, "seed": config.seed,
        "stress": config.urgent_share > 0 or config.fail_at_s is not None,
        "urgent_share": config.urgent_share, "fail_at_s": config.fail_at_s,
        "dispatch_overhead_ms": config.dispatch_overhead_s * 1e3, "jitter": config.jitter,
        "jobs": len(trace), "offered_load": offered_load(config),
        "mean_latency_lower_bound_s": mean_response_lower_bound_s(jobs, config.workers),
        "policies": {p: policy_report(config, trace, simulate_policy(config, trace, p))
                     for p in policies},
    }


def check_policies(policies: Sequence[str]) -> None:
    """Raise ValueError naming any policy the simulation does not know."""
    unknown = set(policies) - set(ALL_POLICIES)
    if unknown or not policies:
        raise ValueError(f"unknown policies {sorted(unknown)}; use {', '.join(ALL_POLICIES)}")


def run_simulation(configs: Sequence[SimConfig], policies: Sequence[str]) -> dict[str, Any]:
    """The whole study, as written to ``simulation.json``."""
    check_policies(policies)
    return {
        "simulated": True,
        "note": NOTE,
        "oracles": ("clairvoyant preemptive global EDF / SRPT on the same workers: exact sizes, "
                    "preemption and migration at any instant (not only at step boundaries), "
                    "no dispatch overhead, no tick delay, no work lost on failure. Not a "
                    "theorem-grade bound for several workers; mean_latency_lower_bound_s "
                    "(SRPT on one worker N times as fast) is one for mean latency"),
        "mix": [{"name": s.name, "share": s.share, "class": s.slo.value, "chunks": s.chunks,
                 "chunk_s": s.units_per_chunk * s.s_per_unit, "block_groups": s.block_groups,
                 "service_s": s.service_s,
                 "slo_s": s.deadline_s or CLASS_TARGET_S[s.slo]} for s in (*MIX, URGENT)],
        "runs": [run_config(c, policies) for c in configs],
    }


def grid_configs(workers: Sequence[int], rates: Sequence[float], duration_s: float,
                 stress: bool, seed: int = 1, **overrides: Any) -> list[SimConfig]:
    """One config per (workers, rate); ``stress`` adds urgent jobs and a worker failure."""
    make = SimConfig.stress if stress else SimConfig
    return [make(workers=w, rate_per_s=r, duration_s=duration_s, seed=seed, **overrides)
            for w in workers for r in rates]


def summary_table(run: dict[str, Any]) -> Any:
    """A rich table of one run: per policy and report row, attainment, latency, goodput."""
    from rich.table import Table

    stress = " stress (urgent < 100 ms, a worker fails)" if run["stress"] else ""
    table = Table("policy", "class", "jobs", "SLO met", "p50 s", "p95 s", "p99 s", "goodput/s",
                  "util", "tick p50/p99 ms",
                  title=f"SIMULATED: {run['workers']} workers, {run['rate_per_s']:g} jobs/s, "
                        f"offered load {run['offered_load']:.2f}{stress}")
    for name, rep in run["policies"].items():
        tick = rep["plan_tick"]
        ticks = f"{tick['p50_ms']:.1f}/{tick['p99_ms']:.1f}" if tick else "-"
        rows = list(rep["groups"].items())
        for k, (group, g) in enumerate(rows):
            table.add_row(name, group, str(g["submitted"]), f"{100 * g['slo_attainment']:.1f}%",
                          *(_fmt(g[q]) for q in ("p50_latency_s", "p95_latency_s",
                                                 "p99_latency_s")),
                          f"{g['goodput_jobs_per_s']:.1f}",
                          f"{rep['utilisation']:.2f}" if group == "all" else "",
                          ticks if group == "all" else "", end_section=k == len(rows) - 1)
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
