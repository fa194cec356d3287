"""The GenTD26 reader and the trace benchmark, on small files of the trace's columns written
here: requests become jobs with their own models, adapters, run times and arrival bursts
compressed to a load; loads draw from the latency files; the held-out rows stay out."""

from __future__ import annotations

import itertools
import json
import math
import random
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.bench.gentd26 import (
    HELD_OUT_FROM,
    LATENCY_FILES,
    QUANTILE_BAND,
    REQUEST_FILE,
    TraceError,
    TraceWindow,
    quantile,
    read_latencies,
    read_requests,
    window_jobs,
    window_starts,
    window_summary,
)
from app.bench.trace_bench import run_trace_bench
from scheduler.lifecycle import SloClass
from tests.gentd26_files import request, synthetic_trace, write_latencies, write_requests


def test_requests_are_read_in_creation_order_and_unusable_rows_kept_out(tmp_path: Path) -> None:
    # given rows out of order, one failed, one without steps, one without a model
    t = datetime(2024, 11, 21, 10)
    write_requests(tmp_path, [
        request(t + timedelta(seconds=5), model="M0002", loras=1),
        request(t, exec_s=12.5, images=4.0),
        request(t + timedelta(seconds=9), status="FAILED"),
        request(t + timedelta(seconds=9), steps=""),
        request(t + timedelta(seconds=9), model=""),
    ])
    # when read
    got = read_requests(tmp_path)
    # then by creation time, each field parsed, and only the first two usable
    assert [r.created for r in got][:2] == [t, t + timedelta(seconds=5)]
    first = got[0]
    assert (first.exec_s, first.images, first.steps, first.model, first.loras) == (
        12.5, 4, 30, "M0001", 0)
    assert [r.usable for r in got] == [True, True, False, False, False]


def test_a_request_file_missing_a_column_or_with_a_bad_date_is_refused_by_name(
        tmp_path: Path) -> None:
    (tmp_path / REQUEST_FILE).write_text("gmt_create,predict_status\n2024-11-20 00:00:00,OK\n")
    with pytest.raises(TraceError, match=r"missing columns .*exec_time_seconds"):
        read_requests(tmp_path)
    write_requests(tmp_path, [request(datetime(2024, 11, 20)), ["yesterday", *["x"] * 10]])
    with pytest.raises(TraceError, match=r":3: gmt_create 'yesterday'"):
        read_requests(tmp_path / REQUEST_FILE)
    with pytest.raises(TraceError, match="no GenTD26 request file"):
        read_requests(tmp_path / "nowhere")


def test_latencies_are_seconds_without_zeros_and_the_required_files_must_exist(
        tmp_path: Path) -> None:
    write_latencies(tmp_path, {"base": [2500, 0, "NULL", 1000], "adapter": [4000]})
    got = read_latencies(tmp_path)
    assert got.base_s == (1.0, 2.5) and got.adapter_s == (4.0,) and got.pipeline_s == ()
    assert got.summary()["base"]["p50"] == pytest.approx(1.75)
    (tmp_path / LATENCY_FILES["adapter"]).unlink()
    with pytest.raises(TraceError, match="lora_update_latency_anon"):
        read_latencies(tmp_path)


