"""The many-model workload live: its jobs replayed on a running stack of the simulated device
(real worker processes holding each job's model as real tensor bytes under a device budget,
paying its declared load times; the real tick, the real release placement), and the same jobs
through ``ClusterSim`` on the same terms, so the simulated and the live attainment of one trace
can be compared.

The two runs share the jobs (``app.bench.models_workload``, scaled by its ``time_scale`` and
``byte_scale``), the budgets (models of the catalog's median size), the placement policy
(``scheduler.placement``), the eviction policy (the residency's ``lru`` or ``cost``), the tick
interval, and how long a chunk may stay parked on a busy worker (``affinity.max_wait``, or its
load elsewhere when longer); under the Stepline placement both count a waiting job's expected
load into its plan; with a host tier, both stage a model whose queue builds into host memory
(``scheduler.placement.stage``; live: the tick asks a worker's stager thread). Load times: each
live job declares
draws of its model's disk and host load times and of its adapters' (the simulator draws one per
load from the same distributions); the live worker pays the draws of the job that loads it.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.bench.driver import Outcome, replay
from app.bench.models_sim import (
    group_figures,
    models_config,
    paired_points,
    residency_for,
    with_scheduler,
)
from app.bench.models_workload import (
    Catalog,
    ModelJob,
    ModelsWorkload,
    generate_jobs,
    model_catalog,
)
from app.bench.report import percentile
from app.bench.run import tick_figures
from app.bench.sim_residency import Eviction
from app.bench.sim_workload import Shape, SimArrival, sim_policy
from app.bench.simulate import ClusterSim
from app.bench.workload import Arrival
from app.celery import configure as configure_celery
from app.stack import Stack
from scheduler import JobKind, PolicyConfig, Tier
from scheduler.lifecycle import JobState, SloClass
from tasks.routing import affinity_worker
from tasks.runtime import current_settings, settings_environment, store_client
from tasks.store import JobStore
from tasks.submit import JobService

COST_KEY = "simulated"
CLASSES = (SloClass.INTERACTIVE, SloClass.BATCH)
EVICTION: dict[str, Eviction] = {"oblivious": "lru", "warm": "lru", "stepline": "cost"}
"""The residency policy each placement runs with (as the simulator's comparison pairs them)."""
STAGE_MIN_QUEUED = 2
"""Jobs waiting for a model no worker holds before it is staged (both sides)."""
NOTE = ("live: real worker processes of the simulated device (model bytes real, load and step "
        "times declared and slept), the real tick and release placement; sim: ClusterSim on "
        "the same jobs, budgets and policies")


@dataclass(frozen=True, slots=True)
class LiveSetup:
    """One live-vs-sim comparison: the workload (already scaled), its models' budgets and the
    stack's knobs, shared by both sides."""

    workload: ModelsWorkload
    device_models: float = 3.0
    """Device budget per worker, in models of the catalog's median size."""
    host_models: float = 0.0
    """Host-memory budget per worker, likewise (0: no host tier)."""
    park_max_wait_s: float = 2.0
    """A chunk parked on a busy worker's own queue moves to its class queue after this (live
    ``affinity.max_wait``), in seconds of the scaled clock."""
    tick_s: float = 0.1
    """The live tick interval (``scheduler.origin_detection_interval``), simulated alike."""
    warmup: float = 0.0
    """Share of the first jobs run but not measured (memories start empty on both sides)."""
    chunk_lease_s: float = 2.0
    """The live chunk lease: a worker beats every third of it (and at once after a load), so
    placement reads what it holds and whether it is busy at most that late."""
    scheduler: Mapping[str, float] = field(default_factory=dict)
    """Scheduler settings both sides run with (``models_sim.SCHEDULER_FIELDS``: live as
    ``STEPLINE_SCHEDULER__<NAME>``), e.g. quanta scaled to the workload's job sizes."""
    hop_s: float | None = None
    """The overhead the simulator charges each chunk (None: its default, a hop measured on a
    quiet machine); :func:`compare` also runs it with the overhead the live run measured."""

    def budgets(self, catalog: Catalog) -> tuple[int, int]:
        """(device, host) bytes per worker, as ``models_sim.run_placement`` sizes them."""
        sizes = sorted(m.bytes for m in catalog.models)
        median = sizes[len(sizes) // 2]
        return max(int(self.device_models * median), sizes[-1]), int(self.host_models * median)


def live_arrivals(jobs: Sequence[ModelJob], catalog: Catalog, seed: int = 1) -> list[Arrival]:
    """The jobs as simulated-device submissions: one chunk per step of ``step_s``, the model's
    bytes, and draws of its load times (disk, host) and of each adapter's."""
    rng = random.Random(f"live-loads-{seed}")
    arrivals = []
    for job in jobs:
        spec = catalog.by_name[job.model]
        params: dict[str, Any] = {
            "steps": job.steps, "step_ms": job.step_s * 1000.0, "model": job.model,
            "model_bytes": spec.bytes,
            "load_ms": catalog.draw_load_s(rng, job.model, "disk") * 1000.0,
            "host_load_ms": catalog.draw_load_s(rng, job.model, "host") * 1000.0,
            "adapters": [{"name": a.replace("/", "."), "load_ms": catalog.draw_adapter_s(rng)
                          * 1000.0} for a in job.adapters],
        }
        arrivals.append(Arrival(arrival_s=job.arrival_s, name=job.model, kind="simulated",
                                slo=job.slo, params=params, deadline_s=job.slo_s))
    return arrivals


def sim_trace(jobs: Sequence[ModelJob]) -> list[SimArrival]:
    """The jobs in the simulator as the live stack sees them: simulated jobs under the
    ``simulated`` cost key (a unit is a second), steps exactly ``step_s``."""
    s_per_unit = PolicyConfig().new_cost_model().prior_s_per_unit(COST_KEY)
    return [SimArrival(job.index, job.arrival_s,
                       Shape(job.model, 0.0, job.slo, JobKind.SIMULATED, COST_KEY, job.steps,
                             job.step_s / s_per_unit, s_per_unit, 1, deadline_s=job.slo_s),
                       Tier.STANDARD, (job.step_s,) * job.steps, job.deadline_s, job.model,
                       job.adapters)
            for job in jobs]


def run_sim(setup: LiveSetup, placement: str, jobs: Sequence[ModelJob],
            catalog: Catalog) -> dict[str, Any]:
    """The jobs through ``ClusterSim`` under ``placement``: the figures of :func:`figures`."""
    device, host = setup.budgets(catalog)
    residency = residency_for(placement, catalog, device, host, setup.park_max_wait_s)
    residency = replace(residency, eviction=EVICTION[placement],
                        loads_in_plan=placement == "stepline",
                        stage=placement == "stepline" and host > 0,
                        stage_min_queued=STAGE_MIN_QUEUED)
    config = models_config(setup.workload, residency, jobs, setup.tick_s, setup.hop_s)
    trace = sim_trace(jobs)
    result = ClusterSim(config, trace, with_scheduler(sim_policy(config, "stepline"),
                                                      setup.scheduler)).run()
    finished = {a.index: result.finished_s[a.index] for a in trace}
    res = result.residency or {}
    per_100 = 100.0 / max(len(jobs), 1)
    return figures(measured(jobs, setup.warmup),
                   {j.index: (None if (f := finished[j.index]) is None
                              else f - j.arrival_s) for j in jobs}) | {
        "base_loads_per_100": per_100 * res.get("base_loads", 0),
        "host_loads_per_100": per_100 * res.get("host_loads", 0),
        "staged_per_100": per_100 * res.get("staged", 0),
        "adapter_loads_per_100": per_100 * res.get("adapter_loads", 0),
        "load_share_of_capacity": float(res.get("load_s", 0.0)) / max(result.capacity_s, 1e-9),
        "moves": result.moves,
    }


def run_live(setup: LiveSetup, placement: str, jobs: Sequence[ModelJob], catalog: Catalog,
             run_dir: Path | None = None, drain_s: float = 60.0) -> dict[str, Any]:
    """The jobs replayed on a fresh stack of ``setup.workload.workers`` simulated-device
    workers under ``placement``: the figures of :func:`figures`, with the loads the workers'
    heartbeats counted and the budgets they never exceeded."""
    device, host = setup.budgets(catalog)
    env = {
        "STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(device),
        "STEPLINE_RESIDENCY__HOST_MEMORY_BUDGET_BYTES": str(host),
        "STEPLINE_RESIDENCY__POLICY": EVICTION[placement],
        "STEPLINE_RESIDENCY__STAGE_MIN_QUEUED": str(STAGE_MIN_QUEUED),
        "STEPLINE_AFFINITY__PLACEMENT": placement,
        "STEPLINE_AFFINITY__MAX_WAIT": str(setup.park_max_wait_s),
        # every placement keeps a job's chunks on its worker, as the simulator's do
        "STEPLINE_AFFINITY__KINDS": '["text", "simulated"]',
        "STEPLINE_SCHEDULER__ORIGIN_DETECTION_INTERVAL": str(setup.tick_s),
        "STEPLINE_BROKER__CHUNK_LEASE": str(setup.chunk_lease_s),
        "STEPLINE_WARM_START": "false",
        **{f"STEPLINE_SCHEDULER__{name.upper()}": repr(float(value))
           for name, value in setup.scheduler.items()},
    }
    root = run_dir or Path(tempfile.mkdtemp(prefix="stepline-models-live-"))
    env["STEPLINE_RUN_DIR"] = str((root / placement).resolve())
    with settings_environment(env):
        settings = current_settings()
        configure_celery(settings)
        with Stack(settings=settings, run_dir=root / placement,
                   workers=setup.workload.workers, with_api=False, with_flower=False):
            service = JobService(JobStore(store_client(settings)), settings)
            _wait_for_workers(service, setup.workload.workers)
            arrivals = live_arrivals(jobs, catalog, setup.workload.seed)
            last_due = max((a.arrival_s + (a.deadline_s or 0.0) for a in arrivals), default=0)
            started, since = time.monotonic(), time.time()
            outcomes = replay(service, arrivals, drain_timeout_s=max(
                drain_s, last_due - max((a.arrival_s for a in arrivals), default=0) + 5))
            wall_s = time.monotonic() - started
            latencies = _latencies(service, jobs, outcomes)
            moves = _moves(service, outcomes)
            chunk_overhead = chunk_overhead_s(jobs, {
                job.index: service.store.events(outcome.job_id)
                for job, outcome in zip(jobs, outcomes, strict=True) if outcome.job_id})
            missed = _missed(service, jobs, outcomes, latencies, setup.warmup)
            beats = service.store.heartbeats().values()
            tick_ms, intervals_ms = tick_figures(service.store, since)
            residency = [b.residency for b in beats if b.residency]
    loads = sum(int(r.get("loads", {}).get(t, 0)) for r in residency for t in ("disk", "host"))
    load_s = sum(float(r.get("load_s", {}).get(t, 0.0)) for r in residency
                 for t in ("disk", "host")) + sum(float(r.get("adapter_load_s", 0.0))
                                                  for r in residency)
    per_100 = 100.0 / max(len(jobs), 1)
    return figures(measured(jobs, setup.warmup), latencies) | {
        "base_loads_per_100": per_100 * loads,
        "host_loads_per_100": per_100 * sum(int(r.get("loads", {}).get("host", 0))
                                            for r in residency),
        "staged_per_100": per_100 * sum(int(r.get("staged", 0)) for r in residency),
        "adapter_loads_per_100": per_100 * sum(int(r.get("adapter_loads", 0))
                                               for r in residency),
        "load_share_of_capacity": load_s / max(wall_s * setup.workload.workers, 1e-9),
        "peak_device_bytes": max((int(r.get("peak_device_bytes", 0)) for r in residency),
                                 default=0),
        "device_budget_bytes": device,
        "wall_s": wall_s,
        "moves": moves,
        "chunk_overhead_s": chunk_overhead,
        "missed": missed,
        "tick": {"ticks": len(tick_ms), "duration_ms": _quantiles(tick_ms),
                 "interval_ms": _quantiles(intervals_ms)},
    }


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p95 / p99 / max of ``values`` (nearest rank; None when there are none)."""
    return {"p50": percentile(values, 50), "p95": percentile(values, 95),
            "p99": percentile(values, 99), "max": percentile(values, 100)}


def _moves(service: Any, outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How the jobs' chunks moved, counted from their events: releases to a worker's own queue
    or to a class queue, parked chunks moved back, preemptions."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.job_id is None:
            continue
        for event in service.store.events(outcome.job_id):
            reason = str(event.get("reason", ""))
            if event.get("kind") != "state" or event.get("to") in ("RUNNING", "DONE", "PENDING"):
                continue
            if reason.startswith("next chunk "):
                queue = reason.rsplit(" ", 1)[-1]
                key = "hop to its worker" if affinity_worker(queue) else f"hop to {queue}"
            elif reason.startswith(("admitted to ", "released to ")):
                queue = reason.rsplit(" ", 1)[-1]
                what = "to a worker" if affinity_worker(queue) else "to its class queue"
                key = f"{reason.split(' ')[0]} {what}"
            elif reason.startswith("affinity:"):
                key = "parked, moved back"
            else:
                key = f"{event.get('to')}: {reason.split(';')[0].split(' on ')[0][:40]}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def chunk_overhead_s(jobs: Sequence[ModelJob], events: Mapping[int, Sequence[Mapping[str, Any]]]
                     ) -> dict[str, float | int | None]:
    """What a chunk cost beyond its declared step on the live stack, from the jobs' events:
    for each chunk after the first (the first pays the loads) whose successor started on the
    same worker with nothing run between (that gap shorter than half the shortest step), its
    start to the next chunk's start, less its step — the claim, the commit and the hop, as the
    stack runs them under this load (``events``: each job's events by its index). The median
    and the count (None: no such chunk)."""
    shortest = min((j.step_s for j in jobs), default=0.0)
    by_index = {job.index: job for job in jobs}
    samples: list[float] = []
    for index, trail in events.items():
        step_s = by_index[index].step_s
        states = [e for e in trail if e.get("kind") == "state"]
        for a, b, c in zip(states, states[1:], states[2:], strict=False):
            if a.get("to") != "RUNNING" or str(a.get("reason")) == "chunk 0" \
                    or b.get("to") != "QUEUED" or not str(b.get("reason", "")).startswith(
                        "next chunk ") or c.get("to") != "RUNNING" or c.get("by") != a.get("by"):
                continue
            started, queued, next_started = (float(e.get("ts", 0.0)) for e in (a, b, c))
            if next_started - queued < shortest / 2:
                samples.append(next_started - started - step_s)
    if not samples:
        return {"median": None, "chunks": 0}
    return {"median": statistics.median(samples), "chunks": len(samples)}


def _missed(service: Any, jobs: Sequence[ModelJob], outcomes: Sequence[Outcome],
            latencies: dict[int, float | None], warmup: float,
            limit: int = 20) -> list[dict[str, Any]]:
    """The first ``limit`` measured jobs that missed their deadline, each with its trail of
    state changes (seconds after submit, state, by whom, reason): where a miss came from."""
    by_index = {job.index: outcome for job, outcome in zip(jobs, outcomes, strict=True)}
    out: list[dict[str, Any]] = []
    for job in measured(jobs, warmup):
        done = latencies.get(job.index)
        outcome = by_index.get(job.index)
        if (done is not None and done <= job.slo_s + 1e-9) or outcome is None \
                or outcome.job_id is None:
            continue
        events = service.store.events(outcome.job_id)
        t0 = float(events[0].get("ts", 0.0)) if events else 0.0
        out.append({"index": job.index, "model": job.model, "slo": job.slo.value,
                    "slo_s": job.slo_s, "latency_s": done, "adapters": list(job.adapters),
                    "trail": [(round(float(e.get("ts", 0.0)) - t0, 3), e.get("to"), e.get("by"),
                               str(e.get("reason", ""))[:80])
                              for e in events if e.get("kind") == "state"]})
        if len(out) >= limit:
            break
    return out


def _wait_for_workers(service: Any, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for n in service.store.heartbeats() if n.startswith("w")) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{count} workers did not start in {timeout_s}s; see the run dir's logs")


def _latencies(service: Any, jobs: Sequence[ModelJob],
               outcomes: Sequence[Outcome]) -> dict[int, float | None]:
    """Per job, submit to finish as the store recorded it (None: not done)."""
    out: dict[int, float | None] = {}
    for job, outcome in zip(jobs, outcomes, strict=True):
        out[job.index] = None
        if outcome.job_id is None:
            continue
        record = service.store.record(outcome.job_id)
        if record.state is JobState.DONE and record.finished_at_s is not None:
            out[job.index] = record.finished_at_s - record.submitted_at_s
    return out


def measured(jobs: Sequence[ModelJob], warmup: float) -> list[ModelJob]:
    """The jobs after the first ``warmup`` share (by arrival)."""
    return list(jobs)[int(warmup * len(jobs)):]


def figures(jobs: Sequence[ModelJob], latency_s: dict[int, float | None]) -> dict[str, Any]:
    """Per class and overall: jobs done by their deadline (attainment, 95 % Wilson interval),
    p95 latency of the finished ones; and each measured job's latency (``latency_s``, by job
    index, None: not done), so the two sides can be compared job by job."""
    groups: dict[str, Any] = {}
    for name, picked in (("all", list(jobs)),
                         *((c.value, [j for j in jobs if j.slo is c]) for c in CLASSES)):
        met = sum(1 for j in picked if (done := latency_s.get(j.index)) is not None
                  and done <= j.slo_s + 1e-9)
        lat = sorted(v for j in picked if (v := latency_s.get(j.index)) is not None)
        groups[name] = group_figures(len(picked), met, lat)
    return {"groups": groups, "latency_s": {str(j.index): latency_s.get(j.index) for j in jobs}}


def compare(setup: LiveSetup, placements: Sequence[str] = ("stepline",),
            run_dir: Path | None = None) -> dict[str, Any]:
    """Each placement live and simulated on the same jobs: both sides' figures and the
    difference of their overall attainment, in points."""
    catalog = model_catalog(setup.workload)
    jobs = generate_jobs(setup.workload, catalog)
    rows: dict[str, Any] = {}
    for placement in placements:
        sim = run_sim(setup, placement, jobs, catalog)
        live = run_live(setup, placement, jobs, catalog, run_dir)
        row = {"live": live, "sim": sim,
               "attainment_gap_points": _gap_points(live, sim)}
        measured_hop = live["chunk_overhead_s"]["median"]
        if measured_hop is not None and setup.hop_s is None:
            # the same jobs again through the simulator, each chunk charged what the live stack
            # paid per chunk in this run (the machine's, under this load), not the default
            calibrated = run_sim(replace(setup, hop_s=measured_hop), placement, jobs, catalog)
            row |= {"sim_measured_hop": calibrated,
                    "attainment_gap_points_measured_hop": _gap_points(live, calibrated)}
        rows[placement] = row
    return {"note": NOTE, "jobs": len(jobs), "rows": rows}


def _gap_points(live: dict[str, Any], sim: dict[str, Any]) -> float:
    """Live less simulated overall attainment, in points."""
    a_live, a_sim = (f["groups"]["all"]["attainment"] or 0.0 for f in (live, sim))
    return 100.0 * (a_live - a_sim)


def paired_seeds(setup: LiveSetup, seeds: int, placements: Sequence[str] = (
        "stepline", "warm", "oblivious")) -> dict[str, Any]:
    """The live setup's workload through the simulator on ``seeds`` traces (the workload's seed
    and the next ones), every placement on the same jobs: per placement its attainment on each
    trace, and the first placement's paired difference from each other one (mean in points with
    its 95 % t-interval over the traces, and on how many it was ahead). A trace of a few
    hundred jobs moves a point on one job, so placements are compared over many."""
    by_placement: dict[str, list[float]] = {p: [] for p in placements}
    for k in range(seeds):
        workload = replace(setup.workload, seed=setup.workload.seed + k)
        catalog = model_catalog(workload)
        jobs = generate_jobs(workload, catalog)
        trace_setup = replace(setup, workload=workload)
        for placement in placements:
            attained = run_sim(trace_setup, placement, jobs, catalog)["groups"]["all"]
            by_placement[placement].append(100.0 * (attained["attainment"] or 0.0))
    first, *others = placements
    out: dict[str, Any] = {"seeds": seeds, "attainment": by_placement,
                           "mean": {p: statistics.fmean(v) for p, v in by_placement.items()}}
    for other in others:
        out[f"{first}_minus_{other}"] = paired_points(by_placement[first], by_placement[other],
                                                      scale=1.0)
    return out
