"""Benchmark of the chunk hop (a script, not a test): per-step overhead of 100-step jobs at 1, 5
and 50 ms steps, idle and under the mixed workload, against a bare Celery task that only
re-publishes itself on the same broker (the floor, measured in the same run at every step size,
and under the same load), with where the time goes: the worker's phases (claim, state load,
checkpoint encode, next message, commit — which also publishes) and the Redis commands one hop
costs (``INFO commandstats``).

    python tests/bench/bench_hop.py --out bench-out/hop.json

Per-step overhead of a job = (next commit − previous commit − the chunk's service) for each hop:
all the time between one chunk's computation and the next one's. Under load part of that is
queueing — the next chunk waiting while the worker that takes it finishes another job's chunk
(a realtime probe of 100 steps outlives the realtime quantum and sinks a level, as any long job
does) — which is the scheduler's business, not the hop's: it is reported beside the overhead,
which counts from the moment both the message and a worker were ready. Medians carry a
distribution-free 95 % interval.
"""

from __future__ import annotations

import argparse
import bisect
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
from app.bench.report import median_ci, percentile
from app.bench.workload import generate_trace, load_workload
from app.celery import configure as configure_celery
from app.embedded_redis import EmbeddedRedis
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import SloClass
from tasks.dispatch import direct_publish
from tasks.runtime import broker_url, connect, current_settings, redis_url
from tasks.store import JobStore
from tasks.submit import JobService

STEPS = 100
JOB_EXTRA: dict[str, Any] = {}
"""More parameters of the probe jobs (``--batchable``: they hop as batches of one)."""
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the floor app lives beside this script


def worker_activity(store: JobStore) -> dict[str, list[float]]:
    """When each worker did something (claimed, committed, stopped a chunk of any job), from
    every job's event stream, sorted: what a worker was busy with between two moments."""
    activity: dict[str, list[float]] = {}
    for job_id in store.list_ids(0, 1_000_000):
        for event in store.events(job_id):
            by = event.get("by", "")
            if "@" in by:  # a worker's name (the scheduler's and the API's moves are not work)
                activity.setdefault(by, []).append(float(event["ts"]))
    for stamps in activity.values():
        stamps.sort()
    return activity


def job_hops(store: JobStore, job_id: str, activity: dict[str, list[float]]
             ) -> list[tuple[float, float]]:
    """(overhead, queued) in ms of each hop of one finished job. A hop's time is the next
    commit less the previous one less the chunk's service; of that, the time the next chunk
    waited while the worker that took it was still busy with other work is queueing (the
    scheduler's choice or a full house), not the hop's cost: the cost starts when both the
    message and that worker were ready."""
    events = store.events(job_id)
    commits = [e for e in events if e.get("kind") == "commit"]
    claims = {e["reason"].removeprefix("chunk "): e for e in events
              if e.get("kind") == "state" and e.get("to") == "RUNNING"}
    hops = []
    for before, after in itertools.pairwise(commits):
        committed, done = float(before["ts"]), float(after["ts"])
        total = done - committed - float(after["service_s"])
        claim = claims.get(after["chunk"])
        queued = 0.0
        if claim is not None:
            stamps = activity.get(claim["by"], [])
            claimed = float(claim["ts"])
            earlier = stamps[:bisect.bisect_left(stamps, claimed)]
            busy_until = earlier[-1] if earlier else committed
            queued = max(0.0, min(busy_until, claimed) - committed)
        hops.append(((total - queued) * 1e3, queued * 1e3))
    return hops


def run_jobs(service: JobService, step_ms: float, jobs: int,
             slo: SloClass = SloClass.INTERACTIVE) -> list[str]:
    """Submit ``jobs`` simulated 100-step jobs one after another; their ids once all ended."""
    ids: list[str] = []
    for _ in range(jobs):
        spec = JobSpec(kind="simulated", slo=slo, deadline_s=600,
                       params={"steps": STEPS, "step_ms": step_ms, **JOB_EXTRA})
        job_id, _ = service.submit(spec)
        deadline = time.monotonic() + 120 + STEPS * step_ms / 1e3
        while not service.store.state(job_id).is_terminal and time.monotonic() < deadline:
            time.sleep(0.02)
        ids.append(job_id)
    return ids