def test_a_window_becomes_jobs_at_the_offered_load_with_the_trace_s_bursts(
        tmp_path: Path) -> None:
    # given a bursty trace and a window of 60 of its requests on 3 workers at load 0.7
    synthetic_trace(tmp_path)
    requests, samples = read_requests(tmp_path), read_latencies(tmp_path)
    window = TraceWindow(jobs=60, workers=3, load=0.7, time_scale=0.5, steps=10, slo_x=3.0)
    # when it becomes jobs
    catalog, jobs = window_jobs(requests, samples, window)
    picked = [r for r in requests if r.usable][:60]
    # then the offered compute load is 0.7: the work over the workers and the span
    work = sum(j.exec_s for j in jobs)
    span = (jobs[-1].arrival_s - jobs[0].arrival_s) * len(jobs) / (len(jobs) - 1)
    assert work / (3 * span) == pytest.approx(0.7)
    # and the arrivals are the trace's, compressed by one factor (bursts stay bursts)
    offsets = [(r.created - picked[0].created).total_seconds() for r in picked]
    factor = jobs[-1].arrival_s / offsets[-1]
    assert all(j.arrival_s == pytest.approx(o * factor) for j, o in zip(jobs, offsets,
                                                                        strict=True))
    assert sum(1 for a, b in itertools.pairwise(jobs) if a.arrival_s == b.arrival_s)
    # and each job has its request's model, run time (scaled), steps and adapters by group
    for job, r in zip(jobs, picked, strict=True):
        assert job.model == r.model and job.exec_s == pytest.approx(0.5 * r.exec_s)
        assert job.steps == 10 and job.deadline_s == pytest.approx(job.arrival_s
                                                                   + 3.0 * job.exec_s)
        assert job.adapters == tuple(f"{r.model}/{r.group}-{k}" for k in range(r.loras))
    assert {j.slo for j in jobs} == {SloClass.INTERACTIVE, SloClass.BATCH}
    # and the catalog holds the window's models, most used first, with their adapters
    shares = {m.name: m.share for m in catalog.models}
    assert set(shares) == {j.model for j in jobs} and sum(shares.values()) == pytest.approx(1)
    assert list(shares.values()) == sorted(shares.values(), reverse=True)
    for job in jobs:
        assert set(job.adapters) <= set(catalog.by_name[job.model].adapters)
    summary = window_summary(requests, window, jobs)
    assert summary["jobs"] == 60 and not summary["held_out"]


def test_loads_draw_from_the_trace_s_latencies_each_model_from_its_own_place(
        tmp_path: Path) -> None:
    synthetic_trace(tmp_path)
    requests, samples = read_requests(tmp_path), read_latencies(tmp_path)
    catalog, _ = window_jobs(requests, samples, TraceWindow(jobs=50, time_scale=0.1))
    rng = random.Random(1)
    for spec in catalog.models:
        place = catalog.places[spec.name]
        low = quantile(samples.base_s, place - QUANTILE_BAND) * 0.1
        high = quantile(samples.base_s, place + QUANTILE_BAND) * 0.1
        draws = [catalog.draw_load_s(rng, spec.name, "disk") for _ in range(50)]
        assert all(low - 1e-9 <= d <= high + 1e-9 for d in draws)
        host = catalog.draw_load_s(rng, spec.name, "host")
        assert host < high
    adapter = {round(v * 0.1, 9) for v in samples.adapter_s}
    assert all(round(catalog.draw_adapter_s(rng), 9) in adapter for _ in range(50))
    # a model's bytes follow its load time
    by_load = sorted(catalog.models, key=lambda m: m.disk_median_s)
    assert [m.bytes for m in by_load] == sorted(m.bytes for m in by_load)


def test_held_out_requests_stay_out_of_a_development_window(tmp_path: Path) -> None:
    # given requests on both sides of 2024-12-01
    t = HELD_OUT_FROM - timedelta(minutes=5)
    write_requests(tmp_path, [request(t + timedelta(minutes=k)) for k in range(10)])
    requests = read_requests(tmp_path)
    with pytest.raises(TraceError, match="held-out"):
        window_jobs(requests, read_latencies_stub(tmp_path), TraceWindow(jobs=8))
    _, jobs = window_jobs(requests, read_latencies_stub(tmp_path), TraceWindow(jobs=5))
    assert len(jobs) == 5
    _, held = window_jobs(requests, read_latencies_stub(tmp_path),
                          TraceWindow(jobs=8, held_out=True))
    assert len(held) == 8
    with pytest.raises(TraceError, match="only 10 usable"):
        window_jobs(requests, read_latencies_stub(tmp_path),
                    TraceWindow(jobs=11, held_out=True))


def read_latencies_stub(root: Path):  # type: ignore[no-untyped-def]
    if not (root / LATENCY_FILES["base"]).exists():
        write_latencies(root, {"base": [5000, 9000], "adapter": [4000]})
    return read_latencies(root)


