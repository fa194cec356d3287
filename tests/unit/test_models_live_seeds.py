"""Comparing placements at the live scale over many traces: every placement runs the same jobs
of each trace, and the paired difference is over those traces."""

from __future__ import annotations

from dataclasses import replace

import pytest

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


def test_the_chunk_overhead_is_measured_from_back_to_back_chunks_on_one_worker() -> None:
    """A chunk's start to its successor's start on the same worker, less its step: only where
    nothing ran between (no other job's chunk, no load in the first chunk, no move)."""
    from app.bench.models_live import chunk_overhead_s

    catalog = model_catalog(WORKLOAD)
    job = generate_jobs(WORKLOAD, catalog)[0]
    step = job.step_s

    def state(ts: float, to: str, by: str, reason: str) -> dict[str, object]:
        return {"kind": "state", "ts": ts, "to": to, "by": by, "reason": reason}

    trail = [
        state(0.0, "RUNNING", "w1", "chunk 0"),  # its load: not a sample
        state(1.0, "QUEUED", "w1", "next chunk 1 on w1.batch"),
        state(1.004, "RUNNING", "w1", "chunk 1"),
        state(1.004 + step + 0.001, "QUEUED", "w1", "next chunk 2 on w1.batch"),
        state(1.004 + step + 0.005, "RUNNING", "w1", "chunk 2"),  # 5 ms over its step
        state(1.009 + 2 * step + 0.002, "QUEUED", "w1", "next chunk 3 on w1.batch"),
        state(1.009 + 3 * step + 0.002, "RUNNING", "w1", "chunk 3"),  # another job ran between
        state(1.009 + 4 * step, "QUEUED", "w1", "next chunk 4 on w1.batch"),
        state(1.009 + 4 * step + 0.004, "RUNNING", "w2", "chunk 4"),  # on another worker
        {"kind": "other", "ts": 9.0},
    ]
    found = chunk_overhead_s([job], {job.index: trail})
    assert found["chunks"] == 1
    assert found["median"] == pytest.approx(0.005, abs=1e-9)
    assert chunk_overhead_s([job], {job.index: trail[:2]}) == {"median": None, "chunks": 0}
