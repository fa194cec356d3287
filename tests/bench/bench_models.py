"""Benchmark: many models on one pool (issue 27), in the simulator (a script, not a test).

A production-shaped workload (``app.bench.models_workload``: 40 base models with Zipf
popularity, 17 % of jobs with LoRA adapters, trace-shaped execution and load times, from the
GenTD26 trace's figures in ``../shared/reference/production-diffusion.md``) runs on simulated
pools of 8 to 256 workers, each with a device budget of a few models and a host-memory tier,
under four placements in the same run on the same seeded trace (``app.bench.models_sim``):
model-oblivious + LRU, route-to-warm + LRU (Ray Serve's multiplexing), Stepline (placement that
knows a cold start, cost-aware eviction, staging) and an oracle where every load is free.

Per row and policy: SLO attainment per class with its 95 % Wilson interval, p95 latency, base
and adapter loads per 100 jobs, the share of worker time spent loading, the share of jobs that
started on a worker holding their base; then, per pool size searched, the highest offered load
each policy holds at 99 % attainment. Every figure is SIMULATED. The issue's goals are checked
per row and printed with the table; the JSON has everything.

    python tests/bench/bench_models.py --out bench-out/models.json
    python tests/bench/bench_models.py --workers 8 --loads 0.8 --jobs 600 --search-workers ""
    python tests/bench/bench_models.py --live --live-host-models 4 --live-policies stepline,warm
    python tests/bench/bench_models.py --live-sim-seeds 10 --live-jobs 800 --live-host-models 4 \
        --live-policies stepline,warm,oblivious   # the live scale, simulated, paired over traces
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.models_sim import (
    NOTE,
    PLACEMENTS,
    max_load_at,
    paired_points,
    pool_figures,
    run_placement,
)
from app.bench.models_workload import (
    ModelsWorkload,
    first_use_loads,
    generate_jobs,
    model_catalog,
    top_share,
)
from app.bench.sim_workload import DEFAULT_HOP_S

if TYPE_CHECKING:  # the live module loads the stack (Celery, the API): only for the live runs
    from app.bench.models_live import LiveSetup

GOALS = (
    "attainment >= every baseline (oblivious, warm) on every row, and >= 0.9 x the oracle",
    "base loads per job <= 0.5 x route-to-warm LRU's",
    "at 8+ workers: >= 90 % of jobs start on a worker holding their base, <= 0.10 base loads "
    "and <= 0.05 adapter loads per job, loading <= 5 % of worker busy time",
    "highest load held at 99 % within SLO >= 1.5 x the model-oblivious placement's",
)


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="8,32,256")
    parser.add_argument("--loads", default="0.5,0.8,1.0,1.2")
    parser.add_argument("--jobs", type=int, default=1500,
                        help="jobs per row (larger pools: see --jobs-per-worker)")
    parser.add_argument("--jobs-per-worker", type=float, default=12.0,
                        help="rows of larger pools get at least this many jobs per worker")
    parser.add_argument("--warmup", type=float, default=0.2,
                        help="share of the first jobs run but not measured (empty memories)")
    parser.add_argument("--models", type=int, default=40)
    parser.add_argument("--device-models", type=float, default=3.0,
                        help="device budget in models of the median size (at least the largest)")
    parser.add_argument("--host-models", type=float, default=8.0)
    parser.add_argument("--tick-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3,
                        help="traces per row (seed, seed + 1, ...): each row's figures pooled "
                             "over them, and Stepline's paired difference from each baseline "
                             "with a 95 %% t-interval over the traces")
    parser.add_argument("--policies", default=",".join(PLACEMENTS))
    parser.add_argument("--search-workers", default="8",
                        help="pool sizes whose highest load at 99 %% is searched ('' for none)")
    parser.add_argument("--search-jobs", type=int, default=800)
    parser.add_argument("--search-steps", type=int, default=5)
    parser.add_argument("--search-seeds", type=int, default=3,
                        help="traces pooled per probe of the search (seed, seed + 1, ...)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/models.json"))
    live = parser.add_argument_group(
        "live", "--live: the workload scaled down on a live stack of simulated-device workers "
        "and the same jobs in the simulator on the same terms (app.bench.models_live); "
        "writes <out>_live.json")
    live.add_argument("--live", action="store_true")
    live.add_argument("--live-workers", type=int, default=3)
    live.add_argument("--live-jobs", type=int, default=160)
    live.add_argument("--live-load", type=float, default=0.5)
    live.add_argument("--live-time-scale", type=float, default=0.05,
                      help="jobs of ~0.5-3 s, loads of ~0.1-1 s")
    live.add_argument("--live-byte-scale", type=float, default=1e-3,
                      help="models of 1-20 MB (real tensors on the workers)")
    live.add_argument("--live-steps", type=int, default=10)
    live.add_argument("--live-host-models", type=float, default=0.0)
    live.add_argument("--live-park-s", type=float, default=2.0,
                      help="affinity.max_wait of the live stack, simulated alike")
    live.add_argument("--live-warmup", type=float, default=0.1)
    live.add_argument("--live-policies", default="stepline,oblivious")
    live.add_argument("--live-sim-seeds", type=int, default=0,
                      help="instead of a live run: the live setup's jobs through the simulator "
                      "on this many traces per --live-workers-list pool and --live-loads load, "
                      "the first of --live-policies paired against the others")
    live.add_argument("--live-workers-list", default="2,3,4")
    live.add_argument("--live-loads", default="0.5,0.8")
    args = parser.parse_args()
    if args.live_sim_seeds:
        run_live_sim_seeds(args)
        return
    if args.live:
        run_live(args)
        return
    policies = _csv(args.policies, str)
    run_kw = {"device_models": args.device_models, "host_models": args.host_models,
              "tick_s": args.tick_s, "warmup": args.warmup}
    started = time.perf_counter()
    shape = _workload_shape(args)
    rows: list[dict[str, Any]] = []
    for workers in _csv(args.workers, int):
        jobs = max(args.jobs, int(args.jobs_per_worker * workers))
        for load in _csv(args.loads, float):
            row = run_row(args, workers, load, jobs, policies, run_kw)
            rows.append(row)
            _print_row(row)
    searches: list[dict[str, Any]] = []
    for workers in _csv(args.search_workers, int):
        workload = ModelsWorkload(models=args.models, jobs=args.search_jobs, workers=workers,
                                  seed=args.seed)
        found = {p: max_load_at(workload, p, 0.99, steps=args.search_steps,
                                  seeds=args.search_seeds, **run_kw)
                 for p in policies if p in ("oblivious", "warm", "stepline", "oracle")}
        entry: dict[str, Any] = {"workers": workers, "jobs": args.search_jobs,
                                 "seeds": args.search_seeds,
                                 "target": 0.99, "max_load": found}
        base = found.get("oblivious", {}).get("max_load")
        mine = found.get("stepline", {}).get("max_load")
        entry["stepline_over_oblivious"] = mine / base if base and mine is not None else None
        entry["goal_1_5x"] = None if entry["stepline_over_oblivious"] is None else \
            entry["stepline_over_oblivious"] >= 1.5
        searches.append(entry)
        print(f"SIMULATED {workers} workers: highest offered load at 99 % within SLO: "
              + ", ".join(f"{p} {f['max_load']:.2f}" for p, f in found.items())
              + (f"; stepline / oblivious {entry['stepline_over_oblivious']:.2f}"
                 if entry["stepline_over_oblivious"] is not None else ""))
    out = {"simulated": True, "note": NOTE, "goals": GOALS, "workload": shape,
           "settings": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(args).items()},
           "rows": rows, "max_load_searches": searches,
           "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    _print_goal_summary(rows, searches)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")


def run_row(args: argparse.Namespace, workers: int, load: float, jobs: int,
            policies: list[str], run_kw: dict[str, Any]) -> dict[str, Any]:
    """One row: every policy on the same ``args.seeds`` traces (each policy's figures pooled
    over them), the loads no placement avoids (:func:`first_use_loads`, averaged over the
    traces), Stepline's paired difference from each other policy, and the issue's goals on the
    pooled figures."""
    per_trace: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    floors: list[dict[str, float]] = []
    rate = 0.0
    for k in range(args.seeds):
        workload = ModelsWorkload(models=args.models, jobs=jobs, workers=workers, load=load,
                                  seed=args.seed + k)
        rate = workload.rate_per_s()
        catalog = model_catalog(workload)
        trace = generate_jobs(workload, catalog)
        floors.append(first_use_loads(trace, int(args.warmup * len(trace))))
        for p in policies:
            per_trace[p].append(run_placement(workload, p, jobs=trace, catalog=catalog, **run_kw))
    row: dict[str, Any] = {
        "workers": workers, "load": load, "jobs": jobs, "seeds": args.seeds, "rate_per_s": rate,
        "policies": {p: pool_figures(figs) for p, figs in per_trace.items()},
        "first_use_loads_per_100": {key: sum(f[key] for f in floors) / len(floors)
                                    for key in ("base_per_100", "adapter_per_100")}}
    if "stepline" in per_trace:
        mine = row["policies"]["stepline"]["trace_attainment"]
        row["stepline_minus"] = {p: paired_points(mine, f["trace_attainment"])
                                 for p, f in row["policies"].items() if p != "stepline"}
    row["goals"] = row_goals(row["policies"], workers)
    return row


def _workload_shape(args: argparse.Namespace) -> dict[str, Any]:
    workload = ModelsWorkload(models=args.models, jobs=5000, seed=args.seed)
    jobs = generate_jobs(workload)
    execs = sorted(j.exec_s for j in jobs)
    return {"models": args.models, "top1_share": top_share(jobs, 1),
            "top10_share": top_share(jobs, 10),
            "adapter_share": sum(1 for j in jobs if j.adapters) / len(jobs),
            "exec_p50_s": execs[len(execs) // 2], "exec_p90_s": execs[int(0.9 * len(execs))],
            "mean_exec_s": workload.mean_exec_s(),
            "interactive_share": workload.interactive_share,
            "interactive_slo_x": workload.interactive_slo_x,
            "batch_slo_x": workload.batch_slo_x,
            "source": "GenTD26 (Lin et al., SoCC '25): ../shared/reference/production-diffusion.md"}


def row_goals(figures: dict[str, dict[str, Any]], workers: int) -> dict[str, Any]:
    """The issue's per-row goals for Stepline (None where a compared policy did not run)."""
    mine = figures.get("stepline")
    if mine is None:
        return {}
    att = {p: f["groups"]["all"]["attainment"] for p, f in figures.items()}
    goals: dict[str, Any] = {}
    baselines: list[str] = [p for p in ("oblivious", "warm") if p in att]
    goals["attainment_ge_baselines"] = all(att["stepline"] >= att[p] - 1e-12 for p in baselines)
    goals["attainment_ci_overlaps_best_baseline"] = _overlaps(figures, baselines)
    if att.get("oracle"):
        goals["attainment_ge_0_9_oracle"] = att["stepline"] >= 0.9 * att["oracle"]
    if "warm" in figures:
        warm_loads = figures["warm"]["base_loads_per_100"]
        goals["base_loads_le_half_warm"] = mine["base_loads_per_100"] <= 0.5 * warm_loads
    if workers >= 8:
        goals["warm_starts_ge_90pct"] = (mine["warm_start_share"] or 0.0) >= 0.90
        goals["base_loads_le_0_10_per_job"] = mine["base_loads_per_100"] <= 10.0
        goals["adapter_loads_le_0_05_per_job"] = mine["adapter_loads_per_100"] <= 5.0
        goals["loading_le_5pct_of_busy"] = mine["load_share_of_busy"] <= 0.05
    return goals


