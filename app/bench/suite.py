"""The policy evaluation suite (SIMULATED): Stepline against every baseline and oracle, row by
row, on ``ClusterSim`` (the real ``plan_tick`` on a virtual clock), with a verdict per row.

Workloads: the mixed MIX (class targets as deadlines), the same mix with on/off bursts (same
mean rate), and heavy-tailed image services: lognormal (σ = 1.25) or truncated Pareto
(α = 1.7) service per batch item, times a batch size of 1-8, split into 20 steps, each job due
at a factor of its standalone time (its steps plus one dispatch hop each). A row's arrivals are
stretched so that its trace's own offered load is the row's load.

The grid (:data:`SUITE_ROWS`, 48 rows, ~2.5 min on one core) is not the cartesian product,
which would take hours on 2 cores:

- load sweep (0.5, 0.7, 0.9, 1.2, 1.5) on 8 workers for each workload (heavy-tailed: due at
  2×, smaller half interactive): the main comparison;
- deadline sweep (1.5×, 2×, 3×, 5×) × both class variants (all interactive; smaller half
  interactive, rest batch) for both heavy tails, on 8 workers at load 0.9, where slack matters;
- scale: 2 and 32 workers at loads 0.7 and 1.2 for the mix and the lognormal tail; 256 workers
  only at 1.5, mix and lognormal, ~2000 jobs: a few virtual seconds of arrivals (~10 s of wall
  time each), too short for a lower load to miss anything, and the mix's class targets are
  met by every policy even so (a check of the tick at scale more than of the policy);
- failures (a busy worker dies halfway through the arrivals): mix and lognormal on 8 workers
  at 0.9, and on 2 workers at 0.7, where one worker is half the cluster.

Verdict, per row (:func:`judge`): Stepline's deadline attainment ≥ the best non-oracle
baseline's − 1 point, its goodput ≥ 99 % of theirs, each class's p95 latency ≤ 1.10 × static
priority's, and its attainment ≥ 0.95 × the best oracle's. Every policy runs the same trace, so
the comparison is paired; the 95 % Wilson intervals are reported, not used to excuse a gap.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from app.bench.report import wilson_interval
from app.bench.sim_records import SimResult
from app.bench.sim_report import NOTE, SIM_POLICIES, group_metrics, simulate_policy
from app.bench.sim_workload import Shape, SimArrival, SimConfig, generate_trace, mix_mean_service_s
from app.bench.workload import Arrivals, arrival_times
from scheduler import JobKind, SloClass, Tier

SUITE_POLICIES = (*SIM_POLICIES, "oracle-edf", "oracle-srpt")
BASELINES = tuple(p for p in SIM_POLICIES if p != "stepline")
ORACLE_POLICIES = ("oracle-edf", "oracle-srpt")
CLASSES = ("realtime", "interactive", "batch")

ATTAINMENT_TOLERANCE = 0.01
"""Stepline may trail the best baseline's attainment by at most this (absolute)."""
GOODPUT_TOLERANCE = 0.01
"""... and its goodput by at most this share."""
P95_TOLERANCE = 0.10
"""Each class's p95 latency may exceed static priority's by at most this share."""
ORACLE_SHARE = 0.95
"""Stepline's attainment must reach this share of the best oracle's."""

STEPS = 20
"""Steps (chunks) of a heavy-tailed job: its service split evenly, with jitter."""
BLOCK_GROUPS = 2
BATCH_SIZES = range(1, 9)
"""A request's batch size, uniform: an image service's step cost scales with it."""
LOGNORMAL_MEDIAN_S = 0.4
LOGNORMAL_SIGMA = 1.25
PARETO_MIN_S = 0.15
PARETO_MAX_S = 15.0
PARETO_ALPHA = 1.7


