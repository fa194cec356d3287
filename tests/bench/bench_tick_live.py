"""Live tick benchmark: the whole tick (read + plan + invariants + apply) against a real embedded
Redis holding N live jobs created through the store's submit path, a few workers beating.

Per size it times, in the same run and on the same store:

- ``full``: today's read of every live record each tick (``read_snapshot``);
- ``incremental``: the scheduler worker's ``SnapshotCache``, folding in only changed records,
  planned by its held ``IncrementalPlanner`` (as ``tasks.tick`` runs it);

with p50 (95 % order-statistic CI) and p99 of the whole tick, the read / plan / apply split,
the ticks per second an incremental tick allows, and the cost against the number of records
changed between ticks (0, 10, 100, 1000 lease renewals, marked as the workers' are), with its
slope in ms per changed job. The first tick (a convergence: thousands of suspensions) is
reported on its own, with the round trips its apply cost, and so are the ticks right after it:
the records each one read again (the tick's own writes are folded without a read) and its
read and apply times.

    python tests/bench/bench_tick_live.py [--jobs 1000 10000] [--with-50k] [--ticks 30]
                                          [--out bench-out/tick_live.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis
from redis.connection import AbstractConnection

from app.embedded_redis import EmbeddedRedis
from scheduler import IncrementalPlanner, SloClass
from scheduler.lifecycle import JobState
from tasks.adapter import TickPhases, run_tick
from tasks.artifacts import ArtifactStore
from tasks.context import WorkerContext
from tasks.heartbeat import Heartbeat, write_heartbeat
from tasks.settings import Settings
from tasks.snapshot import SnapshotCache
from tasks.spec import JobSpec
from tasks.store import JobStore
from tests.store_steps import claim_chunk, create_job, renew_lease

WORKERS = 8
CHANGES = (0, 10, 100, 1000)
AFTER_BURST = 5
"""Ticks timed one by one right after the first: each folds in what the one before it moved."""


@dataclass
class Split:
    read_ms: float
    plan_ms: float
    apply_ms: float
    reread: int = 0
    """Records the tick read (all of them on a full read)."""

    @property
    def total_ms(self) -> float:
        return self.read_ms + self.plan_ms + self.apply_ms


class RoundTrips:
    """Counts what a client sends (one ``send_packed_command`` per command or pipeline)."""

    def __init__(self) -> None:
        self.count = 0
        self._send = AbstractConnection.send_packed_command

    def __enter__(self) -> RoundTrips:
        send, outer = self._send, self

        def counting(conn: AbstractConnection, command: Any, check_health: bool = True) -> None:
            outer.count += 1
            send(conn, command, check_health)

        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        AbstractConnection.send_packed_command = self._send  # type: ignore[method-assign]


def populate(store: JobStore, n: int, rng: random.Random) -> list[str]:
    """N jobs through the store's create (one script each), a fifth released to their queue,
    ``WORKERS`` of them running on workers that beat as workers do."""
    classes = [(SloClass.REALTIME, 0.1), (SloClass.INTERACTIVE, 0.3), (SloClass.BATCH, 0.6)]
    ids = []
    for k in range(n):
        slo = rng.choices([c for c, _ in classes], [w for _, w in classes])[0]
        steps = rng.choice([10, 20, 50])
        spec = JobSpec(kind="simulated", slo=slo, params={"steps": steps, "step_ms": 50})
        job_id, _ = create_job(store, spec, tenant=f"t{k % 20}", tier="standard", num_chunks=steps,
                               cost_key="simulated", cost_units=[1.0] * steps,
                               deadline_s=rng.uniform(5, 600), now_s=time.time(),
                               queue=slo.value)
        ids.append(job_id)
    for job_id in ids[: n // 5]:  # released as the tick does: moved, then its message noted
        store.transition(job_id, JobState.QUEUED, by="bench")
        store.set_fields(job_id, published=0, last_task_id=f"{job_id}.0.0.bench")
    pipe = store.redis.pipeline(transaction=False)
    for w in range(WORKERS):
        job_id = ids[w]
        claim_chunk(store, job_id, 0, 0, f"w{w}@bench", 3600.0)
        write_heartbeat(pipe, Heartbeat(name=f"w{w}@bench", busy_job=job_id, batch=1,
                                        queues=("realtime", "interactive", "batch"),
                                        ts=time.time()), 3600.0)
    pipe.execute()
    return ids


def tick(store: JobStore, settings: Settings, cache: SnapshotCache | None,
         planner: IncrementalPlanner | None = None) -> Split:
    """``tasks.adapter.run_tick``, as the scheduler worker runs it, timed by its phases (the
    invariants' check counted with the plan)."""
    phases = TickPhases()
    ctx = WorkerContext(settings=settings, store=store,
                        artifacts=ArtifactStore.from_settings(settings), name="bench")
    run_tick(ctx, time.time(), cache=cache, planner=planner, phases=phases)
    assert phases.read_s is not None and phases.plan_s is not None
    assert phases.check_s is not None and phases.apply_s is not None, "the plan broke an invariant"
    return Split(phases.read_s * 1e3, (phases.plan_s + phases.check_s) * 1e3,
                 phases.apply_s * 1e3, phases.reread)


def change(store: JobStore, ids: list[str], n: int, rng: random.Random) -> None:
    """``n`` records written between ticks as a worker's lease renewal is (write + mark)."""
    for job_id in rng.sample(ids, min(n, len(ids))):
        renew_lease(store, job_id, 30.0)


def p50_ci(values: list[float]) -> tuple[float, float, float]:
    """The median and its 95 % order-statistic confidence interval."""
    ordered = sorted(values)
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half) - 1)
    hi = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[lo], ordered[hi]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(splits: list[Split]) -> dict[str, Any]:
    totals = [s.total_ms for s in splits]
    p50, lo, hi = p50_ci(totals)
    return {"n": len(splits), "p50_ms": p50, "p50_ci95_ms": [lo, hi], "p99_ms": p99(totals),
            "mean_ms": statistics.fmean(totals),
            "read_p50_ms": statistics.median(s.read_ms for s in splits),
            "plan_p50_ms": statistics.median(s.plan_ms for s in splits),
            "apply_p50_ms": statistics.median(s.apply_ms for s in splits)}


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares ms per changed job."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def run_size(url: str, n: int, ticks: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    client = redis.Redis.from_url(url)
    client.flushall()
    try:
        store = JobStore(client)
        created = time.perf_counter()
        ids = populate(store, n, rng)
        create_s = time.perf_counter() - created
        settings = Settings()
        cache, planner = SnapshotCache(store), IncrementalPlanner()
        with RoundTrips() as first_trips:
            first = tick(store, settings, cache, planner)  # the convergence tick (a full read)
        # the ticks right after the burst, back to back: each folds what the one before moved
        after = [tick(store, settings, cache, planner) for _ in range(AFTER_BURST)]
        full: list[Split] = []
        incremental: list[Split] = []
        full_ticks = max(3, ticks // (1 + n // 2000))
        for k in range(max(ticks, full_ticks)):
            if k < full_ticks:
                full.append(tick(store, settings, None))
            incremental.append(tick(store, settings, cache, planner))
        with RoundTrips() as steady_trips:
            tick(store, settings, cache, planner)
        by_change: dict[int, dict[str, Any]] = {}
        for changes in CHANGES:
            timed = []
            for _ in range(max(5, ticks // 2)):
                change(store, ids, changes, rng)
                timed.append(tick(store, settings, cache, planner))
            by_change[changes] = summarize(timed)
        points = [(c, by_change[c]["p50_ms"]) for c in CHANGES]
        inc = summarize(incremental)
        return {
            "jobs": n, "workers": WORKERS, "create_s": create_s,
            "first_tick": {"total_ms": first.total_ms, "read_ms": first.read_ms,
                           "plan_ms": first.plan_ms, "apply_ms": first.apply_ms,
                           "round_trips": first_trips.count},
            "after_burst": [{"reread": s.reread, "read_ms": s.read_ms, "plan_ms": s.plan_ms,
                             "apply_ms": s.apply_ms, "total_ms": s.total_ms} for s in after],
            "steady_tick_round_trips": steady_trips.count,
            "full": summarize(full), "incremental": inc,
            "ratio_p50_full_over_incremental": summarize(full)["p50_ms"] / inc["p50_ms"],
            "ticks_per_s_incremental": 1000.0 / inc["mean_ms"],
            "by_changes": {str(c): v for c, v in by_change.items()},
            "ms_per_changed_job": slope(points),
            "full_reads": cache.full_reads,
        }
    finally:
        client.close()


def report(results: list[dict[str, Any]]) -> None:
    print(f"{'jobs':>6} {'mode':<12} {'p50 ms':>9} {'95% CI':>19} {'p99 ms':>9} "
          f"{'read':>8} {'plan':>8} {'apply':>8}")
    for r in results:
        for mode in ("full", "incremental"):
            s = r[mode]
            lo, hi = s["p50_ci95_ms"]
            print(f"{r['jobs']:>6} {mode:<12} {s['p50_ms']:>9.2f} [{lo:>7.2f},{hi:>8.2f}] "
                  f"{s['p99_ms']:>9.2f} {s['read_p50_ms']:>8.2f} {s['plan_p50_ms']:>8.2f} "
                  f"{s['apply_p50_ms']:>8.2f}")
        print(f"{'':>6} full/incremental p50: {r['ratio_p50_full_over_incremental']:.1f}x; "
              f"incremental ticks/s: {r['ticks_per_s_incremental']:.0f}; steady tick round "
              f"trips: {r['steady_tick_round_trips']}")
        first = r["first_tick"]
        print(f"{'':>6} first (convergence) tick: {first['total_ms']:.0f} ms, apply "
              f"{first['apply_ms']:.0f} ms, {first['round_trips']} round trips")
        after = "; ".join(f"{a['reread']} read in {a['read_ms']:.0f}+{a['apply_ms']:.0f} ms"
                          for a in r["after_burst"])
        print(f"{'':>6} ticks after it (records re-read, read+apply): {after}")
        changes = ", ".join(f"{c}: {v['p50_ms']:.2f} ms (read {v['read_p50_ms']:.2f})"
                            for c, v in r["by_changes"].items())
        print(f"{'':>6} changed jobs per tick -> p50: {changes}; slope "
              f"{r['ms_per_changed_job'] * 1000:.1f} us per changed job")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--with-50k", action="store_true", help="also 50 000 live jobs")
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [*args.jobs, *([50000] if args.with_50k else [])]
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            os.environ["REDIS_URL"] = server.url
            from app.celery import configure  # the releases' messages and revokes go here

            configure(Settings())
            results = [run_size(server.url, n, args.ticks, args.seed) for n in sizes]
        finally:
            server.stop()
    report(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"sizes": results, "loadavg": os.getloadavg()},
                                       indent=2))


if __name__ == "__main__":
    main()