def _overlaps(figures: dict[str, dict[str, Any]], baselines: list[str]) -> bool | None:
    """Whether Stepline's attainment interval overlaps the best baseline's (a tie at 95 %)."""
    if not baselines:
        return None
    best = max(baselines, key=lambda p: figures[p]["groups"]["all"]["attainment"])
    lo, hi = figures["stepline"]["groups"]["all"]["ci95"]
    blo, bhi = figures[best]["groups"]["all"]["ci95"]
    return bool(lo <= bhi and blo <= hi)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}"


def _print_row(row: dict[str, Any]) -> None:
    traces = f", {row['seeds']} traces pooled" if row["seeds"] > 1 else ""
    print(f"\nSIMULATED {row['workers']} workers, offered load {row['load']:.2f} "
          f"({row['jobs']} jobs{traces}, {row['rate_per_s']:.3f} jobs/s)")
    print(f"{'policy':<10} {'interactive % [95% CI]':<24} {'batch % [95% CI]':<24} "
          f"{'all %':>6} {'p95 s':>7} {'base/100':>8} {'adap/100':>8} {'load%cap':>8} "
          f"{'load%busy':>9} {'warm%':>6}")
    for name, f in row["policies"].items():
        g = f["groups"]
        cells = []
        for cls in ("interactive", "batch"):
            c = g[cls]
            ci = c["ci95"] or [None, None]
            cells.append(f"{_pct(c['attainment'])} [{_pct(ci[0])},{_pct(ci[1])}]")
        p95 = g["all"]["p95_latency_s"]
        print(f"{name:<10} {cells[0]:<24} {cells[1]:<24} {_pct(g['all']['attainment']):>6} "
              f"{'-' if p95 is None else f'{p95:.0f}':>7} {f['base_loads_per_100']:8.1f} "
              f"{f['adapter_loads_per_100']:8.1f} {_pct(f['load_share_of_capacity']):>8} "
              f"{_pct(f['load_share_of_busy']):>9} {_pct(f['warm_start_share']):>6}")
    floor = row["first_use_loads_per_100"]
    print(f"first-use loads per 100 jobs (no placement avoids them): base "
          f"{floor['base_per_100']:.1f}, adapter {floor['adapter_per_100']:.1f}")
    if row["seeds"] > 1:
        print(f"over {row['seeds']} traces, each policy's attainment: " + "; ".join(
            f"{p} " + " ".join(_pct(a).strip() for a in f["trace_attainment"])
            for p, f in row["policies"].items()))
        for other, d in row.get("stepline_minus", {}).items():
            print(f"  stepline - {other}: {d['mean_points']:+.1f} points [{d['ci95'][0]:+.1f}, "
                  f"{d['ci95'][1]:+.1f}], ahead on {d['ahead']}/{d['traces']} traces")
    if row["goals"]:
        print("goals: " + ", ".join(f"{k}={v}" for k, v in row["goals"].items()))


