"""Benchmark: realtime and interactive probe latency under a batch backlog (a script, not a test).

Starts a private stack (embedded Redis, 2 chunk workers, beat and scheduler: real processes),
then for each backlog size (0 / 1 000 / 10 000 long simulated batch jobs; 50 000 with --big)
creates the backlog in pipelines through the store's own create script (the records ``submit``
would store, PENDING: the tick releases them), lets the scheduler take it in, and submits probe
jobs one at a time through ``JobService.submit``: interactive (20 steps of 50 ms, deadline 5 s)
and realtime (3 steps of 50 ms, the class target). Each probe's latency is its record's
``finished_at - submitted_at``; the report gives per class and backlog p50 / p95 with 95 %
confidence intervals (order statistics of the binomial), the ratio of each to the idle (0
backlog) figure, SLO attainment with a Wilson interval, the tick's own p50 duration, and, per
probe, how it waited between its chunks: the longest QUEUED wait between two of its own
chunks and how many of its moves were the scheduler's (release, requeue, standby) rather than
a worker's hop. The backlog is cancelled and drained between sizes.

    python tests/bench/bench_probes.py --out bench-out/probes.json
    python tests/bench/bench_probes.py --backlogs 0,1000 --probes 10 --out bench-out/p.json
    python tests/bench/bench_probes.py --big --out bench-out/probes-50k.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks import keys

PIPELINE = 500
"""Create calls per pipeline round trip."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlogs", default="0,1000,10000",
                        help="comma-separated batch backlog sizes (0 is the idle baseline)")
    parser.add_argument("--big", action="store_true", help="add a 50 000-job backlog")
    parser.add_argument("--probes", type=int, default=20, help="probes of each class per size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-steps", type=int, default=400)
    parser.add_argument("--batch-step-ms", type=float, default=200.0)
    parser.add_argument("--batch-groups", type=int, default=4,
                        help="block groups per batch step (its yield points)")
    parser.add_argument("--backlog-mode", choices=("released", "pending"), default="released",
                        help="released: each backlog job published to the batch queue at "
                             "once, as the submit path does for admitted work; pending: left "
                             "for the tick to release")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="seconds between the backlog's creation and the first probe")
    parser.add_argument("--probe-timeout-s", type=float, default=120.0)
    parser.add_argument("--trace", action="store_true",
                        help="keep each probe's event stream in the JSON (for diagnosis)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/probes.json"))
    args = parser.parse_args()
    backlogs = [int(b) for b in args.backlogs.split(",") if b.strip()]
    if args.big:
        backlogs.append(50_000)
    if 0 not in backlogs:
        backlogs.insert(0, 0)
    run_dir = Path(tempfile.mkdtemp(prefix="stepline-probes-"))
    os.environ.update({"STEPLINE_RUN_DIR": str(run_dir), "STEPLINE_WARM_START": "false"})
    os.environ.pop("REDIS_URL", None)
    started = time.time()
    report = run(args, backlogs, run_dir)
    report["setting"] = {
        "backlogs": backlogs, "backlog_mode": args.backlog_mode, "probes": args.probes,
        "workers": args.workers,
        "batch_job": {"steps": args.batch_steps, "step_ms": args.batch_step_ms,
                      "block_groups": args.batch_groups},
        "load_avg_at_start": os.getloadavg(), "cpus": os.cpu_count(),
        "wall_s": round(time.time() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    _print_table(report)
    print(f"wrote {args.out}")


def run(args: argparse.Namespace, backlogs: Sequence[int], run_dir: Path) -> dict[str, Any]:
    from app.stack import Stack
    from tasks.runtime import connect, current_settings, redis_url
    from tasks.store import JobStore
    from tasks.submit import JobService

    settings = current_settings()
    results: list[dict[str, Any]] = []
    with Stack(settings=settings, run_dir=run_dir, workers=args.workers, with_api=False,
               with_flower=False) as stack:
        store = JobStore(connect(redis_url(settings)))
        _wait_for_workers(store, args.workers)
        service = JobService(store, settings)
        _probe(service, stack, _interactive(), args.probe_timeout_s)  # one warm-up of each
        _probe(service, stack, _realtime(), args.probe_timeout_s)
        for size in backlogs:
            began = time.time()
            backlog = _create_backlog(store, service, size, args)
            time.sleep(args.settle_s if size else 0.0)
            tick_ms = _tick_p50_ms(store, since_s=time.time() - 5)
            probes: dict[str, list[dict[str, Any]]] = {"interactive": [], "realtime": []}
            for _ in range(args.probes):  # interleaved: both classes see the same backlog age
                probes["interactive"].append(
                    _probe(service, stack, _interactive(), args.probe_timeout_s, args.trace))
                probes["realtime"].append(
                    _probe(service, stack, _realtime(), args.probe_timeout_s, args.trace))
            results.append({"backlog": size, "tick_p50_ms_at_start": tick_ms,
                            "tick_p50_ms_during": _tick_p50_ms(store, since_s=time.time() - 30),
                            "ticks": _ticks(store, since_s=began), "probes": probes})
            print(f"backlog {size}: " + ", ".join(
                f"{c} p50 {_pct([p['latency_s'] for p in ps], 50):.3f}s"
                for c, ps in probes.items()), flush=True)
            _drain(store, backlog)
    return _summarise(results)


def _interactive() -> Any:
    from app.schemas import JobSpec
    from scheduler.lifecycle import SloClass

    return JobSpec(kind="simulated", slo=SloClass.INTERACTIVE, deadline_s=5.0,
                   params={"steps": 20, "step_ms": 50})


def _realtime() -> Any:
    from app.schemas import JobSpec
    from scheduler.lifecycle import SloClass

    return JobSpec(kind="simulated", slo=SloClass.REALTIME, params={"steps": 3, "step_ms": 50})


def _create_backlog(store: Any, service: Any, size: int, args: argparse.Namespace) -> list[str]:
    """``size`` batch jobs as ``submit`` would store them, PENDING (the tick releases them),
    created by the store's create script, ``PIPELINE`` per round trip."""
    from app.schemas import JobSpec
    from scheduler import ResourceProfile
    from scheduler.lifecycle import JobState, SloClass
    from tasks.record import encode
    from tasks.store_calls import flat_json
    from tasks.submit import validate_params
    from workers.kinds import get_runner

    if size == 0:
        return []
    params = validate_params("simulated", {"steps": args.batch_steps,
                                           "step_ms": args.batch_step_ms,
                                           "block_groups": args.batch_groups})
    deadline_s = service.settings.scheduler.slo_classes["batch"].target_s  # submit's default
    spec = JobSpec(kind="simulated", slo=SloClass.BATCH, params=params)
    plan = get_runner("simulated").plan(params)
    ttl_s = service.settings.broker.event_retention
    started = time.perf_counter()
    ids: list[str] = []
    create = store._create
    for first in range(0, size, PIPELINE):
        pipe = store.redis.pipeline(transaction=False)
        for _ in range(first, min(first + PIPELINE, size)):
            now_s = time.time()
            job_id = uuid.uuid4().hex[:16]  # the store's id format
            fields = encode(
                job_id=job_id, kind=spec.kind, state=JobState.PENDING, slo=spec.slo, tenant="bench",
                tier="standard", params=params, depends_on=[], submitted_at_s=now_s,
                deadline_at_s=now_s + deadline_s, num_chunks=plan.num_chunks, next_chunk=0, seq=0,
                epoch=0, queue="batch", preempt=False, cancel=False, preemptions=0,
                service_s=0.0, cost_key=plan.cost_key, cost_units=plan.cost_units,
                updated_at_s=now_s, atomic=False, chunk_names=plan.names,
                resource_profile=ResourceProfile(plan.resource_profile), shed_if_late=False,
                events_ttl_s=ttl_s, batch_group=None, batch_growth=None)
            keys_ = [keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.INDEX, "",
                     keys.CHANGES]
            create(keys=keys_, args=[job_id, repr(now_s), flat_json(fields)], client=pipe)
            ids.append(job_id)
        pipe.execute()
    if args.backlog_mode == "released":
        _release_all(store, ids)
    print(f"backlog of {size} ({args.backlog_mode}) created in "
          f"{time.perf_counter() - started:.2f}s", flush=True)
    return ids


def _release_all(store: Any, ids: list[str]) -> None:
    """Each job to QUEUED on the batch queue with its first chunk published, as the submit
    path releases admitted work (``tasks.dispatch.release``)."""
    from tasks.dispatch import release
    from tasks.record import JobRecord

    for first in range(0, len(ids), PIPELINE):
        for record in store.records(ids[first:first + PIPELINE]):
            if isinstance(record, JobRecord):
                release(store, record, queue="batch", by="submit", reason="admitted to batch")


def _probe(service: Any, stack: Any, spec: Any, timeout_s: float,
           trace: bool = False) -> dict[str, Any]:
    """Submit one probe and wait for it; its latency and how it waited between chunks."""
    job_id, _ = service.submit(spec, tenant="probe", tier="gold")  # gold: never shed
    store = service.store
    deadline = time.monotonic() + timeout_s
    while not store.state(job_id).is_terminal:
        if time.monotonic() > deadline:
            raise SystemExit(f"probe {job_id} did not finish in {timeout_s}s")
        if stack.dead():
            raise SystemExit(f"stack process died: {stack.dead()}")
        time.sleep(0.01)
    record = store.record(job_id)
    assert record.finished_at_s is not None
    events = store.events(job_id)
    return {"job_id": job_id, "state": record.state.value,
            "latency_s": round(record.finished_at_s - record.submitted_at_s, 4),
            "deadline_s": round(record.deadline_at_s - record.submitted_at_s, 3),
            "met": record.finished_at_s <= record.deadline_at_s, **waits(events),
            **({"events": events} if trace else {})}


def waits(events: list[dict[str, str]]) -> dict[str, Any]:
    """From a job's events: the longest QUEUED wait after its first claim (between two of its
    own chunks), the wait before its first claim, and how many times the scheduler moved it."""
    queued_at: float | None = None
    first_claim: float | None = None
    longest = 0.0
    submitted = float(events[0]["ts"]) if events else 0.0
    moves = 0
    for event in events:
        if event.get("kind") != "state":
            continue
        ts = float(event["ts"])
        if event["by"] == "scheduler":
            moves += 1
        if event["to"] == "QUEUED":
            queued_at = ts if queued_at is None or event["from"] == "RUNNING" else queued_at
        elif event["to"] == "RUNNING":
            if first_claim is None:
                first_claim = ts
            elif queued_at is not None:
                longest = max(longest, ts - queued_at)
            queued_at = None
    return {"first_wait_s": round((first_claim or submitted) - submitted, 4),
            "longest_hop_wait_s": round(longest, 4), "scheduler_moves": moves}


def _drain(store: Any, backlog: list[str]) -> None:
    """Cancel the backlog and wait until no job is live (workers stop a cancelled job at its
    next chunk; the tick ends the waiting ones)."""
    for job_id in backlog:
        store.request_cancel(job_id)
    deadline = time.monotonic() + 600
    while store.redis.scard(keys.ACTIVE) and time.monotonic() < deadline:
        time.sleep(0.2)


def _tick_p50_ms(store: Any, since_s: float) -> float | None:
    entries = store.read_stream(keys.TICK_STATS, after_id=f"{int(since_s * 1000)}-0")
    durations = [float(fields["duration_ms"]) for _, fields in entries]
    return round(statistics.median(durations), 2) if durations else None


def _ticks(store: Any, since_s: float) -> list[dict[str, float]]:
    """Every tick since ``since_s``: its start, duration and phases (read, plan, check, apply
    milliseconds; live jobs and records re-read), for the diagnosis of a slow one."""
    entries = store.read_stream(keys.TICK_STATS, after_id=f"{int(since_s * 1000)}-0",
                                count=100_000)
    return [{name: float(value) for name, value in fields.items()} for _, fields in entries]


def _wait_for_workers(store: Any, count: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(list(store.redis.scan_iter(keys.WORKER_PREFIX + "w*"))) >= count:
            return
        time.sleep(0.2)
    raise SystemExit("the workers did not start")


# statistics -----------------------------------------------------------------------------------
def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def quantile_ci(values: Sequence[float], q: float, z: float = 1.96) -> tuple[float, float]:
    """A distribution-free 95 % interval of the ``q``-quantile: the order statistics at
    n·q ± z·sqrt(n·q·(1−q)) (normal approximation of the binomial), clamped to the sample."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return (math.nan, math.nan)
    p = q / 100
    half = z * math.sqrt(n * p * (1 - p))
    lo = max(math.floor(n * p - half), 0)
    hi = min(math.ceil(n * p + half), n - 1)
    return (ordered[lo], ordered[hi])


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(centre - half, 0.0), min(centre + half, 1.0))


def _summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    idle = next(r for r in results if r["backlog"] == 0)
    rows = []
    for result in results:
        for cls, probes in result["probes"].items():
            lat = [p["latency_s"] for p in probes]
            base = [p["latency_s"] for p in idle["probes"][cls]]
            met = sum(p["met"] for p in probes)
            p50, p95 = _pct(lat, 50), _pct(lat, 95)
            rows.append({
                "backlog": result["backlog"], "class": cls, "n": len(lat),
                "p50_s": round(p50, 4), "p50_ci_s": [round(v, 4) for v in quantile_ci(lat, 50)],
                "p95_s": round(p95, 4), "p95_ci_s": [round(v, 4) for v in quantile_ci(lat, 95)],
                "p50_vs_idle": round(p50 / _pct(base, 50), 3),
                "p95_vs_idle": round(p95 / _pct(base, 95), 3),
                "slo_attainment": round(met / len(lat), 4),
                "slo_attainment_ci": [round(v, 4) for v in wilson(met, len(lat))],
                "longest_hop_wait_max_s": max(p["longest_hop_wait_s"] for p in probes),
                "first_wait_p50_s": round(_pct([p["first_wait_s"] for p in probes], 50), 4),
                "scheduler_moves": sum(p["scheduler_moves"] for p in probes),
                "tick_p50_ms": result["tick_p50_ms_during"],
            })
    return {"rows": rows, "runs": results}


def _print_table(report: dict[str, Any]) -> None:
    head = (f"{'backlog':>8} {'class':<12} {'n':>3} {'p50 s':>7} {'95% CI':>15} {'p95 s':>7} "
            f"{'95% CI':>15} {'p50/idle':>8} {'p95/idle':>8} {'SLO':>6} {'hop wait':>8} "
            f"{'sched':>5} {'tick ms':>8}")
    print(head)
    for r in report["rows"]:
        ci50, ci95 = r["p50_ci_s"], r["p95_ci_s"]
        print(f"{r['backlog']:>8} {r['class']:<12} {r['n']:>3} {r['p50_s']:>7.3f} "
              f"{ci50[0]:>7.3f}-{ci50[1]:<7.3f} {r['p95_s']:>7.3f} {ci95[0]:>7.3f}-{ci95[1]:<7.3f} "
              f"{r['p50_vs_idle']:>8.2f} {r['p95_vs_idle']:>8.2f} {r['slo_attainment']:>6.0%} "
              f"{r['longest_hop_wait_max_s']:>8.3f} {r['scheduler_moves']:>5} "
              f"{r['tick_p50_ms'] or 0:>8.1f}")


if __name__ == "__main__":
    main()
