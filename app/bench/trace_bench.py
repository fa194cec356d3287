"""The production-trace benchmark: windows of the GenTD26 trace (``app.bench.gentd26``) through
the simulator at the live scale and at larger pools, and (``live``) on a live stack of
simulated-device workers with the same jobs through the simulator on the same terms, under the
placements compared (model-oblivious, route-to-warm, Stepline, free loads); one JSON.

Per window and placement: deadlines met per class with 95 % Wilson intervals, p95 latency, base
and adapter loads per job, the share of worker capacity spent loading, the effective load
(the offered compute load with the loads the jobs paid counted as work: compute over the share
of busy time not spent loading), shed and expired
counts. Over the windows: Stepline's paired difference from each other placement (mean points
with a 95 % t-interval over the windows), its share of the free-load run's attainment, and its
base loads per job over route-to-warm's. Figures from the trace cite
:data:`app.bench.gentd26.CITATION`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.bench.gentd26 import (
    CITATION,
    LatencySamples,
    TraceRequest,
    TraceWindow,
    read_latencies,
    read_requests,
    scheduler_scale,
    window_jobs,
    window_starts,
    window_summary,
)
from app.bench.models_live import LiveSetup, run_live, run_sim
from app.bench.models_sim import PLACEMENTS, paired_points, run_placement
from app.bench.models_workload import ModelsWorkload

NOTE = ("GenTD26 requests (real base-model ids, LoRA counts, run times, arrival bursts) "
        "compressed to the offered compute load; loads drawn from the trace's own latency "
        "files; SLO classes and deadlines assigned (the trace has none). Sim: the live tick's "
        "planner and placement on a virtual clock; live: real workers of the simulated device")


def sim_row(requests: Sequence[TraceRequest], samples: LatencySamples, window: TraceWindow,
            placements: Sequence[str], device_models: float, host_models: float,
            tick_s: float, scale_scheduler: bool = True) -> dict[str, Any]:
    """One window through the simulator under each placement (each on the same jobs), with
    the scheduler's time knobs scaled to its jobs (:func:`scheduler_scale`) or at defaults."""
    catalog, jobs = window_jobs(requests, samples, window)
    scheduler = scheduler_scale(jobs) if scale_scheduler else {}
    workload = ModelsWorkload(jobs=len(jobs), workers=window.workers, load=window.load,
                              seed=window.seed, time_scale=window.time_scale)
    per: dict[str, Any] = {}
    for placement in placements:
        figures = run_placement(workload, placement, jobs=jobs, catalog=catalog,
                                device_models=device_models, host_models=host_models,
                                tick_s=tick_s, scheduler=scheduler)
        per[placement] = summarise(figures, window.load)
    return {"window": window_summary(requests, window, jobs), "scheduler": scheduler,
            "workers": window.workers, "load": window.load, "policies": per}


def summarise(figures: dict[str, Any], compute_load: float) -> dict[str, Any]:
    """The row a policy shows: attainment per class, p95, loads per job, loading share,
    effective load, outcomes."""
    groups = figures["groups"]
    return {
        "groups": {name: {k: g.get(k) for k in ("jobs", "met", "attainment", "ci95",
                                                 "p95_latency_s", "unfinished", "outcomes")}
                   for name, g in groups.items()},
        "base_loads_per_job": figures["base_loads_per_100"] / 100.0,
        "adapter_loads_per_job": figures["adapter_loads_per_100"] / 100.0,
        "resume_loads_per_job": figures.get("resume_loads_per_100", 0.0) / 100.0,
        "loading_share_of_capacity": figures["load_share_of_capacity"],
        "compute_load": compute_load,
        "effective_load": compute_load / max(1.0 - figures["load_share_of_busy"], 1e-9),
        "utilisation": figures.get("utilisation"),
        "preemptions": figures.get("preemptions"),
        "warm_start_share": figures.get("warm_start_share"),
        "shed": sum(g.get("outcomes", {}).get("shed", 0) for n, g in groups.items()
                    if n != "all"),
        "expired": sum(g.get("outcomes", {}).get("expired", 0) for n, g in groups.items()
                       if n != "all"),
    }


