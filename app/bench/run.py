"""``stepline bench``: one trace, each policy in turn, on the same real workers; JSON + plots."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.bench.driver import Outcome, replay
from app.bench.report import DEFINITIONS, RunData, plot, ratios_against, run_figures
from app.bench.workload import (
    Arrival,
    Workload,
    generate_trace,
    load_workload,
    read_trace,
    write_trace,
)
from app.celery import configure as configure_celery
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import SloClass
from scheduler.policy import PolicyKind
from tasks import keys
from tasks.record import JobRecord, UnreadableRecord
from tasks.runtime import current_settings, store_client
from tasks.store import JobStore
from tasks.submit import JobService

log = logging.getLogger(__name__)

PROBE_CHUNKS = 40
PROBE_STEP_MS = 5.0


def wait_idle(store: JobStore, timeout_s: float = 30.0) -> None:
    """Cancel what a previous run left behind and wait for the workers to drain it."""
    for job_id in store.active_ids():
        store.request_cancel(job_id)
    deadline = time.monotonic() + timeout_s
    while store.active_ids() and time.monotonic() < deadline:
        time.sleep(0.1)


def probe_hop_overhead(service: JobService, probes: int = 3) -> float:
    """Dispatch overhead per chunk hop on an idle system: (latency − work) ÷ chunks, in ms;
    the median of a few probe jobs."""
    return statistics.median(_probe_once(service) for _ in range(probes))


def _probe_once(service: JobService) -> float:
    spec = JobSpec(kind="simulated", slo=SloClass.INTERACTIVE, deadline_s=60,
                   params={"steps": PROBE_CHUNKS, "step_ms": PROBE_STEP_MS})
    job_id, _ = service.submit(spec)
    deadline = time.monotonic() + 60
    while not service.store.state(job_id).is_terminal and time.monotonic() < deadline:
        time.sleep(0.02)
    r = service.store.record(job_id)
    if r.finished_at_s is None or r.started_at_s is None:
        raise RuntimeError(f"probe job {job_id} ended without timings ({r.state.value})")
    wall_s = r.finished_at_s - r.started_at_s
    return max(0.0, (wall_s - PROBE_CHUNKS * PROBE_STEP_MS / 1e3) / PROBE_CHUNKS * 1e3)


def checkpoint_cache_counts(store: JobStore) -> dict[str, int]:
    """Hits and misses of the workers' local checkpoint caches, from their heartbeats."""

    totals = {"hits": 0, "misses": 0}
    for beat in store.heartbeats().values():
        totals["hits"] += int(beat.ckpt_cache.get("hits", 0))
        totals["misses"] += int(beat.ckpt_cache.get("misses", 0))
    return totals


def job_records(store: JobStore, job_ids: list[str]) -> dict[str, JobRecord]:
    """The run's records by job id; one that cannot be parsed is logged and left out, so its
    job counts as missing its SLO rather than failing the whole report."""
    records = {}
    for item in store.records(job_ids):
        if isinstance(item, UnreadableRecord):
            log.warning("bench: %s", item)
        else:
            records[item.job_id] = item
    return records


def tick_figures(store: JobStore, since_s: float) -> tuple[list[float], list[float]]:
    entries = store.read_stream(keys.TICK_STATS, after_id=f"{int(since_s * 1000)}-0")
    durations = [float(f["duration_ms"]) for _, f in entries]
    starts = [float(f["ts"]) for _, f in entries]
    intervals = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
    return durations, intervals


def run_policy(
    service: JobService, policy: str, trace: list[Arrival], workers: int, drain_timeout_s: float,
    on_progress: Callable[[list[Outcome]], None] | None = None,
) -> RunData:
    store = service.store
    store.set_policy(policy)
    wait_idle(store)
    overhead_ms = probe_hop_overhead(service)
    started, cache_before = time.time(), checkpoint_cache_counts(store)
    outcomes = replay(service, trace, drain_timeout_s=drain_timeout_s, on_progress=on_progress)
    cache_after = checkpoint_cache_counts(store)
    ids = [o.job_id for o in outcomes if o.job_id]
    records = job_records(store, ids)
    events = {job_id: store.events(job_id) for job_id in ids}
    tick_ms, intervals = tick_figures(store, started)
    return RunData(policy=policy, outcomes=outcomes, records=records, events=events,
                   workers=workers, overhead_ms_per_hop=overhead_ms,
                   step_ms_of_probe=PROBE_STEP_MS, tick_ms=tick_ms, tick_intervals_ms=intervals,
                   checkpoint_cache={k: cache_after[k] - cache_before.get(k, 0)
                                     for k in cache_after})


def build_trace(
    workload: Workload, workers: int, load: float | None, duration_s: float | None,
    trace_file: Path | None,
) -> list[Arrival]:
    if trace_file is not None:
        return read_trace(trace_file)
    return generate_trace(workload, workers=workers, load=load, duration_s=duration_s)


