"""Workloads and traces: every shipped workload loads; arrivals hit the target load; traces
replay exactly; report figures are the ones a reader expects."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.driver import Outcome
from app.bench.report import percentile
from app.bench.workload import (
    WORKLOAD_DIR,
    Arrival,
    generate_trace,
    load_workload,
    read_trace,
    write_trace,
)
from scheduler.lifecycle import SloClass
from tasks.errors import InvalidJob

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("path", sorted(WORKLOAD_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_workload_loads_and_yields_arrivals(path: Path) -> None:
    workload = load_workload(path.stem)
    trace = generate_trace(workload, workers=2)
    assert trace and all(0 <= a.arrival_s < workload.duration_s for a in trace)
    assert [a.arrival_s for a in trace] == sorted(a.arrival_s for a in trace)


@pytest.mark.parametrize("process", ["poisson", "bursty"])
def test_the_arrival_rate_matches_the_target_load(process: str) -> None:
    # given the mixed workload over a long horizon, when a trace is generated at load 0.7
    workload = load_workload("mixed").model_copy(update={"seed": 3})
    workload.arrivals.process = process  # type: ignore[assignment]
    trace = generate_trace(workload, workers=4, load=0.7, duration_s=4000)
    # then λ · E[service] / workers is 0.7 within sampling noise
    rate_per_s = len(trace) / 4000
    assert rate_per_s * workload.mean_service_s() / 4 == pytest.approx(0.7, rel=0.1)


def test_a_trace_written_to_jsonl_replays_identically(tmp_path: Path) -> None:
    trace = generate_trace(load_workload("mixed"), workers=2, duration_s=20)
    write_trace(trace, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == trace


def test_a_bad_trace_line_is_rejected_with_its_line_number(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"arrival_s": 0, "kind": "simulated", "slo": "realtime",'
                                      ' "params": {}}\n{"arrival_s": "soon"}\n')
    with pytest.raises(InvalidJob, match=r"t\.jsonl:2"):
        read_trace(tmp_path / "t.jsonl")


def test_an_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(InvalidJob, match="mixed"):
        load_workload("no-such-workload")


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (
        50.0, 95.0, 99.0)
    assert percentile([], 95) is None


def test_latency_is_measured_from_the_client_submit_to_the_completion_read() -> None:
    arrival = Arrival(arrival_s=0, name="x", kind="simulated", slo=SloClass.REALTIME, params={})
    outcome = Outcome(arrival=arrival, job_id="j", submitted_at=10.0, finished_at=10.25)
    assert outcome.latency_s == pytest.approx(0.25)