def compare_windows(rows: Sequence[dict[str, Any]], mine: str = "stepline") -> dict[str, Any]:
    """Over the windows of one pool size: ``mine`` against each other placement (paired
    points, 95 % t-interval over the windows), its attainment over the free-load run's, and
    its base loads per job over route-to-warm's, window by window and overall."""
    if not rows or mine not in rows[0]["policies"]:
        return {}
    def attained(row: dict[str, Any], p: str) -> float:
        return float(row["policies"][p]["groups"]["all"]["attainment"] or 0.0)

    out: dict[str, Any] = {"windows": len(rows)}
    for other in rows[0]["policies"]:
        if other == mine:
            continue
        out[f"{mine}_minus_{other}"] = paired_points([attained(r, mine) for r in rows],
                                                     [attained(r, other) for r in rows])
    if "oracle" in rows[0]["policies"]:
        ratios = [attained(r, mine) / a if (a := attained(r, "oracle")) else None for r in rows]
        out[f"{mine}_over_free_loads"] = ratios
    if "warm" in rows[0]["policies"]:
        def loads(p: str) -> float:
            return sum(r["policies"][p]["base_loads_per_job"] for r in rows)

        out[f"{mine}_base_loads_over_warm"] = loads(mine) / loads("warm") if loads("warm") \
            else None
        below = [r for r in rows if attained(r, "warm") < 0.9]
        out["windows_warm_below_90"] = len(below)
        out["windows_won_by_5_points"] = sum(
            1 for r in below if attained(r, mine) - attained(r, "warm") >= 0.05)
    return out