def write_report(
    runs: list[RunData], workload: Workload, load: float, trace: list[Arrival], out_dir: Path,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    policies = {run.policy: run_figures(run) for run in runs}
    simulated = all(a.kind == "simulated" for a in trace)
    report: dict[str, Any] = {
        "workload": workload.name, "load": load, "jobs": len(trace),
        "workers": runs[0].workers if runs else 0,
        "device": "simulated (steps sleep calibrated step times)" if simulated else "cpu",
        "policies": policies,
        "definitions": DEFINITIONS,
    }
    if "fifo" in policies:
        report["ratios_vs_fifo"] = {name: ratios_against(policies["fifo"], figures)
                                    for name, figures in policies.items() if name != "fifo"}
    write_trace(trace, out_dir / "trace.jsonl")
    report["plots"] = plot(runs, out_dir)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def summary_table(report: dict[str, Any]) -> Any:
    """Two rich tables: per policy and class, SLO attainment with its 95 % interval and latency
    percentiles (short-job p95 against fifo); per policy, the capacity left idle while work
    waited and the cost model's estimate error."""
    from rich.console import Group

    return Group(_class_table(report), _policy_table(report))


def _class_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table("policy", "class", "jobs", "SLO met [95 % CI]", "p50 s", "p95 s", "p99 s",
                  title=f"{report['workload']} at load {report['load']} on {report['workers']} "
                        f"workers ({report['device']})")
    for name, figures in report["policies"].items():
        for slo, c in figures["classes"].items():
            table.add_row(name, slo, str(c["count"]), _attainment(c),
                          *(_s(c[k]) for k in ("p50_s", "p95_s", "p99_s")))
        table.add_row(name, "all", str(figures["jobs"]), _attainment(figures), "", "", "")
        ratio = report.get("ratios_vs_fifo", {}).get(name, {}).get("short_jobs_p95")
        extra = f" ({ratio:.2f}× fifo)" if ratio is not None else ""
        table.add_row(name, "short jobs", "", "", "", _s(figures["short_jobs_p95_s"]) + extra,
                      "", end_section=True)
    return table


def _policy_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table("policy", "idle while work queued", "of which servable",
                  "estimate error p50", "p95", "jobs estimated",
                  title="capacity and cost model (definitions in report.json)")
    for name, figures in report["policies"].items():
        idle, error = figures["idle_while_waiting"], figures["estimate_error"]
        table.add_row(name, f"{idle['worker_s']:.1f} worker-s ({_pct(idle['share_of_capacity'])})",
                      f"{idle['servable_worker_s']:.1f} worker-s", _pct(error["p50"]),
                      _pct(error["p95"]), str(error["count"]))
    return table


def _attainment(figures: dict[str, Any]) -> str:
    """``97.1 % [93.0, 98.9]``: the attainment and its 95 % Wilson interval."""
    value, ci = figures["slo_attainment"], figures.get("slo_attainment_ci95")
    if value is None:
        return "-"
    bounds = "" if ci is None else f" [{100 * ci['lo']:.1f}, {100 * ci['hi']:.1f}]"
    return f"{100 * value:.1f} %{bounds}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def check_policies(names: Sequence[str]) -> None:
    """Raise ValueError unless ``names`` are distinct values of ``PolicyKind``: the bench runs
    every planner the scheduler has, with no list of its own."""
    known = [kind.value for kind in PolicyKind]
    unknown = sorted(set(names) - set(known))
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"policies {list(names)}: give each of {', '.join(known)} at most "
                         f"once, comma-separated (unknown: {unknown or 'none'})")


def run_bench(
    *, policies: list[str], workload_name: str, load: float | None, workers: int, out_dir: Path,
    duration_s: float | None = None, trace_file: Path | None = None, run_dir: Path,
) -> dict[str, Any]:
    """Start the embedded stack, replay the same trace under each policy, write the report."""
    check_policies(policies)
    settings = current_settings()
    workload = load_workload(workload_name)
    trace = build_trace(workload, workers, load, duration_s, trace_file)
    drain_s = max(60.0, 2 * (duration_s or workload.duration_s))
    configure_celery(settings)
    with Stack(settings=settings, run_dir=run_dir, workers=workers, with_api=False,
               with_flower=False):
        service = JobService(JobStore(store_client(settings)), settings)
        wait_for_workers(service.store, workers)
        runs = []
        for policy in policies:
            log.warning("bench: policy %s, %d jobs", policy, len(trace))
            runs.append(run_policy(service, policy, trace, workers, drain_s))
        service.store.set_policy(None)
    return write_report(runs, workload, load if load is not None else workload.load, trace,
                        out_dir)


def wait_for_workers(store: JobStore, count: int, timeout_s: float = 90) -> None:

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for name in store.heartbeats() if name.startswith("w")) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{count} workers did not start in {timeout_s}s; see the run dir's logs")
