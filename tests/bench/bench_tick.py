"""Tick benchmark: p50/p99 of ``plan_tick`` on 10 000 queued jobs and 64 workers.

Scenarios: ``steady`` (load under the convergence threshold), ``overload`` (the first tick
after load jumps: suspends and expiries), ``converged`` (overload with batch work already
suspended). The FIFO baseline plans the same snapshot in the same run, for a machine-free ratio.

Each scenario is timed twice: ``gc_paused`` as the scheduler worker runs a tick (the cyclic
collector disabled for the tick, as in ``tasks/tick.py``) and ``gc_enabled`` with the collector
left on, with the collections that landed inside ticks and their longest pause. The target is
p99 under 10 ms for 10 000 queued jobs on 64 workers; on a shared machine, read the ratio to
FIFO (same run, same load) beside the milliseconds.

The planner held across ticks (``scheduler.incremental.IncrementalPlanner``) is timed beside
``plan_tick`` from scratch on histories of ticks 0.1 s apart where ``--changes`` jobs get a new
view before each tick (a third of them finish and are replaced by arrivals, the rest make
progress): p50 and p99 with a 95 % confidence interval on each p50, the ratio from scratch ÷
held in the same run, the slope in ms per changed job, and whether every plan came out equal
(plans of both are compared at each tick timed from scratch). The first ``--jobs`` size also
gets the scenarios above; every size gets the held-planner histories.

    python tests/bench/bench_tick.py [--jobs 10000 [50000 ...]] [--workers 64] [--ticks 300]
                                     [--changes 0 10 100 1000] [--held-ticks 100]
                                     [--scratch-ticks 20] [--held-only] [--out bench-out/tick.json]

``--fair-share`` times instead the held planner with tenant fair share off and on
(``scheduler.fair_share``) on the steady snapshot (50 tenants, counters already served), both
planning each tick of the same history: p50s and the per-tick ratio on ÷ off with 95 %
intervals (the join rule included: it runs inside the plan).

    python tests/bench/bench_tick.py --fair-share --changes 0 100 --held-ticks 40
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scheduler import (
    ClusterSnapshot,
    JobKind,
    JobState,
    JobView,
    PolicyConfig,
    PolicyKind,
    PolicyState,
    ResourceProfile,
    SloClass,
    Tier,
    WorkerView,
    check_plan_invariants,
    plan_tick,
)
from scheduler.fairness import FairShareConfig, ServiceLedger
from scheduler.incremental import IncrementalPlanner

_CLASSES = ((SloClass.REALTIME, 0.1, 1.0), (SloClass.INTERACTIVE, 0.3, 5.0),
            (SloClass.BATCH, 0.6, 60.0))
_SHAPES = (("image-256", JobKind.IMAGE, 50), ("image-512", JobKind.IMAGE, 20),
           ("image-1024", JobKind.IMAGE, 28), ("video-480p", JobKind.VIDEO, 50),
           ("text", JobKind.TEXT, 64), ("simulated", JobKind.SIMULATED, 20))


def build_snapshot(n_jobs: int, n_workers: int, scenario: str, seed: int) -> ClusterSnapshot:
    rng = random.Random(seed)
    now_s = 1000.0
    workers = [WorkerView(f"w{k:03d}", True, f"r{k}", (), "cuda") for k in range(n_workers)]
    jobs = [_job(rng, k, now_s, scenario, running_on=workers[k].name if k < n_workers else None)
            for k in range(n_jobs)]
    policy = PolicyConfig()
    return ClusterSnapshot(tuple(jobs), tuple(workers), policy.new_cost_model(), PolicyState())


def _job(rng: random.Random, k: int, now_s: float, scenario: str,
         running_on: str | None) -> JobView:
    cls, target_s = _pick_class(rng)
    cost_key, kind, steps = rng.choice(_SHAPES[:3] if scenario == "steady" else _SHAPES)
    units = steps * (0.05 if scenario == "steady" else 1.0)
    done = rng.randrange(steps) if running_on else 0
    submitted = now_s - rng.uniform(0, 30)
    state = JobState.RUNNING if running_on else (
        JobState.PREEMPTED if rng.random() < 0.05 else JobState.PENDING)
    if scenario == "converged" and cls is SloClass.BATCH and not running_on:
        state = JobState.SUSPENDED
    return JobView(
        job_id=f"r{k}" if running_on else f"j{k}", tenant=f"t{k % 50}",
        tier=Tier.GOLD if rng.random() < 0.2 else Tier.STANDARD, slo_class=cls, kind=kind,
        state=state, submitted_at_s=submitted, deadline_s=submitted + target_s * 60,
        cost_key=cost_key, num_chunks=steps, next_chunk=done,
        remaining_cost_units=units * (steps - done) / steps,
        queue="batch" if running_on else None, running_on=running_on,
        service_s=0.0, waiting_since_s=submitted, preemptions=rng.choice((0, 0, 0, 1)),
        resource_profile=rng.choice(tuple(ResourceProfile)), level=2 if running_on else None,
    )


def _pick_class(rng: random.Random) -> tuple[SloClass, float]:
    draw = rng.random()
    for cls, share, target_s in _CLASSES:
        if draw < share:
            return cls, target_s
        draw -= share
    return _CLASSES[-1][0], _CLASSES[-1][2]


class GcPauses:
    """Collections that run while installed (``gc.callbacks``): count and longest, in ms."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._started) * 1e3)


