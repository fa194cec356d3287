"""Figures of a benchmark run: SLO attainment (with 95 % intervals) and latency percentiles per
class, goodput, utilisation, idle capacity while work waited, cost-model error, preemption
latency, and each ratio against the fifo baseline of the same run."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.bench.driver import Outcome
from app.occupancy import IdleWhileWaiting, JobSpan, idle_while_waiting, running_intervals
from scheduler.lifecycle import JobState, SloClass
from tasks.record import JobRecord

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975: two-sided 95 % intervals."""

DEFINITIONS = {
    "slo_attainment_ci95": "95 % Wilson score interval of slo_attainment (jobs that met their "
                           "deadline / jobs; rejected, shed, failed and late jobs all miss)",
    "idle_while_waiting": "worker-seconds in which a worker held no job of the run while at "
                          "least one accepted job was runnable and waiting (submitted, not ended, "
                          "held by no worker: a chunked job between two chunks waits), from the "
                          "first submit to the last observed event; share_of_capacity divides by "
                          "workers x that window; servable_worker_s counts at most one idle "
                          "worker per waiting job",
    "estimate_error": "|first_estimate_s - service_s| / service_s over DONE jobs that have a "
                      "first estimate (the scheduler's estimate of the job's whole service at its "
                      "first release, against the service it received): p50, p95, count",
}
"""What the less obvious figures of ``report.json`` mean; written into it for its readers."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


_T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
          10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 19: 2.09, 29: 2.05}
"""Two-sided 95 % Student t quantiles by degrees of freedom (1.96 beyond the table's reach)."""


def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean and its 95 % t-interval (the interval collapses to the mean for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "lo": mean, "hi": mean}
    dof = len(values) - 1
    t = _T_975.get(dof) or next((v for k, v in sorted(_T_975.items()) if k >= dof), 1.96)
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "lo": mean - half, "hi": mean + half}


def median_ci(values: Sequence[float]) -> dict[str, float]:
    """Median and a distribution-free 95 % interval: the order statistics whose ranks bracket
    the median with probability ≥ 0.95 (binomial, normal approximation); min and max for fewer
    than six values, where no narrower interval reaches 95 %."""
    ordered = sorted(values)
    n = len(ordered)
    median = statistics.median(ordered)
    if n < 6:
        return {"median": median, "lo": ordered[0], "hi": ordered[-1]}
    half = Z_95 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half) - 1)
    hi = min(n - 1, math.ceil(n / 2 + half))
    return {"median": median, "lo": ordered[lo], "hi": ordered[hi]}


def wilson_interval(
    successes: int, trials: int, z: float = Z_95
) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (95 % by default); None for no trials.
    Unlike the normal approximation it stays inside [0, 1] and is sound at 0 % and 100 %."""
    if trials <= 0:
        return None
    p = successes / trials
    z2n = z * z / trials
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / trials + z2n / (4 * trials)) / (1 + z2n)
    return max(0.0, centre - half), min(1.0, centre + half)


def attainment(met: int, jobs: int) -> dict[str, Any]:
    """SLO attainment ``met / jobs`` and its 95 % Wilson interval (None for no jobs)."""
    ci = wilson_interval(met, jobs)
    return {"slo_attainment": met / jobs if jobs else None,
            "slo_attainment_ci95": None if ci is None else {"lo": ci[0], "hi": ci[1]}}


def estimate_error(records: Iterable[JobRecord]) -> dict[str, Any]:
    """Relative error of the cost model's first estimate, |first_estimate_s − service_s| ÷
    service_s: p50, p95 and the count of jobs it covers. Only DONE jobs with both figures count:
    a job that ended early never received the whole service the estimate was of."""
    errors = [abs(r.first_estimate_s - r.service_s) / r.service_s for r in records
              if r.state is JobState.DONE and r.first_estimate_s is not None and r.service_s > 0]
    return {"count": len(errors), "p50": percentile(errors, 50), "p95": percentile(errors, 95)}


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
            **attainment(met, len(mine)),
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
        **attainment(met, len(run.outcomes)),
        "completed": sum(1 for o in done if o.final_state == "DONE"),
        "makespan_s": makespan_s,
        "goodput_jobs_per_s": met / makespan_s,
        "worker_utilisation": service_s / (run.workers * makespan_s),
        "idle_while_waiting": idle_figures(run).as_json(),
        "estimate_error": estimate_error(run.records.values()),
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


def idle_figures(run: RunData) -> IdleWhileWaiting:
    """Idle worker-seconds while accepted jobs waited (:func:`occupancy.idle_while_waiting`),
    from the first submit to the last thing observed. Submit and end times are the store's (the
    client's where a record is missing); bench traces carry no dependencies, so a job is
    runnable from its submit."""
    accepted = [o for o in run.outcomes if o.job_id]
    until_s = _observed_until(run)
    spans = [_job_span(o, run.records.get(o.job_id or ""), run.events.get(o.job_id or "", []),
                       until_s) for o in accepted]
    start_s = min((s.runnable_at_s for s in spans), default=until_s)
    return idle_while_waiting(spans, run.workers, (start_s, until_s))


def _job_span(
    outcome: Outcome, record: JobRecord | None, events: list[dict[str, str]], until_s: float
) -> JobSpan:
    submitted_s = outcome.submitted_at if record is None else record.submitted_at_s
    finished_s = None if record is None else record.finished_at_s
    return JobSpan(runnable_at_s=submitted_s,
                   finished_at_s=outcome.finished_at if finished_s is None else finished_s,
                   running=tuple(running_intervals(events, until_s)))


def _observed_until(run: RunData) -> float:
    stamps = [float(e["ts"]) for events in run.events.values() for e in events]
    stamps += [o.finished_at for o in run.outcomes if o.finished_at is not None]
    stamps += [r.finished_at_s for r in run.records.values() if r.finished_at_s is not None]
    return max(stamps, default=max((o.submitted_at for o in run.outcomes), default=0.0))


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
    """Latency CDF per class, SLO attainment per class and policy (with its 95 % interval), a
    worker timeline."""
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
        ax.bar([x + i * width for x in range(3)], values, width, label=run.policy,
               yerr=_error_bars(values, [figures[s.value] for s in SloClass]), capsize=3)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(3)], [s.value for s in SloClass])
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.legend()
    written.append(_save(fig, out_dir / "slo_attainment.png"))
    for run in runs:
        written.append(_timeline(plt, run, out_dir / f"timeline_{run.policy}.png"))
    return written


def _error_bars(values: list[float], figures: list[dict[str, Any]]) -> list[list[float]]:
    """Distances from each bar down to its interval's low end and up to its high end."""
    ci = [f["slo_attainment_ci95"] or {"lo": v, "hi": v} for v, f in zip(values, figures,
                                                                           strict=True)]
    return [[v - c["lo"] for v, c in zip(values, ci, strict=True)],
            [c["hi"] - v for v, c in zip(values, ci, strict=True)]]


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
