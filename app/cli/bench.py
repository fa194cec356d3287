"""The benchmarks: bench (live workers, or the trace, overload, fairness and degradation
modes) and simulate (the planner on a virtual clock); registered by ``app.cli``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from app.cli.common import RunDir, _setup, console


def bench(
    policy: Annotated[str, typer.Option(help="Comma-separated: fifo, priority, stepline.")] = (
        "fifo,priority,stepline"
    ),
    workload: Annotated[str, typer.Option(help="A name in configs/workloads or a file.")] = "mixed",
    load: Annotated[Optional[float], typer.Option(min=0.05, max=2.0, help="Target load ρ.")] = None,
    workers: Annotated[int, typer.Option(min=1, max=64)] = 2,
    duration_s: Annotated[Optional[float], typer.Option(min=1, help="Trace length.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Replay this JSONL trace.")] = None,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    gentd26: Annotated[Optional[Path], typer.Option(
        help="Trace mode: a directory with the GenTD26 request and latency files; its windows "
             "run in the simulator and on the live stack; writes gentd26.json.")] = None,
    windows: Annotated[int, typer.Option(min=1, max=50, help="Trace mode: windows per pool.")] = 4,
    window_jobs: Annotated[int, typer.Option(min=20, max=20000,
                                             help="Trace mode: requests per window.")] = 240,
    sim_workers: Annotated[str, typer.Option(
        help="Trace mode: comma-separated simulated pool sizes.")] = "2,3,4,8,32",
    jobs_per_worker: Annotated[int, typer.Option(
        min=1, help="Trace mode: a larger pool's windows hold at least this many per worker.")
    ] = 30,
    scale_scheduler: Annotated[bool, typer.Option(
        help="Trace mode: the scheduler's quanta and aging bound scaled to the window's median "
             "job (else the defaults, set for second-long jobs).")] = True,
    live: Annotated[Optional[bool], typer.Option(
        help="Trace mode: also run the live stack (default on). Fairness mode: also run the "
             "same traces, scaled, on live stacks beside the simulator; writes "
             "fairness_live.json (default off, a few minutes).")] = None,
    live_windows: Annotated[int, typer.Option(min=1, max=20)] = 1,
    held_out: Annotated[bool, typer.Option(
        help="Trace mode: evaluate on the held-out requests (from 2024-12-01).")] = False,
    overload: Annotated[bool, typer.Option(
        help="Overload mode (simulated, 8 workers, 600 jobs a trace): sweep effective loads "
             "0.8, 1.0, 1.3 with model loads counted against compute-only admission; writes "
             "overload.json.")] = False,
    seeds: Annotated[int, typer.Option(min=1, max=50, help="Overload mode: traces per point.")
    ] = 3,
    fairness: Annotated[bool, typer.Option(
        help="Fairness mode (simulated): --tenants of one tier, one flooding at 10x; writes "
             "fairness.json.")] = False,
    tenants: Annotated[int, typer.Option(min=2, max=8, help="Fairness mode: tenants.")] = 4,
    degradation: Annotated[bool, typer.Option(
        help="Degradation mode (simulated, 8 workers, 600 jobs a trace): sweep effective loads "
             "0.8-1.6 with and without quality floors; writes degradation.json.")] = False,
    families: Annotated[bool, typer.Option(
        help="Families mode (CPU, tiny configs): every image and video recipe's own diffusers "
             "pipeline against Stepline's chunked runner, First Block Cache's block evaluations "
             "and each family's code lines; writes families.json.")] = False,
    family_steps: Annotated[int, typer.Option(min=1, max=200,
                                              help="Families mode: steps of a timed job.")] = 8,
    repetitions: Annotated[int, typer.Option(min=1, max=100,
                                             help="Families mode: timed repetitions.")] = 9,
    cache_steps: Annotated[int, typer.Option(
        min=2, max=500, help="Families mode: steps of a step-cache job.")] = 28,
    models: Annotated[Optional[str], typer.Option(
        help="Families mode: comma-separated recipes (default: every image and video one).")
    ] = None,
    run_dir: RunDir = None,
) -> None:
    """Replay one trace under each policy on the same real workers; write report.json + plots.
    With --gentd26: the production-trace benchmark (simulated and live), gentd26.json. With
    --overload: the effective-load sweep in the simulator, overload.json; --degradation: the
    same with and without degradation, degradation.json."""
    if families:
        _family_bench(out, steps=family_steps, repetitions=repetitions, cache_steps=cache_steps,
                      models=None if models is None else
                      [m.strip() for m in models.split(",") if m.strip()])
        return
    if overload or degradation:
        _overload_bench(out, seeds=seeds, degradation=degradation)
        return
    if fairness:
        from app.bench.fairness_cli import fairness_bench  # deferred: the bench

        fairness_bench(out, tenants=tenants, seeds=seeds, print_=console().print,
                       live=bool(live))
        return
    from app.bench.run import check_policies as check_bench_policies  # deferred: heavy
    from app.bench.run import run_bench, summary_table  # deferred: heavy

    _setup(run_dir or Path(".stepline-bench"), None)
    if gentd26 is not None:
        _trace_bench(gentd26, out, windows=windows, jobs=window_jobs, sim_workers=sim_workers,
                     jobs_per_worker=jobs_per_worker, scale_scheduler=scale_scheduler,
                     load=0.8 if load is None else load, live=live is not False,
                     live_workers=workers,
                     live_windows=live_windows, held_out=held_out)
        return

    policies = [p.strip() for p in policy.split(",") if p.strip()]
    try:
        check_bench_policies(policies)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_bench(policies=policies, workload_name=workload, load=load, workers=workers,
                       out_dir=out, duration_s=duration_s, trace_file=trace,
                       run_dir=Path(os.environ["STEPLINE_RUN_DIR"]))
    console().print(summary_table(report))
    console().print(f"report: {out / 'report.json'}; plots: {', '.join(report['plots'])}")


def _overload_bench(out: Path, *, seeds: int, degradation: bool = False) -> None:
    """``stepline bench --overload`` (app.bench.overload_bench) or ``--degradation``
    (app.bench.degradation_bench), printed and written."""
    import json  # deferred with the bench

    from app.bench.degradation_bench import run_degradation_bench  # deferred: the bench
    from app.bench.overload_bench import run_overload_bench  # deferred: the bench

    run = run_degradation_bench if degradation else run_overload_bench
    report = run(seeds=seeds, progress=console().print)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("degradation.json" if degradation else "overload.json")
    path.write_text(json.dumps(report, indent=1))
    console().print(f"report: {path} ({report['wall_s']:.0f} s)")


def _family_bench(out: Path, *, steps: int, repetitions: int, cache_steps: int,
                  models: list[str] | None) -> None:
    """``stepline bench --families`` (app.bench.family_bench), printed and written."""
    import json  # deferred with the bench

    from app.bench.family_bench import (  # deferred: the bench
        family_table,
        quiet_libraries,
        run_family_bench,
    )
    from app.bench.family_lines import family_lines, lines_table  # deferred: the bench

    quiet_libraries()
    try:
        report = run_family_bench(steps=steps, repetitions=repetitions, cache_steps=cache_steps,
                                  models=models, progress=console().print)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--models") from exc
    report["code_lines"] = family_lines()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "families.json"
    path.write_text(json.dumps(report, indent=1))
    console().print(family_table(report), soft_wrap=True)
    console().print(lines_table(report["code_lines"]))
    console().print(f"report: {path} ({report['wall_s']:.0f} s)")


def _trace_bench(trace_dir: Path, out: Path, *, windows: int, jobs: int, sim_workers: str,
                 jobs_per_worker: int, scale_scheduler: bool, load: float, live: bool,
                 live_workers: int, live_windows: int, held_out: bool) -> None:
    """``stepline bench --gentd26 DIR``: app.bench.trace_bench, printed and written."""
    import json  # deferred with the bench

    from app.bench.gentd26 import TraceError  # deferred: the bench
    from app.bench.trace_bench import run_trace_bench  # deferred: the bench

    try:
        pools = [int(x) for x in sim_workers.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{sim_workers!r} is not a comma-separated list of pool "
                                 "sizes", param_hint="--sim-workers") from None
    if not pools or min(pools) < 1:
        raise typer.BadParameter("give at least one pool size of 1 or more",
                                 param_hint="--sim-workers")
    try:
        report = run_trace_bench(trace_dir, windows=windows, jobs=jobs, workers=pools,
                                 jobs_per_worker=jobs_per_worker, load=load,
                                 held_out=held_out, scale_scheduler=scale_scheduler, live=live,
                                 live_workers=live_workers, live_windows=live_windows,
                                 run_dir=Path(os.environ["STEPLINE_RUN_DIR"]),
                                 progress=console().print)
    except TraceError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gentd26") from exc
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gentd26.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    console().print(f"report: {path} ({report['wall_s']:.0f} s); figures from {report['citation']}")


def simulate(
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts.")] = "16,64,256",
    rate: Annotated[str, typer.Option(help="Comma-separated arrival rates, jobs/s.")] = (
        "10,100,1000"),
    duration_s: Annotated[float, typer.Option(min=1, help="Virtual seconds of arrivals.")] = 60,
    policies: Annotated[str, typer.Option(help="Comma-separated: fifo, priority, edf, srpt, "
                                          "least_slack, stepline, oracle-edf, oracle-srpt.")] = (
        "fifo,priority,stepline,oracle-edf,oracle-srpt"),
    stress: Annotated[bool, typer.Option(help="Inject urgent (< 100 ms SLO) jobs and fail a "
                                         "worker mid-run.")] = False,
    overhead_ms: Annotated[float, typer.Option(min=0, help="Dispatch overhead per hop.")] = 3.0,
    seed: Annotated[int, typer.Option()] = 1,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    suite: Annotated[bool, typer.Option(help="Run the policy evaluation suite instead (its own "
                                        "rows and every policy; uses --overhead-ms, --seed, "
                                        "--out); writes suite.json.")] = False,
) -> None:
    """SIMULATED: the live tick's planner on a virtual clock at scale; writes simulation.json (with
    --suite: every policy on the evaluation suite's rows, with a verdict each; suite.json)."""
    import json

    from app.bench.sim_report import check_policies, grid_configs, run_simulation  # deferred: heavy
    from app.bench.sim_report import summary_table as simulation_table  # deferred: heavy

    if suite:
        _simulate_suite(overhead_ms / 1e3, seed, out)
        return
    names = [p.strip() for p in policies.split(",") if p.strip()]
    try:
        check_policies(names)
        configs = grid_configs([int(w) for w in workers.split(",")],
                               [float(r) for r in rate.split(",")], duration_s, stress, seed,
                               dispatch_overhead_s=overhead_ms / 1e3)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_simulation(configs, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(report, indent=2))
    for run in report["runs"]:
        console().print(simulation_table(run))
    console().print(f"report: {out / 'simulation.json'} (simulated)")


def _simulate_suite(dispatch_overhead_s: float, seed: int, out: Path) -> None:
    """Every row of the suite, one at a time with progress, then suite.json and one table."""
    import json
    from dataclasses import replace

    from app.bench.suite import SUITE_ROWS, run_row, suite_report, suite_table  # deferred: heavy

    started = time.perf_counter()
    outcomes = []
    for k, row in enumerate(SUITE_ROWS, start=1):
        outcome = run_row(replace(row, seed=seed), dispatch_overhead_s=dispatch_overhead_s)
        outcomes.append(outcome)
        verdict = "pass" if outcome.passed else "FAIL"
        console().print(f"[{k}/{len(SUITE_ROWS)}] {row.name}: {outcome.jobs} jobs, stepline "
                      f"{verdict} ({time.perf_counter() - started:.0f}s)")
    report = suite_report(outcomes, wall_s=time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(report, indent=2))
    console().print(suite_table(outcomes))
    console().print(f"stepline met every goal on {report['rows_passed']} of "
                  f"{report['rows_judged']} rows; report: {out / 'suite.json'} (simulated)")