def time_ticks(snapshot: ClusterSnapshot, policy: PolicyConfig, ticks: int,
               gc_paused: bool) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each tick. On a shared machine the CPU time leaves out the time
    other processes held the core, so its tail is the code's own (collections included)."""
    wall_s, cpu_s = [], []
    for t in range(ticks):
        now_s = 1000.0 + 0.1 * t
        if gc_paused:
            gc.disable()
        start, start_cpu = time.perf_counter(), time.thread_time()
        plan_tick(snapshot, policy, now_s)
        cpu_s.append(time.thread_time() - start_cpu)
        wall_s.append(time.perf_counter() - start)
        gc.enable()
    return wall_s, cpu_s


def summary(timings: tuple[list[float], list[float]]) -> dict[str, float]:
    wall, cpu = sorted(timings[0]), sorted(timings[1])
    return {"p50_ms": statistics.median(wall) * 1e3, "p99_ms": _p99(wall) * 1e3,
            "max_ms": wall[-1] * 1e3, "mean_ms": statistics.fmean(wall) * 1e3,
            "cpu_p50_ms": statistics.median(cpu) * 1e3, "cpu_p99_ms": _p99(cpu) * 1e3}


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def time_mode(snapshot: ClusterSnapshot, ticks: int, gc_paused: bool) -> dict[str, object]:
    """Stepline and FIFO on one snapshot under one collector setting, and their ratios."""
    stepline, fifo = PolicyConfig(), PolicyConfig(policy=PolicyKind.FIFO)
    gc.collect()
    time_ticks(snapshot, stepline, 10, gc_paused)
    with GcPauses() as collections:
        ours = summary(time_ticks(snapshot, stepline, ticks, gc_paused))
    base = summary(time_ticks(snapshot, fifo, max(ticks // 3, 10), gc_paused))
    return {"stepline": ours, "fifo": base,
            "p50_ratio_vs_fifo": ours["p50_ms"] / base["p50_ms"],
            "p99_ratio_vs_fifo": ours["p99_ms"] / base["p99_ms"],
            "collections_in_ticks": len(collections.pauses_ms),
            "longest_collection_ms": max(collections.pauses_ms, default=0.0)}


def median_ci(samples: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free 95 % confidence interval on it (order statistics:
    ranks n/2 ± 1.96·√n/2)."""
    ordered = sorted(samples)
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[low], ordered[high]


def changed(rng: random.Random, job: JobView, serial: int, now_s: float) -> JobView:
    """A new view of a job: a third finish and are replaced by an arrival, the rest progress."""
    if rng.random() < 1 / 3:
        fresh = _job(rng, serial, now_s, "steady", running_on=None)
        return replace(fresh, job_id=f"n{serial}", submitted_at_s=now_s,
                       deadline_s=now_s + fresh.deadline_s - fresh.submitted_at_s,
                       waiting_since_s=now_s)
    done = min(job.next_chunk + 1, job.num_chunks)
    return replace(job, next_chunk=done, waiting_since_s=now_s, service_s=job.service_s + 0.1,
                   remaining_cost_units=job.remaining_cost_units * (job.num_chunks - done)
                   / max(job.num_chunks - job.next_chunk, 1))


def time_history(snapshot: ClusterSnapshot, changes: int, held_ticks: int,
                 scratch_ticks: int, seed: int) -> dict[str, object]:
    """A history of ticks 0.1 s apart, ``changes`` new views before each: the held planner on
    every tick, ``plan_tick`` from scratch on the first ``scratch_ticks`` (their plans compared
    with the held planner's)."""
    rng = random.Random(seed)
    policy, planner = PolicyConfig(), IncrementalPlanner()
    jobs = list(snapshot.jobs)
    planner.plan(snapshot, policy, 1000.0)  # the first tick reads every view
    held_wall, held_cpu, scratch_wall, scratch_cpu = [], [], [], []
    unequal = 0
    gc.collect()
    for t in range(held_ticks):
        now_s = 1000.1 + 0.1 * t
        for k in rng.sample(range(len(jobs)), min(changes, len(jobs))):
            jobs[k] = changed(rng, jobs[k], (t + 1) * len(jobs) + k, now_s)
        snapshot = replace(snapshot, jobs=tuple(jobs))
        gc.disable()
        start, start_cpu = time.perf_counter(), time.thread_time()
        plan = planner.plan(snapshot, policy, now_s)
        held_cpu.append(time.thread_time() - start_cpu)
        held_wall.append(time.perf_counter() - start)
        if t < scratch_ticks:
            start, start_cpu = time.perf_counter(), time.thread_time()
            reference = plan_tick(snapshot, policy, now_s)
            scratch_cpu.append(time.thread_time() - start_cpu)
            scratch_wall.append(time.perf_counter() - start)
            unequal += reference != plan
        gc.enable()
        snapshot = replace(snapshot, state=plan.state or snapshot.state)
    held, scratch = _spread(held_wall, held_cpu), _spread(scratch_wall, scratch_cpu)
    return {"changes_per_tick": changes, "held": held, "scratch": scratch,
            "p50_ratio_scratch_over_held": scratch["p50_ms"] / held["p50_ms"],
            "cpu_p50_ratio_scratch_over_held": scratch["cpu_p50_ms"] / held["cpu_p50_ms"],
            "plans_compared": len(scratch_wall), "plans_unequal": unequal}


def _spread(wall: list[float], cpu: list[float]) -> dict[str, object]:
    p50, low, high = median_ci([w * 1e3 for w in wall])
    cpu50, cpu_low, cpu_high = median_ci([c * 1e3 for c in cpu])
    return {"p50_ms": p50, "p50_ci95_ms": [low, high], "p99_ms": _p99(sorted(wall)) * 1e3,
            "cpu_p50_ms": cpu50, "cpu_p50_ci95_ms": [cpu_low, cpu_high],
            "cpu_p99_ms": _p99(sorted(cpu)) * 1e3, "ticks": len(wall)}


def slope_ms_per_change(rows: list[dict[str, object]], field: str) -> float:
    """Least-squares slope of the held planner's p50 (``field``) over the changes per tick."""
    xs = [float(row["changes_per_tick"]) for row in rows]  # type: ignore[arg-type]
    ys = [float(row["held"][field]) for row in rows]  # type: ignore[index]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if not spread:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def run_held(args: argparse.Namespace) -> dict[str, object]:
    """The held planner against ``plan_tick`` from scratch, for every size and scenario."""
    found: dict[str, object] = {}
    for n_jobs in args.jobs:
        per_scenario: dict[str, object] = {}
        for scenario in ("steady", "converged", "overload"):
            snapshot = build_snapshot(n_jobs, args.workers, scenario, seed=7)
            rows = [time_history(snapshot, c, args.held_ticks, args.scratch_ticks, seed=11)
                    for c in args.changes]
            per_scenario[scenario] = {
                "rows": rows, "slope_ms_per_change": slope_ms_per_change(rows, "p50_ms"),
                "cpu_slope_ms_per_change": slope_ms_per_change(rows, "cpu_p50_ms")}
        found[str(n_jobs)] = per_scenario
    return found


def served_ledger(snapshot: ClusterSnapshot, seed: int) -> ServiceLedger:
    """Counters as a busy cluster has them: some worker-seconds for every (band, tenant, tier)
    of the snapshot's jobs, nobody active yet (the first join lifts nobody: no one stayed)."""
    rng = random.Random(seed)
    keys = sorted({(j.slo_class.value, j.tenant, j.tier.value) for j in snapshot.jobs})
    return ServiceLedger({key: rng.uniform(0.0, 600.0) for key in keys})


def time_fair_share(snapshot: ClusterSnapshot, changes: int, ticks: int,
                    seed: int) -> dict[str, object]:
    """The held planner with fair share off and on, each tick planned by both on the same
    snapshot (one planner each, alternating which goes first): p50 of each with a 95 %
    interval, and the per-tick ratio on ÷ off (its median and interval). The join rule runs
    inside the plan under fair share, so it is timed with it."""
    rng = random.Random(seed)
    off = PolicyConfig()
    on = replace(off, fair_share=FairShareConfig(enabled=True))
    planners = {"off": IncrementalPlanner(), "on": IncrementalPlanner()}
    ledger = served_ledger(snapshot, seed)
    jobs = list(snapshot.jobs)
    planners["off"].plan(snapshot, off, 1000.0)
    ledger = planners["on"].plan(replace(snapshot, service=ledger), on, 1000.0).fair_share.ledger
    wall: dict[str, list[float]] = {"off": [], "on": []}
    gc.collect()
    for t in range(ticks):
        now_s = 1000.1 + 0.1 * t
        for k in rng.sample(range(len(jobs)), min(changes, len(jobs))):
            jobs[k] = changed(rng, jobs[k], (t + 1) * len(jobs) + k, now_s)
        snapshot = replace(snapshot, jobs=tuple(jobs), service=ledger)
        gc.disable()
        for mode in (("off", "on") if t % 2 else ("on", "off")):
            start = time.perf_counter()
            plan = planners[mode].plan(snapshot, on if mode == "on" else off, now_s)
            wall[mode].append(time.perf_counter() - start)
            if plan.fair_share is not None:
                ledger = plan.fair_share.ledger
        gc.enable()
    out: dict[str, object] = {"changes_per_tick": changes, "ticks": ticks}
    for mode, samples in wall.items():
        p50, low, high = median_ci([w * 1e3 for w in samples])
        out[mode] = {"p50_ms": p50, "p50_ci95_ms": [low, high],
                     "p99_ms": _p99(sorted(samples)) * 1e3}
    ratio, low, high = median_ci([a / b for a, b in zip(wall["on"], wall["off"], strict=True)])
    out["ratio_on_over_off"] = {"median": ratio, "ci95": [low, high]}
    return out


def run_fair_share(args: argparse.Namespace) -> dict[str, object]:
    """Fair share off and on for the first ``--jobs`` size, steady scenario, each of
    ``--changes``."""
    snapshot = build_snapshot(args.jobs[0], args.workers, "steady", seed=7)
    return {"jobs": args.jobs[0], "workers": args.workers, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "python": sys.version.split()[0],
            "rows": [time_fair_share(snapshot, c, args.held_ticks, seed=11)
                     for c in args.changes]}


def report_fair_share(results: dict[str, object]) -> None:
    print(f"fair share off vs on, {results['jobs']} jobs, {results['workers']} workers,"
          f" load average {results['load_average']} on {results['cpus']} CPUs")
    rows = results["rows"]
    assert isinstance(rows, list)
    for r in rows:
        off, on, ratio = r["off"], r["on"], r["ratio_on_over_off"]
        print(f"changes {r['changes_per_tick']:5d}  off p50 {off['p50_ms']:7.2f} ms"
              f" [{off['p50_ci95_ms'][0]:.2f}, {off['p50_ci95_ms'][1]:.2f}]"
              f"  on p50 {on['p50_ms']:7.2f} ms [{on['p50_ci95_ms'][0]:.2f},"
              f" {on['p50_ci95_ms'][1]:.2f}]  ratio on/off {ratio['median']:.2f}"
              f" [{ratio['ci95'][0]:.2f}, {ratio['ci95'][1]:.2f}]")


def run(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {"jobs": args.jobs[0], "workers": args.workers,
                                  "ticks": args.ticks, "python": sys.version.split()[0],
                                  "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    stepline = PolicyConfig()
    for scenario in () if args.held_only else ("steady", "converged", "overload"):
        snapshot = build_snapshot(args.jobs[0], args.workers, scenario, seed=7)
        plan = plan_tick(snapshot, stepline, 1000.0)
        check_plan_invariants(plan, snapshot, stepline)
        start = time.perf_counter()
        check_plan_invariants(plan, snapshot)
        check_ms = (time.perf_counter() - start) * 1e3
        results[scenario] = {"gc_paused": time_mode(snapshot, args.ticks, gc_paused=True),
                             "gc_enabled": time_mode(snapshot, args.ticks, gc_paused=False),
                             "check_plan_invariants_ms": check_ms,
                             "load": plan.admission.load, "admission": plan.admission.state.value,
                             "releases": len(plan.releases), "suspend": len(plan.suspend),
                             "expire": len(plan.expire), "preempt": len(plan.preempt)}
    results["held"] = run_held(args)
    results["held_sizes"] = args.jobs
    results["load_average_after"] = os.getloadavg()
    return results


def report(results: dict[str, object]) -> None:
    print(f"load average {results['load_average']} on {results['cpus']} CPUs")
    for scenario in ("steady", "converged", "overload"):
        if scenario not in results:
            continue
        row = results[scenario]
        assert isinstance(row, dict)
        for mode in ("gc_paused", "gc_enabled"):
            m = row[mode]
            ours, base = m["stepline"], m["fifo"]
            print(f"{scenario:9s} {mode:10s} stepline p50 {ours['p50_ms']:6.2f} ms"
                  f"  p99 {ours['p99_ms']:6.2f} ms  (cpu p50 {ours['cpu_p50_ms']:6.2f}"
                  f" p99 {ours['cpu_p99_ms']:6.2f})  | fifo p50 {base['p50_ms']:6.2f} ms"
                  f"  ratio p50 {m['p50_ratio_vs_fifo']:.2f} p99 {m['p99_ratio_vs_fifo']:.2f}"
                  f"  | {m['collections_in_ticks']} collections,"
                  f" longest {m['longest_collection_ms']:.2f} ms")
        print(f"{scenario:9s} load {row['load']:.2f} {row['admission']}, releases"
              f" {row['releases']}, suspend {row['suspend']}, expire {row['expire']};"
              f" check_plan_invariants {row['check_plan_invariants_ms']:.2f} ms")
    report_held(results)


def report_held(results: dict[str, object]) -> None:
    held = results["held"]
    assert isinstance(held, dict)
    for size, per_scenario in held.items():
        for scenario, found in per_scenario.items():
            for r in found["rows"]:
                h, f = r["held"], r["scratch"]
                print(f"{size:>6s} {scenario:9s} changes {r['changes_per_tick']:5d}  held p50"
                      f" {h['p50_ms']:7.2f} ms [{h['p50_ci95_ms'][0]:.2f},"
                      f" {h['p50_ci95_ms'][1]:.2f}] p99 {h['p99_ms']:7.2f} (cpu p50"
                      f" {h['cpu_p50_ms']:6.2f} p99 {h['cpu_p99_ms']:6.2f})  | scratch p50"
                      f" {f['p50_ms']:7.2f} ms [{f['p50_ci95_ms'][0]:.2f},"
                      f" {f['p50_ci95_ms'][1]:.2f}] p99 {f['p99_ms']:7.2f}  ratio p50"
                      f" {r['p50_ratio_scratch_over_held']:5.1f}"
                      f" (cpu {r['cpu_p50_ratio_scratch_over_held']:5.1f})"
                      f"  unequal plans {r['plans_unequal']}/{r['plans_compared']}")
            print(f"{size:>6s} {scenario:9s} slope {found['slope_ms_per_change'] * 1e3:.2f} µs"
                  f" per changed job (cpu {found['cpu_slope_ms_per_change'] * 1e3:.2f} µs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[10_000])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--changes", type=int, nargs="+", default=[0, 10, 100, 1000])
    parser.add_argument("--held-ticks", type=int, default=100)
    parser.add_argument("--scratch-ticks", type=int, default=20)
    parser.add_argument("--held-only", action="store_true",
                        help="skip the gc and FIFO scenarios; time the held planner only")
    parser.add_argument("--out", type=Path, default=Path("bench-out/tick.json"))
    parser.add_argument("--fair-share", action="store_true",
                        help="time the held planner with fair share off and on (steady)")
    args = parser.parse_args()
    if args.fair_share:
        results = run_fair_share(args)
        report_fair_share(results)
    else:
        results = run(args)
        report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