def test_windows_start_at_day_starts_without_overlap_on_the_development_days(
        tmp_path: Path) -> None:
    synthetic_trace(tmp_path, days=6, per_day=30)
    requests = read_requests(tmp_path)
    starts = window_starts(requests, 3, 30)
    assert len(starts) == 3 and starts == sorted(starts)
    assert all(s < HELD_OUT_FROM and s.time().hour == 0 for s in starts)
    assert len({s.date() for s in starts}) == 3
    with pytest.raises(TraceError, match="only"):
        window_starts(requests, 10, 30)


def test_a_window_option_out_of_range_is_refused() -> None:
    with pytest.raises(ValidationError):
        TraceWindow(load=0.0)
    with pytest.raises(ValidationError):
        TraceWindow(jobs=1)
    with pytest.raises(ValidationError):
        TraceWindow(unknown=1)  # type: ignore[call-arg]


def test_the_trace_bench_runs_every_placement_on_the_same_windows(tmp_path: Path) -> None:
    # given a small trace
    synthetic_trace(tmp_path, days=3, per_day=30)
    # when two windows run on 2 simulated workers under every placement
    report = run_trace_bench(tmp_path, windows=2, jobs=30, workers=(2,), jobs_per_worker=10)
    pool = report["simulated"][0]
    # then every window has every placement's row, every job accounted for
    assert pool["workers"] == 2 and len(pool["rows"]) == 2
    for row in pool["rows"]:
        assert set(row["policies"]) == {"oblivious", "warm", "stepline", "oracle"}
        for figures in row["policies"].values():
            everyone = figures["groups"]["all"]
            assert everyone["jobs"] == 30 and sum(everyone["outcomes"].values()) == 30
            assert 0.0 <= everyone["attainment"] <= 1.0
            assert figures["effective_load"] >= figures["compute_load"] - 1e-9
        assert row["policies"]["oracle"]["loading_share_of_capacity"] == 0.0
    comparison = pool["comparison"]
    assert comparison["windows"] == 2 and "stepline_minus_warm" in comparison
    assert math.isfinite(comparison["stepline_minus_warm"]["mean_points"])


def test_stepline_bench_trace_mode_writes_one_json_and_refuses_a_bad_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import cli

    synthetic_trace(tmp_path, days=2, per_day=25)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, [
        "bench", "--gentd26", str(tmp_path), "--no-live", "--windows", "1",
        "--window-jobs", "25", "--jobs-per-worker", "5", "--sim-workers", "2", "--out", str(out),
        "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "gentd26.json").read_text())
    assert report["simulated"][0]["rows"][0]["window"]["jobs"] == 25
    bad = CliRunner().invoke(cli, ["bench", "--gentd26", str(tmp_path / "missing"),
                                   "--no-live", "--run-dir", str(tmp_path / "run")])
    assert bad.exit_code != 0 and "no GenTD26 request file" in bad.output


def test_the_scheduler_s_time_knobs_scale_to_the_window_s_median_job(tmp_path: Path) -> None:
    from app.bench.gentd26 import scheduler_scale
    from app.bench.models_sim import with_scheduler
    from scheduler import PolicyConfig

    synthetic_trace(tmp_path)
    _, jobs = window_jobs(read_requests(tmp_path), read_latencies(tmp_path),
                          TraceWindow(jobs=41, time_scale=0.5))
    unit = sorted(j.exec_s for j in jobs)[20]
    knobs = scheduler_scale(jobs)
    assert knobs == {"realtime_quantum": unit, "interactive_quantum": 5 * unit,
                     "aging_bound": 20 * unit}
    policy = with_scheduler(PolicyConfig(), knobs)
    assert policy.level_quanta_s == (unit, 5 * unit) and policy.aging_bound_s == 20 * unit
    assert with_scheduler(PolicyConfig(), {}) == PolicyConfig()
    with pytest.raises(ValueError, match="unknown scheduler settings"):
        with_scheduler(PolicyConfig(), {"quantum": 1.0})
