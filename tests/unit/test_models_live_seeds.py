"""Comparing placements at the live scale over many traces: every placement runs the same jobs
of each trace, and the paired difference is over those traces."""

from __future__ import annotations

from dataclasses import replace

from app.bench.models_live import LiveSetup, paired_seeds, run_sim
from app.bench.models_workload import ModelsWorkload, generate_jobs, model_catalog

WORKLOAD = ModelsWorkload(models=8, jobs=30, workers=2, load=0.7, steps=3, seed=4,
                          time_scale=0.05, byte_scale=1e-3)


def test_paired_traces_are_the_workloads_next_seeds_and_the_difference_is_paired() -> None:
    setup = LiveSetup(WORKLOAD, host_models=2.0, warmup=0.1)
    found = paired_seeds(setup, 2, ("stepline", "oblivious"))
    assert found["seeds"] == 2
    # the second trace is the workload's next seed, run alone
    second = replace(WORKLOAD, seed=WORKLOAD.seed + 1)
    catalog = model_catalog(second)
    alone = run_sim(replace(setup, workload=second), "oblivious", generate_jobs(second, catalog),
                    catalog)["groups"]["all"]["attainment"]
    assert found["attainment"]["oblivious"][1] == 100.0 * alone
    diff = found["stepline_minus_oblivious"]
    pairs = zip(found["attainment"]["stepline"], found["attainment"]["oblivious"], strict=True)
    assert diff["mean_points"] == sum(a - b for a, b in pairs) / 2
    low, high = diff["ci95"]
    assert low <= diff["mean_points"] <= high
    assert 0 <= diff["ahead"] <= 2
