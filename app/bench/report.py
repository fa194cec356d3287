"""Figures of a benchmark run: SLO attainment and latency percentiles per class, goodput,
utilisation, preemption latency, and each ratio against the fifo baseline of the same run."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.bench.driver import Outcome
from scheduler.lifecycle import SloClass
from tasks.record import JobRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def met_slo(outcome: Outcome, record: JobRecord | None) -> bool:
    """Done before the job's deadline, timed from the client (rejected, shed, failed and late
    jobs all miss); the record gives the deadline the job was submitted with."""
    if outcome.final_state != "DONE" or outcome.finished_at is None or record is None:
        return False
    deadline_s = record.deadline_at_s - record.submitted_at_s
    return outcome.finished_at - outcome.submitted_at <= deadline_s


@dataclass
class RunData:
    """Everything measured for one policy."""

    policy: str
    outcomes: list[Outcome]
    records: dict[str, JobRecord]
    """The stored record of each accepted job, by job id, read once the run has drained."""
    events: dict[str, list[dict[str, str]]]
    workers: int
    overhead_ms_per_hop: float | None
    step_ms_of_probe: float
    tick_ms: list[float]
    tick_intervals_ms: list[float]
    checkpoint_cache: dict[str, int] = field(default_factory=dict)
    """Hits and misses of the workers' local checkpoint caches during the run."""


def class_figures(run: RunData) -> dict[str, Any]:
    by_class: dict[str, list[Outcome]] = defaultdict(list)
    for o in run.outcomes:
        by_class[o.arrival.slo.value].append(o)
    figures = {}
    for slo in SloClass:
        mine = by_class.get(slo.value, [])
        lat = [o.latency_s for o in mine if o.latency_s is not None and o.final_state == "DONE"]
        met = sum(met_slo(o, run.records.get(o.job_id or "")) for o in mine)
        figures[slo.value] = {
            "count": len(mine),
            "slo_attainment": met / len(mine) if mine else None,
            "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95),
            "p99_s": percentile(lat, 99),
            "rejected": sum(1 for o in mine if o.rejected),
            "expired": sum(1 for o in mine if o.final_state == "EXPIRED"),
        }
    return figures


def run_figures(run: RunData) -> dict[str, Any]:
    done = [o for o in run.outcomes if o.finished_at is not None]
    start = min((o.submitted_at for o in run.outcomes), default=0.0)
    end = max((o.finished_at or 0.0 for o in done), default=start)
    makespan_s = max(end - start, 1e-9)
    service_s = sum(r.service_s for r in run.records.values())
    met = sum(met_slo(o, run.records.get(o.job_id or "")) for o in run.outcomes)
    short = [o.latency_s for o in done if o.arrival.slo is not SloClass.BATCH
             and o.latency_s is not None]
    first_step = [r.started_at_s - r.submitted_at_s for r in run.records.values()
                  if r.slo is SloClass.REALTIME and r.started_at_s is not None]
    hop = run.overhead_ms_per_hop
    return {
        "classes": class_figures(run),
        "jobs": len(run.outcomes),
        "completed": sum(1 for o in done if o.final_state == "DONE"),
        "makespan_s": makespan_s,
        "goodput_jobs_per_s": met / makespan_s,
        "worker_utilisation": service_s / (run.workers * makespan_s),
        "short_jobs_p95_s": percentile(short, 95),
        "short_jobs_p50_s": percentile(short, 50),
        "preemptions": sum(r.preemptions for r in run.records.values()),
        "realtime_first_step_s": {"p50": percentile(first_step, 50),
                                  "p99": percentile(first_step, 99)},
        "overhead_ms_per_hop": hop,
        "overhead_pct_of_step": None if hop is None else 100 * hop / run.step_ms_of_probe,
        "tick_ms": {"p50": percentile(run.tick_ms, 50), "p99": percentile(run.tick_ms, 99),
                    "count": len(run.tick_ms)},
        "tick_interval_jitter_ms": (statistics.pstdev(run.tick_intervals_ms)
                                    if len(run.tick_intervals_ms) > 1 else None),
        "checkpoint_cache_hit_rate": _hit_rate(run.checkpoint_cache),
    }


def _hit_rate(counts: dict[str, int]) -> float | None:
    total = counts.get("hits", 0) + counts.get("misses", 0)
    return counts.get("hits", 0) / total if total else None


def ratios_against(baseline: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other / baseline`` for the headline figures (below 1 is better for latencies)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or a == 0 else b / a

    out: dict[str, Any] = {
        "short_jobs_p95": ratio(baseline["short_jobs_p95_s"], other["short_jobs_p95_s"]),
        "goodput": ratio(baseline["goodput_jobs_per_s"], other["goodput_jobs_per_s"]),
    }
    for slo in SloClass:
        b, o = baseline["classes"][slo.value], other["classes"][slo.value]
        out[slo.value] = {"p95": ratio(b["p95_s"], o["p95_s"]),
                          "slo_attainment": ratio(b["slo_attainment"], o["slo_attainment"])}
    return out


def plot(runs: list[RunData], out_dir: Path) -> list[str]:
    """Latency CDF per class, SLO attainment per class and policy, a worker timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, slo in zip(axes, SloClass, strict=True):
        for run in runs:
            lat = sorted(o.latency_s for o in run.outcomes
                         if o.arrival.slo is slo and o.latency_s is not None)
            if lat:
                ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=run.policy)
        ax.set_title(f"{slo.value} latency CDF")
        ax.set_xlabel("latency (s)")
        ax.set_xscale("log")
        ax.legend()
    written.append(_save(fig, out_dir / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        figures = class_figures(run)
        values = [figures[s.value]["slo_attainment"] or 0.0 for s in SloClass]
        ax.bar([x + i * width for x in range(3)], values, width, label=run.policy)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(3)], [s.value for s in SloClass])
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.legend()
    written.append(_save(fig, out_dir / "slo_attainment.png"))
    for run in runs:
        written.append(_timeline(plt, run, out_dir / f"timeline_{run.policy}.png"))
    return written


def _timeline(plt: Any, run: RunData, path: Path) -> str:
    colors = {"realtime": "tab:red", "interactive": "tab:orange", "batch": "tab:blue"}
    fig, ax = plt.subplots(figsize=(14, 3 + 0.3 * run.workers))
    t0 = min((o.submitted_at for o in run.outcomes), default=0.0)
    lanes: dict[str, int] = {}
    for job_id, events in run.events.items():
        record = run.records.get(job_id)
        slo = record.slo.value if record is not None else "batch"
        for e in events:
            if e["kind"] == "commit":
                lane = lanes.setdefault(e["by"], len(lanes))
                end = float(e["ts"]) - t0
                ax.barh(lane, float(e["service_s"]), left=end - float(e["service_s"]),
                        color=colors.get(slo, "grey"), height=0.8)
            elif e["kind"] == "state" and e["to"] == "PREEMPTED":
                lane = lanes.setdefault(e["by"], len(lanes))
                ax.plot(float(e["ts"]) - t0, lane, marker="v", color="black")
    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_xlabel("seconds since first arrival (red realtime, orange interactive, blue batch, "
                  "▼ preemption)")
    ax.set_title(f"worker occupancy — {run.policy}")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name
