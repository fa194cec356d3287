"""Tick benchmark: p50/p99 of ``plan_tick`` on 10 000 queued jobs and 64 workers.

Scenarios: ``steady`` (load under the convergence threshold), ``overload`` (the first tick
after load jumps: suspends and expiries), ``converged`` (overload with batch work already
suspended). The FIFO baseline plans the same snapshot in the same run, for a machine-free ratio.

    python tests/bench/bench_tick.py [--jobs 10000] [--workers 64] [--ticks 300]
                                     [--out bench-out/tick.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
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


def time_ticks(snapshot: ClusterSnapshot, policy: PolicyConfig, ticks: int) -> list[float]:
    durations_s = []
    for t in range(ticks):
        now_s = 1000.0 + 0.1 * t
        start = time.perf_counter()
        plan_tick(snapshot, policy, now_s)
        durations_s.append(time.perf_counter() - start)
    return durations_s


def summary(durations_s: list[float]) -> dict[str, float]:
    ordered = sorted(durations_s)
    return {"p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
            "mean_ms": statistics.fmean(ordered) * 1e3}


def run(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {"jobs": args.jobs, "workers": args.workers,
                                  "ticks": args.ticks, "python": sys.version.split()[0]}
    stepline, fifo = PolicyConfig(), PolicyConfig(policy=PolicyKind.FIFO)
    for scenario in ("steady", "converged", "overload"):
        snapshot = build_snapshot(args.jobs, args.workers, scenario, seed=7)
        plan = plan_tick(snapshot, stepline, 1000.0)
        check_plan_invariants(plan, snapshot, stepline)
        gc.collect()
        gc.freeze()
        time_ticks(snapshot, stepline, 10)
        ours = summary(time_ticks(snapshot, stepline, args.ticks))
        base = summary(time_ticks(snapshot, fifo, max(args.ticks // 3, 10)))
        gc.unfreeze()
        results[scenario] = {"stepline": ours, "fifo": base,
                             "p50_ratio_vs_fifo": ours["p50_ms"] / base["p50_ms"],
                             "load": plan.admission.load, "admission": plan.admission.state.value,
                             "releases": len(plan.releases), "suspend": len(plan.suspend),
                             "expire": len(plan.expire), "preempt": len(plan.preempt)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tick.json"))
    args = parser.parse_args()
    results = run(args)
    for scenario in ("steady", "converged", "overload"):
        row = results[scenario]
        assert isinstance(row, dict)
        ours, base = row["stepline"], row["fifo"]
        print(f"{scenario:9s} stepline p50 {ours['p50_ms']:6.2f} ms  p99 {ours['p99_ms']:6.2f} ms"
              f"  | fifo p50 {base['p50_ms']:6.2f} ms  ratio {row['p50_ratio_vs_fifo']:.2f}"
              f"  | load {row['load']:.2f} {row['admission']}, releases {row['releases']},"
              f" suspend {row['suspend']}, expire {row['expire']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