class SuiteWorkload(str, Enum):
    """What arrives in a row."""

    MIXED = "mixed"
    """The simulator's MIX, Poisson arrivals, class targets as deadlines."""
    MIXED_BURSTY = "mixed-bursty"
    """The same mix, on/off modulated Poisson (bursts of 4× the rate), same mean rate."""
    LOGNORMAL = "lognormal"
    """Lognormal service per batch item (median 0.4 s, σ = 1.25) × batch size 1-8."""
    PARETO = "pareto"
    """Pareto service per batch item (α = 1.7 on [0.15 s, 15 s]) × batch size 1-8."""

    @property
    def heavy_tailed(self) -> bool:
        return self in (SuiteWorkload.LOGNORMAL, SuiteWorkload.PARETO)


class ClassSplit(str, Enum):
    """The classes of a heavy-tailed row's jobs."""

    INTERACTIVE = "interactive"
    """Every job interactive."""
    SPLIT = "split"
    """The smaller half of the trace's jobs interactive, the rest batch."""


@dataclass(frozen=True, slots=True)
class SuiteRow:
    """One row: a workload at an offered load (λ · E[service] / workers) on a cluster."""

    workload: SuiteWorkload
    load: float
    workers: int
    jobs: int = 300
    """Expected arrivals: the arrival window is ``jobs / λ`` (then stretched to the load)."""
    deadline_factor: float = 2.0
    """Heavy-tailed rows: each job is due at this × its standalone time."""
    classes: ClassSplit = ClassSplit.SPLIT
    fail: bool = False
    """A busy worker dies halfway through the arrivals."""
    seed: int = 1
    drain_s: float = 30.0

    @property
    def name(self) -> str:
        shape = (f" due {self.deadline_factor:g}x {self.classes.value}"
                 if self.workload.heavy_tailed else "")
        fail = " +fail" if self.fail else ""
        return f"{self.workload.value}{shape} ρ={self.load:g} w={self.workers}{fail}"


@dataclass(frozen=True, slots=True)
class Check:
    """One goal of the verdict, judged on one row."""

    goal: str
    passed: bool
    detail: str


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """A row's figures per policy (as :func:`policy_figures` writes them) and its verdict."""

    row: SuiteRow
    jobs: int
    offered_load: float
    figures: Mapping[str, Mapping[str, Any]]
    checks: tuple[Check, ...] = ()

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


# -- workloads ---------------------------------------------------------------------------------

def mean_service_s(workload: SuiteWorkload) -> float:
    """E[service] of one arrival: the mix's, or E[per item] × E[batch size]."""
    mean_batch = statistics.fmean(BATCH_SIZES)
    if workload is SuiteWorkload.LOGNORMAL:
        return LOGNORMAL_MEDIAN_S * math.exp(LOGNORMAL_SIGMA ** 2 / 2) * mean_batch
    if workload is SuiteWorkload.PARETO:
        return _bounded_pareto_mean(PARETO_MIN_S, PARETO_MAX_S, PARETO_ALPHA) * mean_batch
    return mix_mean_service_s()


def _bounded_pareto_mean(low: float, high: float, alpha: float) -> float:
    ratio = math.pow(low / high, alpha)
    return (math.pow(low, alpha) / (1 - ratio) * alpha / (alpha - 1)
            * (math.pow(low, 1 - alpha) - math.pow(high, 1 - alpha)))


def row_setup(row: SuiteRow,
              dispatch_overhead_s: float = 0.003) -> tuple[SimConfig, list[SimArrival]]:
    """The row's simulated run and seeded trace (every policy of the row sees exactly these
    jobs), its arrival instants stretched so that the trace's own offered load is the row's:
    with heavy tails (and the mix's rare long videos) a few hundred jobs' mean service strays
    far from the expected one."""
    rate_per_s = row.load * row.workers / mean_service_s(row.workload)
    config = SimConfig(workers=row.workers, rate_per_s=rate_per_s,
                       duration_s=row.jobs / rate_per_s, drain_s=row.drain_s, seed=row.seed,
                       dispatch_overhead_s=dispatch_overhead_s,
                       bursty=row.workload is SuiteWorkload.MIXED_BURSTY)
    if row.workload.heavy_tailed:
        trace = heavy_tailed_trace(config, row.workload, row.deadline_factor, row.classes)
    else:
        trace = generate_trace(config)
    stretch = trace_offered_load(trace, config) / row.load
    duration_s = config.duration_s * stretch
    config = replace(config, rate_per_s=rate_per_s / stretch, duration_s=duration_s,
                     fail_at_s=duration_s / 2 if row.fail else None)
    return config, [replace(a, arrival_s=a.arrival_s * stretch,
                            deadline_s=a.deadline_s + a.arrival_s * (stretch - 1))
                    for a in trace]