def overheads_of(store: JobStore, ids: list[str]) -> tuple[list[float], list[float]]:
    """Per-hop overheads and queueing (ms) of the jobs ``ids``."""
    activity = worker_activity(store)
    hops = [hop for job_id in ids for hop in job_hops(store, job_id, activity)]
    return [h[0] for h in hops], [h[1] for h in hops]


class Floor:
    """A worker of the bare Celery app (``hop_floor.py``) beside Stepline's, for the run."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.log = open(run_dir / "logs" / "floor.log", "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.bench.hop_floor", "worker", "-P",
             "solo", "-Q", "bench-floor", "-n", "floor@%h", "--loglevel", "WARNING",
             "--without-mingle", "--without-gossip"], env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT, stdout=self.log, stderr=self.log)
        self.client = connect(broker_url(current_settings()))  # the chain records it there
        time.sleep(3.0)  # the worker's start

    def overheads(self, step_ms: float, hops: int, rounds: int) -> list[float]:
        """Per-hop overheads (ms) of ``rounds`` chains of ``hops`` hops: the time from one hop's
        start to the next one's, less the step."""
        from tests.bench.hop_floor import FLOOR_QUEUE, FLOOR_TASK
        from tests.bench.hop_floor import app as floor_app

        values: list[float] = []
        for _ in range(rounds):
            run = uuid.uuid4().hex
            floor_app.send_task(FLOOR_TASK, args=[run, hops - 1, step_ms], queue=FLOOR_QUEUE)
            deadline = time.monotonic() + 60 + hops * step_ms / 1e3
            while self.client.get(f"floor:{run}") is None and time.monotonic() < deadline:
                time.sleep(0.01)
            stamp = self.client.get(f"floor:{run}")
            if stamp is None:
                raise RuntimeError(f"the floor chain {run} never finished; see floor.log")
            starts = json.loads(stamp)[:-1]  # the last entry is the end of the last step
            values += [(b - a) * 1e3 - step_ms for a, b in itertools.pairwise(starts)]
        return values

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def commandstats(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def profile_totals(store: JobStore) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for beat in store.heartbeats().values():
        for phase, item in beat.hop_profile.items():
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
    ids = run_jobs(service, step_ms, jobs)
    after = commandstats(store.redis)
    overheads, _ = overheads_of(store, ids)
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


def loaded(service: JobService, floor: Floor, step_ms: float, jobs: int, load: float,
           workers: int) -> tuple[list[str], list[float]]:
    """Probe jobs run while the mixed workload plays at ``load`` (their ids), then floor chains
    while it still plays (their per-hop overheads): each under the same load, on the same
    cores and Redis, neither competing with the other."""
    workload = load_workload("mixed")
    trace = generate_trace(workload, workers=workers, load=load, duration_s=None)
    background = threading.Thread(target=replay, args=(service, trace),
                                  kwargs={"drain_timeout_s": 120}, daemon=True)
    background.start()
    time.sleep(2.0)
    ids = run_jobs(service, step_ms, jobs, SloClass.REALTIME)
    if not background.is_alive():
        raise RuntimeError("the workload ended before the floor ran under it; raise its load")
    bare = floor.overheads(step_ms, STEPS, jobs)
    background.join(timeout=300)
    return ids, bare


def summary(values: list[float]) -> dict[str, Any]:
    ci = median_ci(values)
    return {"median_ms": round(ci["median"], 3), "median_ci_ms": [round(ci["lo"], 3),
                                                                  round(ci["hi"], 3)],
            "p99_ms": round(percentile(values, 99) or 0.0, 3), "hops": len(values)}


def against_floor(stepline: list[float], floor: list[float], step_ms: float,
                  queued: list[float]) -> dict[str, Any]:
    """Stepline's per-hop figures beside the floor's, and their ratios; the queueing the hops
    also saw (waiting for a worker busy with other work) beside them."""
    row: dict[str, Any] = {"stepline": summary(stepline), "floor": summary(floor)}
    waited = [q for q in queued if q > 0]
    row["queued"] = {"hops": len(waited), "of": len(queued),
                     "median_ms": round(statistics.median(waited), 3) if waited else 0.0,
                     "max_ms": round(max(waited), 3) if waited else 0.0}
    ours, bare = row["stepline"], row["floor"]
    row["median_over_floor"] = round(ours["median_ms"] / max(bare["median_ms"], 1e-9), 3)
    row["p99_over_floor"] = round(ours["p99_ms"] / max(bare["p99_ms"], 1e-9), 3)
    row["median_pct_of_step"] = round(100 * ours["median_ms"] / step_ms, 2)
    row["p99_pct_of_step"] = round(100 * ours["p99_ms"] / step_ms, 2)
    return row


def show(label: str, row: dict[str, Any]) -> None:
    ours, bare = row["stepline"], row["floor"]
    print(f"{label:28s} stepline median {ours['median_ms']:6.3f} ms {ours['median_ci_ms']} "
          f"p99 {ours['p99_ms']:7.3f} | floor median {bare['median_ms']:6.3f} ms "
          f"p99 {bare['p99_ms']:7.3f} | {row['median_over_floor']:.2f}x the floor, "
          f"{row['median_pct_of_step']:.1f} % of the step (p99 {row['p99_pct_of_step']:.1f} %)"
          f" | queued behind other work: {row['queued']['hops']} of {row['queued']['of']} "
          f"hops, median {row['queued']['median_ms']} ms", flush=True)


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
    parser.add_argument("--no-task-events", action="store_true",
                        help="workers send no Celery task events (what they cost a hop)")
    parser.add_argument("--broker-apart", action="store_true",
                        help="Celery's broker on a second embedded Redis (broker.url): each "
                             "hop publishes through Celery, then writes its bookkeeping")
    args = parser.parse_args()
    if args.no_task_events:
        os.environ["STEPLINE_BROKER__TASK_EVENTS"] = "false"  # the stack's workers inherit it
    if args.batchable:
        JOB_EXTRA["batch_growth"] = 0.2
    run_dir = Path(tempfile.mkdtemp(prefix="stepline-hop-"))
    os.environ["STEPLINE_RUN_DIR"] = str(run_dir)
    broker = EmbeddedRedis(run_dir / "broker") if args.broker_apart else None
    if broker is not None:
        os.environ["STEPLINE_BROKER__URL"] = broker.start()  # the stack's processes inherit it
    current_settings.cache_clear()
    settings = current_settings()
    configure_celery(settings)
    stack = Stack(settings, run_dir, workers=args.workers, with_api=False, with_flower=False)
    stack.start()
    report: dict[str, Any] = {
        "workers": args.workers, "policy": args.policy, "steps": STEPS,
        "direct_publish": settings.broker.direct_publish,
        "direct_publish_in_effect": direct_publish(settings), "broker_apart": broker is not None,
        "task_events": settings.broker.task_events,
        "affinity_kinds": list(settings.affinity.kinds), "batchable": args.batchable,
        "load_average_at_start": os.getloadavg()}
    floor = None
    try:
        store = JobStore(connect(redis_url(settings)))
        service = JobService(store, settings)
        store.set_policy(args.policy)
        time.sleep(3.0)
        run_jobs(service, 1.0, 1)  # warm-up
        floor = Floor(run_dir, stack.env())
        report["idle"] = {}
        for step_ms in (1.0, 5.0, 50.0):
            jobs = args.jobs if step_ms < 50 else max(2, args.jobs // 2)
            ours, queued = overheads_of(store, run_jobs(service, step_ms, jobs))
            bare = floor.overheads(step_ms, STEPS, jobs)
            report["idle"][f"{step_ms:g}ms"] = row = against_floor(ours, bare, step_ms, queued)
            show(f"idle, {step_ms:g} ms steps", row)
        report["breakdown_5ms"] = breakdown(store, service, 5.0, 2, settings.broker.chunk_lease)
        print(json.dumps(report["breakdown_5ms"], indent=1), flush=True)
        if not args.skip_loaded:
            ids, bare = loaded(service, floor, 50.0, 2, args.load, args.workers)
            ours, queued = overheads_of(store, ids)
            report[f"loaded_{args.load:g}_50ms"] = row = against_floor(ours, bare, 50.0, queued)
            show(f"mixed load {args.load:g}, 50 ms steps", row)
    finally:
        if floor is not None:
            floor.stop()
        stack.stop()
        if broker is not None:
            broker.stop()
    report["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