def _print_goal_summary(rows: list[dict[str, Any]], searches: list[dict[str, Any]]) -> None:
    print("\nGoals over all rows (SIMULATED):")
    keys = sorted({k for r in rows for k in r["goals"]})
    for key in keys:
        held = [r for r in rows if r["goals"].get(key)]
        missed = [f"{r['workers']}w@{r['load']:g}" for r in rows
                  if key in r["goals"] and not r["goals"][key]]
        print(f"  {key}: held on {len(held)}/{sum(1 for r in rows if key in r['goals'])} rows"
              + (f"; missed on {', '.join(missed)}" if missed else ""))
    for s in searches:
        print(f"  max load at 99 % ({s['workers']} workers): stepline / oblivious = "
              f"{s['stepline_over_oblivious']}, goal >= 1.5: {s['goal_1_5x']}")


def run_live(args: argparse.Namespace) -> None:
    """``--live``: the workload scaled down (jobs of ~0.5-3 s, loads of ~0.1-1 s) on a live
    stack of simulated-device workers, and the same jobs through the simulator on the same
    terms (``app.bench.models_live``); prints both sides' attainment and their difference."""
    from app.bench.models_live import compare

    setup = _live_setup(args, args.live_workers, args.live_load)
    started = time.perf_counter()
    result = compare(setup, _csv(args.live_policies, str))
    for placement, row in result["rows"].items():
        for side in ("live", "sim", "sim_measured_hop"):
            if side not in row:
                continue
            f = row[side]
            g = f["groups"]
            label = "SIM+" if side == "sim_measured_hop" else side.upper()
            print(f"{label:4} {placement:9} " + "  ".join(
                f"{name} {g[name]['met']}/{g[name]['jobs']} {_pct(g[name]['attainment'])} %"
                f" [{_pct(g[name]['ci95'][0])}, {_pct(g[name]['ci95'][1])}]"
                for name in ("all", "interactive", "batch") if g[name]["jobs"])
                + f"  p95 {g['all']['p95_latency_s']:.2f} s"
                f"  base loads/100 {f['base_loads_per_100']:.1f}"
                f" (from host {f['host_loads_per_100']:.1f}, staged {f['staged_per_100']:.1f})"
                f"  adapter loads/100 {f['adapter_loads_per_100']:.1f}"
                f"  loading {_pct(f['load_share_of_capacity'])} % of capacity")
        print(f"     {placement:9} live - sim attainment: {row['attainment_gap_points']:+.1f} "
              f"points (goal: within 5)")
        hop = row["live"]["chunk_overhead_s"]
        if "attainment_gap_points_measured_hop" in row:
            print(f"     {placement:9} live - sim with the per-chunk overhead measured live "
                  f"({1000 * hop['median']:.1f} ms, {hop['chunks']} chunks; the simulator's "
                  f"default {1000 * DEFAULT_HOP_S:.0f} ms): "
                  f"{row['attainment_gap_points_measured_hop']:+.1f} points")
    out = {"live_vs_sim": result, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                               for k, v in vars(args).items()},
           "wall_s": time.perf_counter() - started}
    path = args.out.with_name(args.out.stem + "_live.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


def _live_setup(args: argparse.Namespace, workers: int, load: float) -> LiveSetup:
    """The live setup of ``--live`` (the workload scaled down, its budgets and knobs) for a
    pool of ``workers`` at offered ``load``."""
    from app.bench.models_live import LiveSetup

    workload = ModelsWorkload(models=args.models, jobs=args.live_jobs, workers=workers,
                              load=load, seed=args.seed, time_scale=args.live_time_scale,
                              byte_scale=args.live_byte_scale, steps=args.live_steps)
    return LiveSetup(workload, device_models=args.device_models,
                     host_models=args.live_host_models, park_max_wait_s=args.live_park_s,
                     warmup=args.live_warmup)


def run_live_sim_seeds(args: argparse.Namespace) -> None:
    """``--live-sim-seeds N``: the live setup's workload (scaled as ``--live``) through the
    simulator on N traces per pool size and load; prints each placement's mean attainment and
    the first placement's paired difference from the others with its 95 % interval."""
    from app.bench.models_live import paired_seeds

    policies = _csv(args.live_policies, str)
    first, *others = policies
    started = time.perf_counter()
    results = []
    for workers in _csv(args.live_workers_list, int):
        for load in _csv(args.live_loads, float):
            setup = _live_setup(args, workers, load)
            found = paired_seeds(setup, args.live_sim_seeds, policies)
            results.append({"workers": workers, "load": load, **found})
            print(f"SIMULATED live setup, {workers} workers, load {load:g}, "
                  f"{args.live_sim_seeds} traces of {args.live_jobs} jobs: "
                  + ", ".join(f"{p} {m:.1f} %" for p, m in found["mean"].items()))
            for other in others:
                key = f"{first}_minus_{other}"
                d = found[key]
                print(f"    {key}: {d['mean_points']:+.1f} points "
                      f"[{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}], ahead on {d['ahead']}/"
                      f"{args.live_sim_seeds} traces")
    path = args.out.with_name(args.out.stem + "_live_sim_seeds.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": time.perf_counter() - started}, indent=1))
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