def heavy_tailed_trace(config: SimConfig, workload: SuiteWorkload, deadline_factor: float,
                       classes: ClassSplit) -> list[SimArrival]:
    """Poisson arrivals of batched image requests of heavy-tailed size, each due at
    ``deadline_factor`` × its standalone time."""
    rng = random.Random(config.seed)
    times = arrival_times(rng, Arrivals(), config.rate_per_s, config.duration_s)
    sizes_s = [_item_s(rng, workload) * rng.choice(BATCH_SIZES) for _ in times]
    smaller = set(sorted(range(len(sizes_s)), key=sizes_s.__getitem__)[:len(sizes_s) // 2])
    trace = []
    for index, (t, size_s) in enumerate(zip(times, sizes_s, strict=True)):
        interactive = classes is ClassSplit.INTERACTIVE or index in smaller
        slo = SloClass.INTERACTIVE if interactive else SloClass.BATCH
        tier = Tier.GOLD if rng.random() < config.gold_share else Tier.STANDARD
        chunk_s = tuple(size_s / STEPS * (1.0 + config.jitter * (2.0 * rng.random() - 1.0))
                        for _ in range(STEPS))
        budget_s = deadline_factor * (sum(chunk_s) + STEPS * config.dispatch_overhead_s)
        shape = Shape(workload.value, 0.0, slo, JobKind.SIMULATED, "simulated", STEPS,
                      size_s / STEPS, 1.0, BLOCK_GROUPS, deadline_s=budget_s)
        trace.append(SimArrival(index, t, shape, tier, chunk_s, t + budget_s))
    return trace


def _item_s(rng: random.Random, workload: SuiteWorkload) -> float:
    """One batch item's service: lognormal, or bounded Pareto by the inverse of its CDF."""
    if workload is SuiteWorkload.LOGNORMAL:
        return rng.lognormvariate(math.log(LOGNORMAL_MEDIAN_S), LOGNORMAL_SIGMA)
    tail = 1.0 - math.pow(PARETO_MIN_S / PARETO_MAX_S, PARETO_ALPHA)
    return PARETO_MIN_S / math.pow(1.0 - rng.random() * tail, 1.0 / PARETO_ALPHA)


def trace_offered_load(trace: Sequence[SimArrival], config: SimConfig) -> float:
    """The trace's own offered load: its work over the arrival window's worker-seconds (the
    expected λ · E[service] / workers, realised)."""
    work_s = sum(sum(a.chunk_s) for a in trace)
    return work_s / (config.duration_s * config.workers)


# -- the grid ------------------------------------------------------------------------------------

_W, _L, _P = SuiteWorkload, SuiteWorkload.LOGNORMAL, SuiteWorkload.PARETO
LOADS = (0.5, 0.7, 0.9, 1.2, 1.5)
DEADLINE_FACTORS = (1.5, 2.0, 3.0, 5.0)

SUITE_ROWS: tuple[SuiteRow, ...] = (
    *(SuiteRow(w, load, 8) for w in _W for load in LOADS),
    *(SuiteRow(w, 0.9, 8, deadline_factor=f, classes=c)
      for w in (_L, _P) for c in ClassSplit for f in DEADLINE_FACTORS
      if (f, c) != (2.0, ClassSplit.SPLIT)),
    *(SuiteRow(w, load, n, jobs=200 if n == 2 else 600)
      for w in (_W.MIXED, _L) for n in (2, 32) for load in (0.7, 1.2)),
    *(SuiteRow(w, 1.5, 256, jobs=2000, drain_s=15.0) for w in (_W.MIXED, _L)),
    *(SuiteRow(w, 0.9, 8, fail=True) for w in (_W.MIXED, _L)),
    *(SuiteRow(w, 0.7, 2, jobs=200, fail=True) for w in (_W.MIXED, _L)),
)
"""The full suite (``stepline simulate --suite``): see the module docstring for why these."""

SMALL_ROWS: tuple[SuiteRow, ...] = (
    SuiteRow(_W.MIXED, 1.2, 4, jobs=200),
    SuiteRow(_W.MIXED_BURSTY, 0.9, 8, jobs=200),
    SuiteRow(_L, 0.9, 4, jobs=150, deadline_factor=3.0),
    SuiteRow(_P, 1.2, 8, jobs=200, deadline_factor=2.0, classes=ClassSplit.INTERACTIVE),
    SuiteRow(_L, 0.7, 2, jobs=100, fail=True),
)
"""A handful of small rows for the unit test (2-8 workers, ≤ 200 jobs)."""


# -- running and judging -------------------------------------------------------------------------

def run_row(row: SuiteRow, policies: Sequence[str] = SUITE_POLICIES,
            dispatch_overhead_s: float = 0.003) -> RowOutcome:
    """Every policy on the row's trace, and the verdict when Stepline is among them."""
    config, trace = row_setup(row, dispatch_overhead_s)
    figures = {p: policy_figures(trace, config, simulate_policy(config, trace, p))
               for p in policies}
    outcome = RowOutcome(row, len(trace), trace_offered_load(trace, config), figures)
    return replace(outcome, checks=judge(figures)) if "stepline" in figures else outcome


def policy_figures(trace: Sequence[SimArrival], config: SimConfig,
                   result: SimResult) -> dict[str, Any]:
    """Per class and overall: attainment with its 95 % Wilson interval, p95 latency, goodput
    (jobs meeting their deadline per second of arrivals)."""
    groups = group_metrics(trace, result, config.duration_s, config.end_s)
    out: dict[str, Any] = {}
    for group, g in groups.items():
        decided = g["submitted"] - g["undecided"]
        ci = wilson_interval(g["met_slo"], decided)
        out[group] = {"jobs": g["submitted"], "decided": decided, "met": g["met_slo"],
                      "attainment": g["slo_attainment"],
                      "attainment_ci95": None if ci is None else list(ci),
                      "p95_latency_s": g["p95_latency_s"],
                      "goodput_jobs_per_s": g["goodput_jobs_per_s"]}
    return out


def judge(figures: Mapping[str, Mapping[str, Any]]) -> tuple[Check, ...]:
    """Stepline against the goals (module docstring); a goal whose yardstick did not run is
    not judged."""
    mine = figures["stepline"]
    checks = []
    baselines = [p for p in BASELINES if p in figures]
    if baselines:
        checks += _beats_baselines(mine["all"], {p: figures[p]["all"] for p in baselines})
    if "priority" in figures:
        checks += _p95_against(mine, figures["priority"])
    oracles = [p for p in ORACLE_POLICIES if p in figures]
    if oracles:
        best = max(oracles, key=lambda p: figures[p]["all"]["attainment"])
        bar = ORACLE_SHARE * figures[best]["all"]["attainment"]
        checks.append(Check(f"attainment >= {ORACLE_SHARE:g} x best oracle",
                            mine["all"]["attainment"] >= bar,
                            f"{_pct(mine['all']['attainment'])} vs {_pct(bar)} "
                            f"({ORACLE_SHARE:g} x {best})"))
    return tuple(checks)


def _beats_baselines(mine: Mapping[str, Any],
                     theirs: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    best = max(theirs, key=lambda p: theirs[p]["attainment"])
    att, best_att = mine["attainment"], theirs[best]["attainment"]
    fastest = max(theirs, key=lambda p: theirs[p]["goodput_jobs_per_s"])
    good, best_good = mine["goodput_jobs_per_s"], theirs[fastest]["goodput_jobs_per_s"]
    return [
        Check("attainment >= best baseline", att >= best_att - ATTAINMENT_TOLERANCE,
              f"{_pct(att)} vs {_pct(best_att)} ({best})"),
        Check("goodput >= best baseline", good >= best_good * (1 - GOODPUT_TOLERANCE),
              f"{good:.3f}/s vs {best_good:.3f}/s ({fastest})"),
    ]


def _p95_against(mine: Mapping[str, Any], priority: Mapping[str, Any]) -> list[Check]:
    checks = []
    for group in CLASSES:
        theirs = priority.get(group, {}).get("p95_latency_s")
        if theirs is None:
            continue  # priority completed none of the class: no yardstick
        own = mine.get(group, {}).get("p95_latency_s")
        passed = own is not None and own <= theirs * (1 + P95_TOLERANCE)
        shown = "none completed" if own is None else f"{own:.2f}s"
        checks.append(Check(f"{group} p95 <= {1 + P95_TOLERANCE:g} x priority", passed,
                            f"{shown} vs {theirs:.2f}s"))
    return checks


def suite_report(outcomes: Sequence[RowOutcome], wall_s: float | None = None) -> dict[str, Any]:
    """``suite.json``: the goals, then per row its settings, figures and verdict."""
    judged = [o for o in outcomes if o.checks]
    return {
        "simulated": True,
        "note": NOTE,
        "goals": {"attainment_tolerance": ATTAINMENT_TOLERANCE,
                  "goodput_tolerance": GOODPUT_TOLERANCE, "p95_tolerance": P95_TOLERANCE,
                  "oracle_share": ORACLE_SHARE,
                  "text": (__doc__ or "").split("Verdict, per row")[-1].strip()},
        "rows_passed": sum(o.passed for o in judged), "rows_judged": len(judged),
        "wall_s": wall_s,
        "rows": [_row_json(o) for o in outcomes],
    }


def _row_json(outcome: RowOutcome) -> dict[str, Any]:
    row = outcome.row
    return {
        "name": row.name, "workload": row.workload.value, "load": row.load,
        "workers": row.workers, "deadline_factor": row.deadline_factor if
        row.workload.heavy_tailed else None,
        "classes": row.classes.value if row.workload.heavy_tailed else None,
        "fail": row.fail, "seed": row.seed, "jobs": outcome.jobs,
        "trace_offered_load": outcome.offered_load, "policies": outcome.figures,
        "verdict": None if not outcome.checks else {
            "passed": outcome.passed,
            "checks": [{"goal": c.goal, "passed": c.passed, "detail": c.detail}
                       for c in outcome.checks]},
    }


def suite_table(outcomes: Sequence[RowOutcome]) -> Any:
    """One rich table: per row and policy, attainment [95 % CI] overall and per class, p95
    per class, goodput; the verdict on Stepline's line."""
    from rich.table import Column, Table

    table = Table("row", Column("policy", no_wrap=True), Column("met % [95% CI]", no_wrap=True),
                  Column("met % rt/int/batch", no_wrap=True),
                  Column("p95 s rt/int/batch", no_wrap=True), "goodput/s", "verdict",
                  title="SIMULATED policy suite")
    for outcome in outcomes:
        names = list(outcome.figures)
        for k, policy in enumerate(names):
            f = outcome.figures[policy]
            table.add_row(outcome.row.name if k == 0 else "", policy, _met(f["all"]),
                          "/".join(f"{100 * f[c]['attainment']:.1f}" if c in f else "-"
                                   for c in CLASSES),
                          "/".join(_s(f[c]["p95_latency_s"]) if c in f else "-"
                                   for c in CLASSES),
                          f"{f['all']['goodput_jobs_per_s']:.2f}",
                          _verdict(outcome) if policy == "stepline" else "",
                          end_section=k == len(names) - 1)
    return table


def _verdict(outcome: RowOutcome) -> str:
    if not outcome.checks:
        return ""
    failed = [c.goal for c in outcome.checks if not c.passed]
    return "PASS" if not failed else "FAIL: " + "; ".join(failed)


def _met(g: Mapping[str, Any]) -> str:
    ci = g["attainment_ci95"]
    bounds = f" [{100 * ci[0]:.0f}-{100 * ci[1]:.0f}]" if ci else ""
    return f"{100 * g['attainment']:.1f}{bounds}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
