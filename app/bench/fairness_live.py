"""``stepline bench --fairness --live``: the fairness bench's trace on the live stack, beside
the simulator on the same trace.

Each seed's trace is :func:`app.bench.fairness.fairness_trace` at the live pool size, its clock
scaled by ``time_scale`` (arrivals, chunk times and deadlines alike, so the offered load stays),
and each job's work cut into no more chunks than leave each at least ``min_step_s`` (the live
stack pays a hop per chunk): ``simulated`` jobs of that many equal steps, one tier (standard).
That scaled trace runs

* live: a fresh stack per run (embedded Redis, ``workers`` simulated-device worker processes
  sleeping their steps, beat and the scheduler tick), the jobs submitted at their times;
* in ``ClusterSim`` on the same jobs, pool and tick (``sim``); and the unscaled trace of the
  original mix too (``sim_unscaled``, the simulation arm's figures at this pool size);

each with the fair order on and off (``scheduler.fair_share.enabled``, set explicitly) and the
light tenants' trace alone (fair order). The figures are the simulation arm's
(:func:`app.bench.fairness.run_figures`): live, a tenant's served worker-seconds are its
``sl:fair:service`` counters (the chunk seconds the commit script adds, every band) read when
the arrivals end; a job's latency is its record's submit to finish; completed jobs are those
done by the end of arrivals plus ``drain_s``, as in the simulator.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.driver import Outcome, replay
from app.bench.fairness import GOALS, fairness_trace, run_arm, run_figures
from app.bench.report import mean_ci
from app.bench.sim_records import SimResult
from app.bench.sim_workload import Shape, SimArrival, SimConfig
from app.bench.workload import Arrival
from app.celery import configure as configure_celery
from app.stack import Stack
from scheduler import JobKind, PolicyConfig, Tier
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.runtime import current_settings, settings_environment, store_client
from tasks.store import JobStore
from tasks.submit import JobService

COST_KEY = "simulated"
NOTE = (
    "live: real worker processes of the simulated device (steps slept), the real tick and "
    "embedded Redis, on this machine; sim: ClusterSim on the same scaled jobs; "
    "sim_unscaled: the simulation arm's mix and clock at this pool size"
)
ARMS = ("fair", "unfair", "no_flood")


@dataclass(frozen=True, slots=True)
class LiveFairness:
    """One live fairness bench: the trace's shape and the live stack's scale."""

    tenants: int = 4
    flood: float = 10.0
    load: float = 1.3
    workers: int = 3
    duration_s: float = 15.0
    """Seconds of arrivals on the live (scaled) clock."""
    drain_s: float = 15.0
    """After the arrivals, seconds the jobs may still finish in (both sides)."""
    seeds: int = 3
    time_scale: float = 0.25
    min_step_s: float = 0.1
    tick_s: float = 0.1

    def unscaled_duration_s(self) -> float:
        return self.duration_s / self.time_scale


def scaled_trace(
    trace: Sequence[SimArrival], time_scale: float, min_step_s: float
) -> list[SimArrival]:
    """The trace on a clock ``time_scale`` as fast, each job ``simulated`` equal steps of its
    scaled work, as many as its chunks but none shorter than ``min_step_s`` (at least one)."""
    s_per_unit = PolicyConfig().new_cost_model().prior_s_per_unit(COST_KEY)
    out = []
    for a in trace:
        work_s = sum(a.chunk_s) * time_scale
        steps = max(1, min(a.shape.chunks, int(work_s // min_step_s)))
        step_s = work_s / steps
        shape = Shape(
            a.shape.name,
            a.shape.share,
            a.shape.slo,
            JobKind.SIMULATED,
            COST_KEY,
            steps,
            step_s / s_per_unit,
            s_per_unit,
            1,
        )
        out.append(
            SimArrival(
                a.index,
                a.arrival_s * time_scale,
                shape,
                Tier.STANDARD,
                (step_s,) * steps,
                a.deadline_s * time_scale,
                tenant=a.tenant,
            )
        )
    return out


def live_arrivals(trace: Sequence[SimArrival]) -> list[Arrival]:
    """The scaled trace as the driver submits it: one ``simulated`` job per arrival."""
    return [
        Arrival(
            arrival_s=a.arrival_s,
            name=a.shape.name,
            kind="simulated",
            slo=a.shape.slo,
            deadline_s=a.deadline_s - a.arrival_s,
            tenant=a.tenant or "default",
            tier=Tier.STANDARD.value,
            params={"steps": len(a.chunk_s), "step_ms": a.chunk_s[0] * 1000.0, "block_groups": 1},
        )
        for a in trace
    ]


def stack_env(setup: LiveFairness, fair: bool, run_dir: Path) -> dict[str, str]:
    return {
        "STEPLINE_SCHEDULER__FAIR_SHARE__ENABLED": "true" if fair else "false",
        "STEPLINE_SCHEDULER__ORIGIN_DETECTION_INTERVAL": str(setup.tick_s),
        "STEPLINE_WARM_START": "false",
        "STEPLINE_RUN_DIR": str(run_dir.resolve()),
    }


def tenant_service_s(client: Any) -> dict[str, float]:
    """``sl:fair:service`` summed per tenant over bands and tiers."""
    out: dict[str, float] = {}
    for name, value in client.hgetall(keys.FAIR_SERVICE).items():
        parts = name.decode().split("\t")
        if len(parts) == 3:
            out[parts[1]] = out.get(parts[1], 0.0) + float(value)
    return out


@dataclass
class _Snapshot:
    """The service counters read once the arrivals have lasted ``at_s`` (during the replay)."""

    client: Any
    start: float
    at_s: float
    served: dict[str, float] | None = None
    read_at_s: float | None = None

    def __call__(self, _outcomes: list[Outcome]) -> None:
        if self.served is None and (now := time.monotonic() - self.start) >= self.at_s:
            self.served, self.read_at_s = tenant_service_s(self.client), now

    def final(self) -> dict[str, float]:
        """The counters read then, or now when the replay ended (every job done) before."""
        if self.served is None:
            self.served = tenant_service_s(self.client)
            self.read_at_s = time.monotonic() - self.start
        return self.served


def run_live_arm(
    setup: LiveFairness, trace: Sequence[SimArrival], fair: bool, run_dir: Path
) -> tuple[SimResult, dict[str, Any]]:
    """The scaled trace on a fresh stack: the outcome as the simulator reports one (finished
    instants on the trace's clock, served worker-seconds per tenant while arrivals lasted) and
    the run's own counters (when the service was read, the counters at the end, the records'
    service, wall time)."""
    began = time.monotonic()
    with settings_environment(stack_env(setup, fair, run_dir)):
        settings = current_settings()
        configure_celery(settings)
        with Stack(
            settings=settings,
            run_dir=run_dir,
            workers=setup.workers,
            with_api=False,
            with_flower=False,
        ):
            service = JobService(JobStore(store_client(settings)), settings)
            _wait_for_workers(service, setup.workers)
            up_s = time.monotonic() - began
            result, counters = _replay_and_read(setup, trace, service)
    return result, counters | {"stack_start_s": up_s}


def _replay_and_read(
    setup: LiveFairness, trace: Sequence[SimArrival], service: JobService
) -> tuple[SimResult, dict[str, Any]]:
    arrivals = live_arrivals(trace)
    last = max((a.arrival_s for a in arrivals), default=0.0)
    snapshot = _Snapshot(service.store.redis, time.monotonic(), setup.duration_s)
    started, wall_start = snapshot.start, time.time()
    outcomes = replay(
        service,
        arrivals,
        on_progress=snapshot,
        drain_timeout_s=max(setup.duration_s + setup.drain_s - last, 1.0),
    )
    wall_s = time.monotonic() - started
    served = snapshot.final()
    horizon = wall_start + setup.duration_s + setup.drain_s
    finished, records_s = _finished(service, trace, outcomes, horizon)
    result = SimResult(
        finished_s=finished,
        status=[],
        busy_s=0.0,
        overhead_s=0.0,
        lost_s=0.0,
        capacity_s=setup.workers * (setup.duration_s + setup.drain_s),
        served_s=dict(served),
        wall_s=wall_s,
    )
    return result, {
        "served_read_at_s": snapshot.read_at_s,
        "service_end_s": tenant_service_s(service.store.redis),
        "records_service_s": records_s,
        "wall_s": wall_s,
        "rejected": sum(o.rejected is not None for o in outcomes),
    }


def _finished(
    service: JobService, trace: Sequence[SimArrival], outcomes: Sequence[Outcome], horizon: float
) -> tuple[list[float | None], dict[str, float]]:
    """Per job, its finish on the trace's clock (its arrival plus its record's submit-to-finish;
    None: not done by ``horizon``), and each tenant's service as its records count it."""
    finished: list[float | None] = [None] * len(trace)
    served: dict[str, float] = {}
    for n, (a, outcome) in enumerate(zip(trace, outcomes, strict=True)):
        if outcome.job_id is None:
            continue
        record = service.store.record(outcome.job_id)
        served[a.tenant or ""] = served.get(a.tenant or "", 0.0) + record.service_s
        end = record.finished_at_s
        if record.state is JobState.DONE and end is not None and end <= horizon:
            finished[n] = a.arrival_s + end - record.submitted_at_s
    return finished, served


