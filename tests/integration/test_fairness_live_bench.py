"""The live arm of the fairness bench (``app.bench.fairness_live``) on a real stack: a small
trace of two tenants, one flooding, submitted at its times to a fresh stack (embedded Redis,
two simulated-device workers, beat and the tick, fair share on); the figures it reports come
from that run's counters and records."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.fairness import run_figures
from app.bench.fairness_live import LiveFairness, arm_traces, run_live_arm, sim_config
from scheduler.lifecycle import SloClass
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SETUP = LiveFairness(tenants=2, workers=2, duration_s=4.0, drain_s=15.0, seeds=1)


def _light_interactive(trace: list) -> list:
    return [a for a in trace if a.tenant != "t0" and a.shape.slo is SloClass.INTERACTIVE]


def test_the_live_arm_reports_the_service_and_latencies_its_run_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given the first seed whose trace gives the light tenant two interactive jobs
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    seed = next(
        s
        for s in range(1, 50)
        if len(_light_interactive(arm_traces(SETUP, s, scaled=True)["fair"])) >= 2
    )
    trace = arm_traces(SETUP, seed, scaled=True)["fair"]
    # when it runs on a live stack with fair share on
    result, counters = run_live_arm(SETUP, trace, True, tmp_path / "run")
    figures = run_figures(trace, result, sim_config(SETUP, True))
    # then every job finished, and each tenant's service counters (the commit script's) agree
    # with its jobs' records and are at least the work its jobs declared
    assert figures["completed"] == figures["jobs"] == len(trace)
    end, records = counters["service_end_s"], counters["records_service_s"]
    assert set(end) == {"t0", "t1"} and end == pytest.approx(records, rel=1e-9)
    for tenant in end:
        declared = sum(sum(a.chunk_s) for a in trace if a.tenant == tenant)
        assert declared <= end[tenant] <= 2.0 * declared + 1.0, (tenant, declared, end)
    # and the served seconds were read once the arrivals had lasted their 4 s, before the end
    assert counters["served_read_at_s"] >= SETUP.duration_s
    assert all(0.0 < result.served_s[t] <= end[t] + 1e-9 for t in end), result.served_s
    # and the flooder, offering ten times the work, was served most of it
    assert figures["served_share"]["t0"] > 0.5
    assert 0.0 < figures["jain"] <= 1.0 + 1e-9
    # and the light tenant's p95 is a latency of the run: no shorter than its shortest job
    shortest = min(sum(a.chunk_s) for a in _light_interactive(trace))
    assert figures["light_interactive_p95_s"] >= shortest
    print(
        f"seed {seed}: {len(trace)} jobs, served {result.served_s}, end {end}, "
        f"p95 {figures['light_interactive_p95_s']:.3f}s, stack up in "
        f"{counters['stack_start_s']:.1f}s"
    )
