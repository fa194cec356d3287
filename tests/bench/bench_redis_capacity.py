"""Capacity of one Redis (a script, not a test): the Redis CPU one chunk hop costs (lone and
batched), what a scheduler tick costs at a live backlog, and from those how many workers one
Redis core carries at 20 / 50 / 200 ms steps.

    python tests/bench/bench_redis_capacity.py [--workers 2] [--rounds 5] [--jobs 4]
        [--backlogs 1000 10000] [--out bench-out/redis_capacity.json]

Redis executes commands on one thread, so its capacity is the main thread's CPU: the bench reads
``used_cpu_user_main_thread + used_cpu_sys_main_thread`` (``INFO cpu``) around each phase on a
live stack (embedded server, real Celery workers, the scheduler ticking) and subtracts the idle
rate measured first (heartbeats, empty ticks, the workers' blocking polls). A phase's hops are
the workers' own commit counts (their heartbeats' hop profiles), so a batched hop counts once
however many jobs it carries. Each phase runs ``--rounds`` times: per-hop costs carry a 95 %
interval over rounds.

Workers per Redis core at step ``s``: a busy worker hops once per ``s + h`` (``h``: the hop's
own wall overhead, measured in the lone phase), costing ``c`` of Redis CPU each, so it uses
``c / (s + h)`` of a core; the tick and the idle load use the rest of the core first. Past that
many workers, run independent pools, each with its own Redis (a broker apart from the state is
not built: the commit script writes a chunk's state and pushes its next message in one script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.bench.report import mean_ci
from app.celery import configure as configure_celery
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.runtime import connect, current_settings, redis_url
from tasks.store import JobStore
from tasks.submit import JobService

STEPS = 100
STEP_MS = 1.0
IDLE_S = 8.0
TICK_WINDOW_S = 10.0
STEP_SIZES_MS = (20.0, 50.0, 200.0)
BEAT_WAIT_S = [3.0]
"""How long a heartbeat may take to report the last commits (a third of the chunk lease, and
some)."""


def main_thread_cpu_s(client: Any) -> float:
    """Seconds of CPU the server's main thread (the one that runs commands) has used."""
    cpu = client.info("cpu")
    if "used_cpu_user_main_thread" in cpu:
        return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def commits_done(store: JobStore) -> int:
    """Chunk commits the workers have made (their heartbeats' hop profiles)."""
    return sum(int(beat.hop_profile.get("commit", {}).get("n", 0))
               for beat in store.heartbeats().values())


def ticks_since(store: JobStore, since_s: float) -> int:
    entries = store.read_stream(keys.TICK_STATS, after_id=f"{int(since_s * 1000)}-0", count=100000)
    return len(entries)


def wait_ended(store: JobStore, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for job_id in ids:
        while not store.state(job_id).is_terminal:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end within {timeout_s:.0f} s")
            time.sleep(0.02)


def hop_round(service: JobService, jobs: int, batch_growth: float | None) -> dict[str, float]:
    """One round: ``jobs`` jobs of ``STEPS`` 1 ms steps submitted together; the Redis CPU
    above idle per worker hop, and the hop's wall overhead."""
    params: dict[str, Any] = {"steps": STEPS, "step_ms": STEP_MS}
    if batch_growth is not None:
        params["batch_growth"] = batch_growth
    client = service.store.redis
    commits0, cpu0, t0 = commits_done(service.store), main_thread_cpu_s(client), time.monotonic()
    ids = [service.submit(JobSpec(kind="simulated", slo=SloClass.INTERACTIVE, deadline_s=600,
                                  params=params))[0] for _ in range(jobs)]
    wait_ended(service.store, ids, 300)
    time.sleep(BEAT_WAIT_S[0])  # the workers' next heartbeats carry the last commits
    elapsed = time.monotonic() - t0
    cpu = main_thread_cpu_s(client) - cpu0
    hops = commits_done(service.store) - commits0
    states = {service.store.state(i) for i in ids}
    if states != {JobState.DONE}:
        raise RuntimeError(f"probe jobs ended {states}")
    return {"elapsed_s": elapsed, "cpu_s": cpu, "hops": hops, "job_steps": jobs * STEPS}


def hop_phase(service: JobService, rounds: int, jobs: int, workers: int, idle_rate: float,
              batch_growth: float | None) -> dict[str, Any]:
    rows = [hop_round(service, jobs, batch_growth) for _ in range(rounds)]
    per_hop_ms = [1e3 * (r["cpu_s"] - idle_rate * r["elapsed_s"]) / max(r["hops"], 1)
                  for r in rows]
    per_step_ms = [1e3 * (r["cpu_s"] - idle_rate * r["elapsed_s"]) / r["job_steps"] for r in rows]
    # wall per worker hop with every worker busy: the pool's hops over the busy time
    wall_ms = [1e3 * r["elapsed_s"] * workers / max(r["hops"], 1) for r in rows]
    return {"rounds": rows, "redis_cpu_ms_per_hop": mean_ci(per_hop_ms),
            "redis_cpu_ms_per_job_step": mean_ci(per_step_ms),
            "wall_ms_per_worker_hop": mean_ci(wall_ms),
            "job_steps_per_hop": statistics.fmean(r["job_steps"] / max(r["hops"], 1)
                                                  for r in rows)}


def tick_phase(service: JobService, backlog: int, idle_rate: float) -> dict[str, Any]:
    """``backlog`` live jobs waiting on a dependency that runs for the whole phase: the tick
    reads and plans them all; nothing hops. Redis CPU per tick above idle."""
    blocker, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=3600,
                                        params={"steps": 1, "step_ms": 600_000}))
    spec = JobSpec(kind="simulated", slo=SloClass.BATCH, deadline_s=3600,
                   params={"steps": 10, "step_ms": 1.0}, depends_on=[blocker])
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        ids = [job_id for job_id, _ in pool.map(lambda _: service.submit(spec), range(backlog))]
    submit_s = time.monotonic() - started
    time.sleep(2.0)  # the tick catches up with the arrivals
    client = service.store.redis
    cpu0, wall0 = main_thread_cpu_s(client), time.time()
    time.sleep(TICK_WINDOW_S)
    cpu = main_thread_cpu_s(client) - cpu0
    ticks = ticks_since(service.store, wall0)
    for job_id in [blocker, *ids]:
        service.store.request_cancel(job_id)
    return {"backlog": backlog, "submit_s": round(submit_s, 2), "ticks": ticks,
            "ticks_per_s": ticks / TICK_WINDOW_S,
            "redis_cpu_share": cpu / TICK_WINDOW_S,
            "redis_cpu_ms_per_tick": 1e3 * max(cpu - idle_rate * TICK_WINDOW_S, 0.0)
            / max(ticks, 1)}


