"""Benchmark of the chunk hop (a script, not a test): per-step overhead of 100-step jobs at 1, 5
and 50 ms steps, idle and under the mixed workload, against a bare Celery task that only
re-publishes itself on the same broker (the floor, measured in the same run), with where the
time goes: the worker's phases (claim, state load, checkpoint encode, commit, publish,
bookkeeping) and the Redis commands one hop costs (``INFO commandstats``).

    python tests/bench/bench_hop.py --out bench-out/hop.json

Per-step overhead of a job = (last commit − first claim − Σ chunk service) ÷ (chunks − 1): all the
time between one chunk's computation and the next one's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from app.bench.driver import replay
from app.bench.report import percentile
from app.bench.workload import generate_trace, load_workload
from app.celery import configure as configure_celery
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import SloClass
from tasks.runtime import connect, current_settings, redis_url
from tasks.store import JobStore
from tasks.submit import JobService

STEPS = 100
JOB_EXTRA: dict[str, Any] = {}
"""More parameters of the probe jobs (``--batchable``: they hop as batches of one)."""
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the floor app lives beside this script


def job_overheads(store: JobStore, job_id: str) -> list[float]:
    """Per-hop overheads (ms) of one finished job, from its commit events."""
    events = [e for e in store.events(job_id) if e.get("kind") == "commit"]
    record = store.record(job_id)
    commits = [(float(e["ts"]), float(e["service_s"])) for e in events]
    if len(commits) < 2 or record.started_at_s is None:
        return []
    return [(ts - prev_ts - service) * 1e3
            for (prev_ts, _), (ts, service) in itertools.pairwise(commits)]


def run_jobs(service: JobService, step_ms: float, jobs: int,
             slo: SloClass = SloClass.INTERACTIVE) -> list[float]:
    """Submit ``jobs`` simulated 100-step jobs one after another; their per-hop overheads."""
    overheads: list[float] = []
    for _ in range(jobs):
        spec = JobSpec(kind="simulated", slo=slo, deadline_s=600,
                       params={"steps": STEPS, "step_ms": step_ms, **JOB_EXTRA})
        job_id, _ = service.submit(spec)
        deadline = time.monotonic() + 120 + STEPS * step_ms / 1e3
        while not service.store.state(job_id).is_terminal and time.monotonic() < deadline:
            time.sleep(0.02)
        overheads.extend(job_overheads(service.store, job_id))
    return overheads


def floor_overheads(run_dir: Path, env: dict[str, str], step_ms: float, hops: int,
                    rounds: int) -> list[float]:
    """Per-hop overhead (ms) of the bare Celery task, ``rounds`` chains of ``hops`` hops."""
    from tests.bench.hop_floor import FLOOR_QUEUE, FLOOR_TASK
    from tests.bench.hop_floor import app as floor_app

    log = open(run_dir / "logs" / "floor.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.bench.hop_floor", "worker", "-P", "solo",
         "-Q", FLOOR_QUEUE, "-n", "floor@%h", "--loglevel", "WARNING", "--without-mingle",
         "--without-gossip"], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=log,
        stderr=log)
    client = connect(redis_url(current_settings()))
    try:
        results = []
        time.sleep(3.0)  # the worker's start
        for _ in range(rounds):
            run = uuid.uuid4().hex
            started = time.time()
            floor_app.send_task(FLOOR_TASK, args=[run, hops - 1, step_ms], queue=FLOOR_QUEUE)
            deadline = time.monotonic() + 60
            while client.get(f"floor:{run}") is None and time.monotonic() < deadline:
                time.sleep(0.01)
            stamp = client.get(f"floor:{run}")
            if stamp is None:
                raise RuntimeError(f"the floor chain {run} never finished; see floor.log")
            finished = float(stamp)
            results.append(((finished - started) - hops * step_ms / 1e3) / hops * 1e3)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def commandstats(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def profile_totals(store: JobStore) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for body in store.heartbeats().values():
        for phase, item in (body.get("hop_profile") or {}).items():
            slot = totals.setdefault(phase, {"s": 0.0, "n": 0})
            slot["s"] += float(item["s"])
            slot["n"] += int(item["n"])
    return totals


def breakdown(store: JobStore, service: JobService, step_ms: float, jobs: int,
              lease_s: float) -> dict[str, Any]:
    """Worker phases and Redis commands per hop over ``jobs`` idle jobs."""
    time.sleep(lease_s / 3 + 0.5)  # a fresh heartbeat
    before_profile = profile_totals(store)
    before = commandstats(store.redis)
    overheads = run_jobs(service, step_ms, jobs)
    after = commandstats(store.redis)
    time.sleep(lease_s / 3 + 0.5)
    after_profile = profile_totals(store)
    hops = max(1, jobs * STEPS)
    commands = {k: round((after[k] - before.get(k, 0)) / hops, 2) for k in after
                if after[k] - before.get(k, 0) > 0}
    phases = {}
    for phase, item in after_profile.items():
        base = before_profile.get(phase, {"s": 0.0, "n": 0})
        count = item["n"] - base["n"]
        if count:
            phases[phase] = {"ms_per_hop": round((item["s"] - base["s"]) / hops * 1e3, 4),
                             "calls_per_hop": round(count / hops, 2)}
    return {"commands_per_hop": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
            "redis_commands_per_hop": round(sum(commands.values()), 2),
            "phases": phases, "median_ms": round(statistics.median(overheads), 3)}


def loaded(service: JobService, step_ms: float, jobs: int, load: float,
           workers: int) -> list[float]:
    """Per-hop overheads of probe jobs run while the mixed workload plays at ``load``. The
    probes are realtime, so their hops are not spent waiting behind other jobs by design: what
    remains is what a hop costs on a busy stack."""
    workload = load_workload("mixed")
    trace = generate_trace(workload, workers=workers, load=load, duration_s=None)
    background = threading.Thread(target=replay, args=(service, trace),
                                  kwargs={"drain_timeout_s": 120}, daemon=True)
    background.start()
    time.sleep(2.0)
    overheads = run_jobs(service, step_ms, jobs, SloClass.REALTIME)
    background.join(timeout=300)
    return overheads


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values), 3),
            "p99_ms": round(percentile(values, 99) or 0.0, 3), "hops": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/hop.json"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=5, help="100-step jobs per step size")
    parser.add_argument("--policy", default="stepline")
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--skip-loaded", action="store_true")
    parser.add_argument("--batchable", action="store_true",
                        help="probe jobs declare batch_growth: each hops as a batch of one")
    args = parser.parse_args()
    if args.batchable:
        JOB_EXTRA["batch_growth"] = 0.2
    run_dir = Path(tempfile.mkdtemp(prefix="stepline-hop-"))
    os.environ["STEPLINE_RUN_DIR"] = str(run_dir)
    current_settings.cache_clear()
    settings = current_settings()
    configure_celery(settings)
    stack = Stack(settings, run_dir, workers=args.workers, with_api=False, with_flower=False)
    stack.start()
    report: dict[str, Any] = {"workers": args.workers, "policy": args.policy, "steps": STEPS,
                              "load_average_at_start": os.getloadavg()}
    try:
        store = JobStore(connect(redis_url(settings)))
        service = JobService(store, settings)
        store.set_policy(args.policy)
        time.sleep(3.0)
        run_jobs(service, 1.0, 1)  # warm-up
        report["idle"] = {}
        for step_ms in (1.0, 5.0, 50.0):
            values = run_jobs(service, step_ms, args.jobs if step_ms < 50 else 2)
            report["idle"][f"{step_ms:g}ms"] = summary(values)
            print(f"idle, {step_ms:g} ms steps: {report['idle'][f'{step_ms:g}ms']}", flush=True)
        report["breakdown_5ms"] = breakdown(store, service, 5.0, 2, settings.broker.chunk_lease)
        print(json.dumps(report["breakdown_5ms"], indent=1), flush=True)
        floor = floor_overheads(run_dir, stack.env(), 5.0, STEPS, 5)
        report["floor_5ms"] = {"median_ms": round(statistics.median(floor), 3),
                               "rounds_ms": [round(v, 3) for v in floor]}
        idle5 = report["idle"]["5ms"]["median_ms"]
        report["idle_over_floor"] = round(idle5 / max(report["floor_5ms"]["median_ms"], 1e-9), 3)
        print(f"floor (bare Celery), 5 ms steps: {report['floor_5ms']}; stepline idle "
              f"{idle5} ms = {report['idle_over_floor']}x the floor", flush=True)
        if not args.skip_loaded:
            values = loaded(service, 50.0, 2, args.load, args.workers)
            s = summary(values)
            s["median_pct_of_step"] = round(100 * s["median_ms"] / 50.0, 2)
            s["p99_pct_of_step"] = round(100 * s["p99_ms"] / 50.0, 2)
            report[f"loaded_{args.load:g}_50ms"] = s
            print(f"mixed load {args.load:g}, 50 ms steps: {s}", flush=True)
    finally:
        stack.stop()
    report["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
