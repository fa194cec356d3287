"""The simulator predicts the live stack on a many-model trace: the same jobs (a production-shaped
mix of models with Zipf popularity, adapters, trace-shaped load times, scaled down) run on a live
stack of simulated-device workers under Stepline's placement and through ``ClusterSim`` on the
same budgets, placement, eviction, tick and park wait; their deadline attainment is within 5
points and their base loads per job within a factor of 1.75 (the live placement reads
heartbeats a beat late, the simulator sees every worker as it is) (``app.bench.models_live``;
``tests/bench/bench_models.py --live`` runs the larger comparison). A placement the two sides
decide differently (a chunk parked where the simulator would not park it, a hop to a queue the
simulator has not) moves the live figures away from the simulated ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.models_live import LiveSetup, compare
from app.bench.models_workload import ModelsWorkload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_live_attainment_and_loads_of_a_many_model_trace_match_the_simulators(
    tmp_path: Path,
) -> None:
    # given 72 jobs of 24 models (jobs of ~0.2-1.5 s, loads of ~0.05-0.5 s), a third with an
    # interactive deadline, on two workers whose device holds three median models
    workload = ModelsWorkload(models=24, jobs=72, workers=2, load=0.6, seed=3,
                              time_scale=0.03, byte_scale=1e-3, steps=6)
    setup = LiveSetup(workload, device_models=3.0, park_max_wait_s=1.0, warmup=0.1)
    # when they run live and simulated under Stepline's placement
    row = compare(setup, ("stepline",), run_dir=tmp_path)["rows"]["stepline"]
    live, sim = row["live"], row["sim"]
    # then the two attain within 5 points of each other, with the simulator's default hop and
    # with the per-chunk overhead the live run measured (a few milliseconds on this stack)
    assert abs(row["attainment_gap_points"]) <= 5.0, row
    overhead = live["chunk_overhead_s"]
    assert overhead["chunks"] > 0 and 0.0 < overhead["median"] < 0.1, overhead
    assert abs(row["attainment_gap_points_measured_hop"]) <= 5.0, row
    # and load about as often (each job's first chunk on a worker holding its model, or not)
    assert sim["base_loads_per_100"] > 0
    ratio = live["base_loads_per_100"] / sim["base_loads_per_100"]
    assert 0.5 <= ratio <= 1.75, (live["base_loads_per_100"], sim["base_loads_per_100"])
    # and no live worker ever held more than its device budget (tensor bytes, measured)
    assert 0 < live["peak_device_bytes"] <= live["device_budget_bytes"]