def _wait_for_workers(service: JobService, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = service.store.heartbeats()
        tick = any(n.startswith("scheduler") for n in beats)
        if tick and sum(1 for n in beats if n.startswith("w")) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{count} workers did not start in {timeout_s}s; see the run dir's logs")


def seed_row(
    seed: int, fair: dict[str, Any], unfair: dict[str, Any], alone: dict[str, Any]
) -> dict[str, Any]:
    """One seed's arms and its ratios (as the simulation arm reports them)."""
    base = alone["light_interactive_p95_s"]

    def over_base(arm: dict[str, Any]) -> float | None:
        return (arm["light_interactive_p95_s"] or 0.0) / base if base else None

    return {
        "seed": seed,
        "fair": fair,
        "unfair": unfair,
        "no_flood": alone,
        "light_p95_ratio": over_base(fair),
        "light_p95_ratio_unfair": over_base(unfair),
        "throughput_ratio": fair["completed"] / max(unfair["completed"], 1),
    }


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Mean and 95 % t-interval over the seeds of each figure the table shows."""

    def ci(values: Sequence[float | None]) -> dict[str, float] | None:
        kept = [v for v in values if v is not None]
        return mean_ci(kept) if kept else None

    return {
        "jain_fair": ci([r["fair"]["jain"] for r in runs]),
        "jain_unfair": ci([r["unfair"]["jain"] for r in runs]),
        "light_p95_ratio": ci([r["light_p95_ratio"] for r in runs]),
        "light_p95_ratio_unfair": ci([r["light_p95_ratio_unfair"] for r in runs]),
        "throughput_ratio": ci([r["throughput_ratio"] for r in runs]),
        "flood_served_share_fair": ci([r["fair"]["served_share"].get("t0") for r in runs]),
        "flood_served_share_unfair": ci([r["unfair"]["served_share"].get("t0") for r in runs]),
        "flood_fair_share": ci([r["fair"]["fair_share"].get("t0") for r in runs]),
    }


def traces(setup: LiveFairness, seed: int) -> dict[str, list[SimArrival]]:
    """The seed's unscaled traces (with the flood, and the light tenants alone)."""
    args = (
        setup.tenants,
        setup.flood,
        setup.load,
        setup.workers,
        setup.unscaled_duration_s(),
        seed,
    )
    return {"flood": fairness_trace(*args), "quiet": fairness_trace(*args, with_flood=False)}


def sim_config(setup: LiveFairness, scaled: bool) -> SimConfig:
    scale = 1.0 if scaled else 1.0 / setup.time_scale
    return SimConfig(
        workers=setup.workers,
        duration_s=setup.duration_s * scale,
        drain_s=setup.drain_s * scale,
        tick_s=setup.tick_s,
    )


def arm_traces(setup: LiveFairness, seed: int, scaled: bool) -> dict[str, list[SimArrival]]:
    drawn = traces(setup, seed)
    if scaled:
        drawn = {k: scaled_trace(v, setup.time_scale, setup.min_step_s) for k, v in drawn.items()}
    return {"fair": drawn["flood"], "unfair": drawn["flood"], "no_flood": drawn["quiet"]}


def sim_seed(setup: LiveFairness, seed: int, scaled: bool) -> dict[str, Any]:
    """One seed's three arms in the simulator (``scaled``: the live jobs; else the mix)."""
    config = sim_config(setup, scaled)
    arms = arm_traces(setup, seed, scaled)
    figures = {
        arm: run_figures(t, run_arm(t, config, arm != "unfair"), config) for arm, t in arms.items()
    }
    return seed_row(seed, figures["fair"], figures["unfair"], figures["no_flood"])


def live_seed(setup: LiveFairness, seed: int, root: Path) -> dict[str, Any]:
    """One seed's three arms, each on a fresh live stack."""
    arms = arm_traces(setup, seed, scaled=True)
    figures, counters = {}, {}
    for arm, trace in arms.items():
        result, counters[arm] = run_live_arm(
            setup, trace, arm != "unfair", root / f"seed{seed}-{arm}"
        )
        figures[arm] = run_figures(trace, result, sim_config(setup, True))
    row = seed_row(seed, figures["fair"], figures["unfair"], figures["no_flood"])
    return row | {"counters": counters}


def run_live_fairness(
    setup: LiveFairness, run_dir: Path | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The bench (module docstring): per side its seeds and summary, and the load average."""
    if not 2 <= setup.tenants <= 8:
        raise ValueError("tenants must be 2..8")
    started = time.perf_counter()
    root = run_dir or Path(tempfile.mkdtemp(prefix="stepline-fair-live-"))
    load_before = os.getloadavg()
    sides: dict[str, list[dict[str, Any]]] = {"live": [], "sim": [], "sim_unscaled": []}
    for seed in range(1, setup.seeds + 1):
        sides["sim"].append(sim_seed(setup, seed, scaled=True))
        sides["sim_unscaled"].append(sim_seed(setup, seed, scaled=False))
        sides["live"].append(live_seed(setup, seed, root))
        if progress is not None:
            progress(seed_line(seed, sides))
    return {
        "note": NOTE,
        "setup": _setup_json(setup),
        "goals": GOALS,
        "jobs": {side: [r["fair"]["jobs"] for r in rows] for side, rows in sides.items()},
        "summary": {side: summarise(rows) for side, rows in sides.items()},
        "runs": sides,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "wall_s": time.perf_counter() - started,
    }


def _setup_json(setup: LiveFairness) -> dict[str, Any]:
    return {name: getattr(setup, name) for name in setup.__dataclass_fields__}


def seed_line(seed: int, sides: dict[str, list[dict[str, Any]]]) -> str:
    """One printed line per seed: Jain's index fair / unfair on each side."""
    parts = [
        f"{side} Jain {rows[-1]['fair']['jain']:.3f} / {rows[-1]['unfair']['jain']:.3f}, "
        f"light p95 ratio {rows[-1]['light_p95_ratio'] or 0:.2f}"
        for side, rows in sides.items()
    ]
    return f"seed {seed}: " + "; ".join(parts)


def side_by_side(report: dict[str, Any]) -> list[str]:
    """Each summary figure, sim beside live (mean [95 % interval])."""

    def fmt(value: dict[str, float] | None) -> str:
        return (
            "-" if value is None else f"{value['mean']:.3f} [{value['lo']:.3f}, {value['hi']:.3f}]"
        )

    summary = report["summary"]
    lines = [f"{'figure':<26} {'sim (same jobs)':<26} {'live':<26} sim (unscaled mix)"]
    for key in summary["live"]:
        lines.append(
            f"{key:<26} {fmt(summary['sim'][key]):<26} "
            f"{fmt(summary['live'][key]):<26} {fmt(summary['sim_unscaled'][key])}"
        )
    return lines