def capacity(hop: dict[str, Any], idle_share: float, tick: dict[str, Any] | None,
             tick_hz: float) -> dict[str, float]:
    """Workers one Redis core carries at each step size (busy workers, one hop per step)."""
    cost_s = hop["redis_cpu_ms_per_hop"]["mean"] / 1e3
    overhead_s = max(hop["wall_ms_per_worker_hop"]["mean"] - STEP_MS, 0.0) / 1e3
    tick_share = 0.0 if tick is None else tick["redis_cpu_ms_per_tick"] / 1e3 * tick_hz
    free = max(1.0 - idle_share - tick_share, 0.0)
    return {f"{step:g}ms": round(free / (cost_s / (step / 1e3 + overhead_s)), 1)
            for step in STEP_SIZES_MS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/redis_capacity.json"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=4, help="jobs per round (≥ workers)")
    parser.add_argument("--backlogs", type=int, nargs="*", default=[1000, 10000])
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="stepline-capacity-"))
    os.environ["STEPLINE_RUN_DIR"] = str(run_dir)
    current_settings.cache_clear()
    settings = current_settings()
    configure_celery(settings)
    BEAT_WAIT_S[0] = settings.broker.chunk_lease / 3 + 0.5
    stack = Stack(settings, run_dir, workers=args.workers, with_api=False, with_flower=False)
    stack.start()
    report: dict[str, Any] = {"workers": args.workers, "steps": STEPS, "step_ms": STEP_MS,
                              "load_average_at_start": os.getloadavg()}
    try:
        service = JobService(JobStore(connect(redis_url(settings))), settings)
        client = service.store.redis
        time.sleep(3.0)
        hop_round(service, args.workers, None)  # warm-up (and fresh heartbeats)
        cpu0, t0 = main_thread_cpu_s(client), time.monotonic()
        time.sleep(IDLE_S)
        idle_rate = (main_thread_cpu_s(client) - cpu0) / (time.monotonic() - t0)
        report["idle_redis_cpu_share"] = idle_rate
        print(f"idle: Redis main thread {idle_rate:.1%} of a core", flush=True)
        report["lone"] = lone = hop_phase(service, args.rounds, args.jobs, args.workers,
                                          idle_rate, None)
        report["batched"] = batched = hop_phase(service, args.rounds, args.jobs, args.workers,
                                                idle_rate, 0.2)
        for name, row in (("lone", lone), ("batched", batched)):
            c = row["redis_cpu_ms_per_hop"]
            print(f"{name:8} Redis CPU per hop {c['mean']:.3f} ms "
                  f"[{c['lo']:.3f}, {c['hi']:.3f}], per job step "
                  f"{row['redis_cpu_ms_per_job_step']['mean']:.3f} ms, "
                  f"{row['job_steps_per_hop']:.2f} job steps a hop", flush=True)
        tick_hz = 1.0 / settings.scheduler.origin_detection_interval
        report["ticks"] = ticks = [tick_phase(service, n, idle_rate) for n in args.backlogs]
        for row in ticks:
            print(f"backlog {row['backlog']:>6}: {row['ticks_per_s']:.1f} ticks/s, "
                  f"Redis CPU {row['redis_cpu_ms_per_tick']:.2f} ms a tick, "
                  f"{row['redis_cpu_share']:.1%} of a core", flush=True)
        report["workers_per_redis_core"] = {
            name: {str(t["backlog"] if t else 0): capacity(row, idle_rate, t, tick_hz)
                   for t in [None, *ticks]}
            for name, row in (("lone", lone), ("batched", batched))}
        print(json.dumps(report["workers_per_redis_core"], indent=1))
    finally:
        stack.stop()
    report["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
