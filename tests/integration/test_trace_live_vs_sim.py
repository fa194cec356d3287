"""The simulator predicts the live stack on a window of a trace of GenTD26's columns (written
here: bursty arrivals, six base models, adapters named by user group, latencies from files of
the trace's format): the window's jobs run on two live simulated-device workers under
Stepline's placement and through ``ClusterSim`` on the same budgets, placement, eviction, tick,
park wait and scaled scheduler knobs (``app.bench.trace_bench.live_rows``, the live half of
``stepline bench --gentd26``); their deadline attainment is within 12 points of the simulator
charged the per-chunk overhead the live run measured, and the live run loads at most 2.5 times
as often. These are the bounds that hold today, not the goal (3 points, 10 %): on this window
five live runs met 40-58 % against 47-57 % simulated with the measured overhead (60 % with the
default one), and loaded 0.20-0.42 times per job against 0.18-0.28 — the live side preempts
and moves to standby about twice as often as the simulated one (60 preemptions against 30),
and each move may cost a load. Later runs, each side's preemptions counted from its events:
live 51 and 57 against 28 and 32 simulated (gaps +5 and +10 points, loads ratio 1.1-1.2);
after a preempted job's wait was counted from its preemption as the simulator counts it (it
had been counted from when its stopped chunk was queued), live 41-57 against 30-43 (gaps -3
to +3 points, loads ratio 1.2-1.7). The excess is in the backlog at the window's end (live
finishes about 7 s after the simulator, with more resume loads): late jobs displace one
another, a running job having waited nothing and a waiting one ageing. The simulator alone
spans 26-40 preemptions and 33-48 % as the per-chunk overhead moves from 5 to 20 ms."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.gentd26 import read_latencies, read_requests
from app.bench.trace_bench import live_rows
from tests.gentd26_files import synthetic_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_live_and_simulated_runs_of_one_trace_window_agree(tmp_path: Path) -> None:
    # given a window of 60 requests of a GenTD26-format trace, on two workers at load 0.6,
    # scaled to jobs of ~0.2-1 s and loads of ~0.05-1 s
    trace = tmp_path / "trace"
    trace.mkdir()
    synthetic_trace(trace, days=2, per_day=60)
    # when it runs live and simulated under Stepline's placement
    (row,) = live_rows(read_requests(trace), read_latencies(trace), windows=1, jobs=60,
                       workers=2, load=0.6, device_models=3.0, host_models=0.0,
                       time_scale=0.025, byte_scale=1e-3, steps=5, placements=("stepline",),
                       held_out=False, interactive_share=0.5, slo_x=3.0, seed=1,
                       scale_scheduler=True, run_dir=tmp_path / "run", say=print)
    figures = row["policies"]["stepline"]
    live, sim = figures["live"], figures["sim_measured_hop"] or figures["sim"]
    # then every job ran live, and the two sides meet about as many deadlines
    assert live["groups"]["all"]["jobs"] == 60 and live["groups"]["all"]["unfinished"] == 0
    assert abs(figures["gaps"]["attainment_points"]) <= 12.0, (live["groups"], sim["groups"])
    # and load about as often
    assert sim["base_loads_per_100"] > 0
    assert 0.5 <= figures["gaps"]["base_loads_ratio"] <= 2.5, (
        live["base_loads_per_100"], sim["base_loads_per_100"])
