"""The live fairness bench's trace scaling, its submissions and its summary (the live runs
themselves: ``tests/integration/test_fairness_live_bench.py``)."""

from __future__ import annotations

import pytest

from app.bench.fairness import fairness_trace
from app.bench.fairness_live import (
    LiveFairness,
    live_arrivals,
    scaled_trace,
    seed_row,
    side_by_side,
    sim_seed,
    summarise,
)
from scheduler.model import JobKind

TRACE = fairness_trace(3, 10.0, 1.3, 4, 40.0, seed=2)


def test_the_scaled_trace_keeps_the_jobs_tenants_and_load_on_a_faster_clock() -> None:
    scaled = scaled_trace(TRACE, 0.25, 0.1)
    assert [a.tenant for a in scaled] == [a.tenant for a in TRACE]
    for a, s in zip(TRACE, scaled, strict=True):
        assert s.arrival_s == pytest.approx(a.arrival_s * 0.25)
        assert s.deadline_s - s.arrival_s == pytest.approx((a.deadline_s - a.arrival_s) * 0.25)
        assert sum(s.chunk_s) == pytest.approx(sum(a.chunk_s) * 0.25)
        assert s.shape.kind is JobKind.SIMULATED and 1 <= len(s.chunk_s) <= a.shape.chunks
        assert len(s.chunk_s) == 1 or min(s.chunk_s) >= 0.1 - 1e-12


def test_each_scaled_job_is_submitted_as_its_steps_tenant_and_relative_deadline() -> None:
    scaled = scaled_trace(TRACE, 0.25, 0.1)
    for s, arrival in zip(scaled, live_arrivals(scaled), strict=True):
        assert arrival.tenant == s.tenant and arrival.tier == "standard"
        assert arrival.params["steps"] * arrival.params["step_ms"] / 1000.0 == pytest.approx(
            sum(s.chunk_s)
        )
        assert arrival.deadline_s == pytest.approx(s.deadline_s - s.arrival_s)


def test_a_seed_row_divides_the_light_p95_by_the_no_flood_one_and_jobs_by_the_unfair() -> None:
    def arm(p95: float, completed: int) -> dict:
        return {
            "light_interactive_p95_s": p95,
            "completed": completed,
            "jain": 0.9,
            "served_share": {"t0": 0.6},
            "fair_share": {"t0": 0.5},
        }

    row = seed_row(1, arm(3.0, 90), arm(6.0, 100), arm(2.0, 40))
    assert row["light_p95_ratio"] == 1.5 and row["light_p95_ratio_unfair"] == 3.0
    assert row["throughput_ratio"] == 0.9
    summary = summarise([row, seed_row(2, arm(2.0, 100), arm(6.0, 100), arm(2.0, 40))])
    assert summary["light_p95_ratio"]["mean"] == 1.25  # type: ignore[index]
    assert summary["light_p95_ratio"]["lo"] < 1.0 < summary["light_p95_ratio"]["hi"]  # type: ignore[index]


def test_the_simulated_sides_run_the_same_jobs_scaled_and_unscaled() -> None:
    setup = LiveFairness(tenants=2, workers=2, duration_s=5.0, drain_s=10.0, seeds=1)
    scaled, unscaled = sim_seed(setup, 1, scaled=True), sim_seed(setup, 1, scaled=False)
    assert scaled["fair"]["jobs"] == unscaled["fair"]["jobs"] > 0
    assert scaled["no_flood"]["jobs"] < scaled["fair"]["jobs"]
    report = {
        "summary": {
            side: summarise([row])
            for side, row in (("sim", scaled), ("live", scaled), ("sim_unscaled", unscaled))
        }
    }
    lines = side_by_side(report)
    assert len(lines) == 1 + len(report["summary"]["live"]) and "jain_fair" in lines[1]
