"""The many-model workload has the production trace's shape (top-10 share, adapter share,
execution and load quantiles) and scales its clock and bytes by one factor each."""

from __future__ import annotations

import random

import pytest

from app.bench.models_workload import (
    MAX_BYTES,
    MIN_BYTES,
    ModelJob,
    ModelsWorkload,
    first_use_loads,
    generate_jobs,
    model_catalog,
    top_share,
)
from scheduler.lifecycle import SloClass


def _quantile(xs: list[float], p: float) -> float:
    ordered = sorted(xs)
    return ordered[int(p * (len(ordered) - 1))]


def test_popularity_and_adapters_follow_the_trace() -> None:
    w = ModelsWorkload(jobs=6000, seed=3)
    jobs = generate_jobs(w)
    assert 0.84 <= top_share(jobs, 10) <= 0.89  # the trace: 86.6 %
    with_adapters = [j for j in jobs if j.adapters]
    assert 0.15 <= len(with_adapters) / len(jobs) <= 0.19  # the trace: 16.7 %, here 17 %
    assert {len(j.adapters) for j in with_adapters} <= {1, 2, 3}
    assert sum(len(j.adapters) == 1 for j in with_adapters) / len(with_adapters) > 0.85
    for j in with_adapters:
        assert all(a.startswith(f"{j.model}/") for a in j.adapters)
        assert len(set(j.adapters)) == len(j.adapters)
    assert {j.steps for j in jobs} == {30}
    interactive = sum(j.slo is SloClass.INTERACTIVE for j in jobs) / len(jobs)
    assert 0.45 <= interactive <= 0.55


def test_execution_and_load_times_are_trace_shaped() -> None:
    w = ModelsWorkload(jobs=6000, seed=4)
    catalog = model_catalog(w)
    jobs = generate_jobs(w, catalog)
    execs = [j.exec_s for j in jobs]
    assert 19 <= _quantile(execs, 0.5) <= 27  # the trace: p50 23 s
    assert 42 <= _quantile(execs, 0.9) <= 64  # p90 53 s
    rng = random.Random(5)
    loads = [catalog.draw_load_s(rng, rng.choice(catalog.models).name, "disk")
             for _ in range(6000)]
    assert 6.5 <= _quantile(loads, 0.5) <= 10.5  # the trace: p50 8.45 s
    assert 18 <= _quantile(loads, 0.9) <= 34  # p90 26.8 s
    adapters = [catalog.draw_adapter_s(rng) for _ in range(4000)]
    assert 4.0 <= _quantile(adapters, 0.5) <= 4.8  # p50 4.4 s
    assert all(MIN_BYTES <= m.bytes <= MAX_BYTES for m in catalog.models)
    mean = sum(execs) / len(execs)
    assert mean == pytest.approx(w.mean_exec_s(), rel=0.06)
    rate = len(jobs) / jobs[-1].arrival_s
    assert rate == pytest.approx(w.rate_per_s(), rel=0.06)


def test_time_and_byte_scales_and_seeding() -> None:
    base = ModelsWorkload(jobs=200, seed=7)
    small = ModelsWorkload(jobs=200, seed=7, time_scale=0.1, byte_scale=0.001)
    a, b = generate_jobs(base), generate_jobs(small)
    assert generate_jobs(base) == a
    for x, y in zip(a, b, strict=True):
        assert (x.model, x.adapters, x.slo) == (y.model, y.adapters, y.slo)
        assert y.exec_s == pytest.approx(0.1 * x.exec_s)
        assert y.arrival_s == pytest.approx(0.1 * x.arrival_s)
        assert y.slo_s == pytest.approx(0.1 * x.slo_s)
    ca, cb = model_catalog(base), model_catalog(small)
    for x, y in zip(ca.models, cb.models, strict=True):
        assert y.disk_median_s == pytest.approx(0.1 * x.disk_median_s)
        assert y.bytes == pytest.approx(0.001 * x.bytes, rel=1e-6)
    assert generate_jobs(ModelsWorkload(jobs=200, seed=8)) != a


def _job(index: int, model: str, adapters: tuple[str, ...] = ()) -> ModelJob:
    return ModelJob(index, float(index), model, adapters, 1, 1.0, 1, SloClass.BATCH, 10.0 + index)


def test_first_use_loads_count_what_no_earlier_job_named_among_the_measured_jobs() -> None:
    jobs = [_job(0, "a", ("a/0",)),            # warm-up: names a and (a, a/0)
            _job(1, "a", ("a/0", "a/1")),      # new pair (a, a/1)
            _job(2, "b"),                      # new base b
            _job(3, "b", ("b/0",)),            # new pair (b, b/0)
            _job(4, "a", ("a/1",))]            # nothing new
    floor = first_use_loads(jobs, warmup=1)
    assert floor == {"base_per_100": 100.0 * 1 / 4, "adapter_per_100": 100.0 * 2 / 4}
    # without a warm-up the first job's base and pair count too
    assert first_use_loads(jobs) == {"base_per_100": 100.0 * 2 / 5,
                                     "adapter_per_100": 100.0 * 3 / 5}


def test_first_use_loads_are_a_floor_under_the_simulated_policies() -> None:
    from app.bench.models_sim import run_placement

    w = ModelsWorkload(models=10, jobs=120, workers=2, load=0.6, seed=5)
    catalog = model_catalog(w)
    jobs = generate_jobs(w, catalog)
    floor = first_use_loads(jobs, warmup=24)
    assert floor["adapter_per_100"] > 0.0
    for policy in ("oblivious", "warm", "stepline"):
        figures = run_placement(w, policy, jobs=jobs, catalog=catalog, warmup=0.2)
        assert figures["base_loads_per_100"] >= floor["base_per_100"] - 1e-9
        assert figures["adapter_loads_per_100"] >= floor["adapter_per_100"] - 1e-9