def run_trace_bench(trace_dir: Path, *, windows: int = 4, jobs: int = 240,
                    workers: Sequence[int] = (2, 3, 4, 8, 32), load: float = 0.8,
                    jobs_per_worker: int = 30, device_models: float = 3.0,
                    host_models: float = 0.0, tick_s: float = 1.0,
                    placements: Sequence[str] = PLACEMENTS, held_out: bool = False,
                    interactive_share: float = 0.5, slo_x: float = 3.0, seed: int = 1,
                    scale_scheduler: bool = True, live: bool = False, live_workers: int = 2,
                    live_windows: int = 1,
                    live_time_scale: float = 0.05, live_byte_scale: float = 1e-3,
                    live_steps: int = 10, live_placements: Sequence[str] = (
                        "stepline", "warm", "oblivious"),
                    run_dir: Path | None = None, progress: Any = None) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); ``progress(text)`` is told each row."""
    started = time.perf_counter()
    requests = read_requests(trace_dir)
    samples = read_latencies(trace_dir)
    say = progress or (lambda _text: None)
    sim: list[dict[str, Any]] = []
    for pool in workers:
        count = max(jobs, jobs_per_worker * pool)
        rows = []
        for start in window_starts(requests, windows, count, held_out=held_out):
            window = TraceWindow(start=start, jobs=count, workers=pool, load=load,
                                 interactive_share=interactive_share, slo_x=slo_x, seed=seed,
                                 held_out=held_out)
            row = sim_row(requests, samples, window, placements, device_models, host_models,
                          tick_s, scale_scheduler)
            rows.append(row)
            say(row_line("SIMULATED", row))
        sim.append({"workers": pool, "jobs": count, "rows": rows,
                    "comparison": compare_windows(rows)})
    out: dict[str, Any] = {
        "note": NOTE, "citation": CITATION, "held_out": held_out,
        "latencies": samples.summary(),
        "settings": {"windows": windows, "jobs": jobs, "jobs_per_worker": jobs_per_worker,
                     "load": load, "device_models": device_models, "host_models": host_models,
                     "tick_s": tick_s, "interactive_share": interactive_share,
                     "slo_x": slo_x, "seed": seed, "placements": list(placements),
                     "scale_scheduler": scale_scheduler},
        "simulated": sim}
    if live:
        out["live"] = live_rows(requests, samples, windows=max(windows, live_windows),
                                take=live_windows, jobs=jobs,
                                workers=live_workers, load=load, device_models=device_models,
                                host_models=host_models, time_scale=live_time_scale,
                                byte_scale=live_byte_scale, steps=live_steps,
                                placements=live_placements, held_out=held_out,
                                interactive_share=interactive_share, slo_x=slo_x, seed=seed,
                                scale_scheduler=scale_scheduler, run_dir=run_dir, say=say)
    out["wall_s"] = time.perf_counter() - started
    return out


def live_rows(requests: Sequence[TraceRequest], samples: LatencySamples, *, windows: int,
              jobs: int, take: int | None = None, workers: int, load: float,
              device_models: float, host_models: float,
              time_scale: float, byte_scale: float, steps: int, placements: Sequence[str],
              held_out: bool, interactive_share: float, slo_x: float, seed: int,
              scale_scheduler: bool, run_dir: Path | None, say: Any) -> list[dict[str, Any]]:
    """The first ``take`` (None: all) of the ``windows`` windows of :func:`window_starts` (the
    simulated rows' windows of the same size) live and simulated on the same jobs, budgets and
    knobs (``app.bench.models_live``), with each side's figures and their gaps."""
    rows: list[dict[str, Any]] = []
    for start in window_starts(requests, windows, jobs, held_out=held_out)[:take]:
        window = TraceWindow(start=start, jobs=jobs, workers=workers, load=load,
                             time_scale=time_scale, byte_scale=byte_scale, steps=steps,
                             interactive_share=interactive_share, slo_x=slo_x, seed=seed,
                             held_out=held_out)
        catalog, trace_jobs = window_jobs(requests, samples, window)
        setup = LiveSetup(ModelsWorkload(jobs=jobs, workers=workers, load=load, seed=seed,
                                         time_scale=time_scale, byte_scale=byte_scale,
                                         steps=steps),
                          device_models=device_models, host_models=host_models,
                          park_max_wait_s=2.0,
                          scheduler=scheduler_scale(trace_jobs) if scale_scheduler else {})
        per: dict[str, Any] = {}
        for placement in placements:
            live_figures = run_live(setup, placement, trace_jobs, catalog, run_dir)
            sim_figures = run_sim(setup, placement, trace_jobs, catalog)
            hop = live_figures["chunk_overhead_s"]["median"]
            calibrated = run_sim(replace(setup, hop_s=hop), placement, trace_jobs, catalog) \
                if hop is not None else None
            per[placement] = {"live": _side(live_figures), "sim": _side(sim_figures),
                              "sim_measured_hop": _side(calibrated) if calibrated else None,
                              "gaps": _gaps(live_figures, calibrated or sim_figures)}
            say(f"LIVE {start:%Y-%m-%d %H:%M} {workers} workers {placement}: "
                f"live {_att(live_figures):.1%} sim {_att(sim_figures):.1%} base loads/job "
                f"live {live_figures['base_loads_per_100'] / 100:.2f} "
                f"sim {sim_figures['base_loads_per_100'] / 100:.2f}")
        rows.append({"window": window_summary(requests, window, trace_jobs),
                     "scheduler": dict(setup.scheduler),
                     "workers": workers, "load": load, "policies": per})
    return rows


def _att(figures: dict[str, Any]) -> float:
    return float(figures["groups"]["all"]["attainment"] or 0.0)


def _side(figures: dict[str, Any]) -> dict[str, Any]:
    """One side of a live-vs-sim row, without the per-job latencies."""
    return {k: v for k, v in figures.items() if k not in ("latency_s", "missed")} | {
        "groups": {n: {k: v for k, v in g.items()} for n, g in figures["groups"].items()}}


def _gaps(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Live less simulated: attainment in points, base loads per job as a ratio."""
    base_live, base_sim = live["base_loads_per_100"], sim["base_loads_per_100"]
    return {"attainment_points": 100.0 * (_att(live) - _att(sim)),
            "base_loads_ratio": base_live / base_sim if base_sim else None}


def row_line(side: str, row: dict[str, Any]) -> str:
    """One printed line per window: each placement's attainment and base loads per job."""
    w = row["window"]
    parts = [f"{p} {f['groups']['all']['attainment']:.1%} ({f['base_loads_per_job']:.2f} "
             f"loads/job, eff. load {f['effective_load'] or 0:.2f})"
             for p, f in row["policies"].items()]
    return (f"{side} {row['workers']} workers, window from {w['first_request']} "
            f"({w['jobs']} jobs, {w['base_models']} models): " + "; ".join(parts))

