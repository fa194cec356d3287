"""The discrete-event simulation: seeded, bounded by its oracles, and faithful to failures."""

from __future__ import annotations

from typing import Any

import pytest

from app.bench.oracle import Discipline, OracleJob, mean_response_lower_bound_s, run_oracle
from app.bench.sim_report import SIM_POLICIES, run_config
from app.bench.sim_workload import SimConfig, generate_trace
from app.bench.simulate import ClusterSim
from scheduler import PolicyConfig, PolicyKind

pytestmark = pytest.mark.timeout(60)

UNDERLOAD = SimConfig(workers=16, rate_per_s=5.0, duration_s=15.0, drain_s=60.0, seed=3)
"""ρ ≈ 0.7 and a drain long enough that every job completes."""
CONTENDED = SimConfig(workers=4, rate_per_s=8.0, duration_s=10.0, drain_s=20.0, seed=5)
"""Overloaded (ρ ≈ 2 on this trace): realtime work competes with long batch images."""


def _outcomes(run: dict[str, Any]) -> dict[str, Any]:
    # everything but wall-clock timings
    return {name: rep["groups"] for name, rep in run["policies"].items()}


def test_same_seed_gives_the_same_simulation() -> None:
    # given two runs of one seeded config
    policies = [*SIM_POLICIES, "oracle-srpt"]
    first, second = run_config(CONTENDED, policies), run_config(CONTENDED, policies)
    # then every figure but the wall-clock ones is identical, and labelled as simulated
    assert _outcomes(first) == _outcomes(second)
    assert first["simulated"] is True and "simulated" in first["note"]
    assert all(rep["simulated"] is True for rep in first["policies"].values())
    other = run_config(SimConfig(**{**_fields(CONTENDED), "seed": 6}), ["fifo"])
    assert _outcomes(other)["fifo"] != _outcomes(first)["fifo"]


def _fields(config: SimConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


def test_oracles_bound_the_policies_on_an_underloaded_trace() -> None:
    # given a trace every policy completes
    run = run_config(UNDERLOAD, [*SIM_POLICIES, "oracle-edf", "oracle-srpt"])
    every = {name: rep["groups"]["all"] for name, rep in run["policies"].items()}
    assert all(g["completed"] == g["submitted"] for g in every.values())
    # then SRPT's mean latency (what it optimises) is the lowest, above the true lower bound
    bound_s = run["mean_latency_lower_bound_s"]
    srpt_s = every["oracle-srpt"]["mean_latency_s"]
    assert bound_s <= srpt_s
    assert all(srpt_s <= every[p]["mean_latency_s"] for p in SIM_POLICIES)
    # and EDF meets at least as many deadlines (what it optimises) as any policy
    assert all(every["oracle-edf"]["slo_attainment"] >= every[p]["slo_attainment"]
               for p in SIM_POLICIES)


def test_srpt_lower_bound_holds_against_a_hand_built_schedule() -> None:
    # given two 1 s jobs at t=0 on one worker: the best mean latency is (1 + 2) / 2
    jobs = [OracleJob(0.0, 1.0, 5.0), OracleJob(0.0, 1.0, 5.0)]
    assert run_oracle(jobs, 1, Discipline.SRPT, 10.0) == [1.0, 2.0]
    # then the fast-single-server bound on two workers is 0.5 s + 1 s over two jobs: 0.75 s
    assert mean_response_lower_bound_s(jobs, 2) == pytest.approx(0.75)


def test_edf_preempts_for_an_earlier_deadline() -> None:
    jobs = [OracleJob(0.0, 2.0, 10.0), OracleJob(0.5, 0.2, 1.0)]
    finish = run_oracle(jobs, 1, Discipline.EDF, 10.0)
    assert finish == [pytest.approx(2.2), pytest.approx(0.7)]


def test_stepline_beats_fifo_on_realtime_attainment_under_contention() -> None:
    # given a mixed trace where realtime work competes with long batch jobs
    run = run_config(CONTENDED, ["fifo", "stepline"])
    realtime = {p: run["policies"][p]["groups"]["realtime"]["slo_attainment"]
                for p in ("fifo", "stepline")}
    # then Stepline meets more realtime deadlines than atomic FIFO
    assert realtime["stepline"] > realtime["fifo"] + 0.2


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_a_failed_workers_job_resumes_from_its_checkpoint_and_completes(policy: str) -> None:
    # given a worker that dies mid-run with a job on it (short lease for a short test)
    config = SimConfig(workers=4, rate_per_s=3.0, duration_s=10.0, drain_s=40.0, seed=2,
                       fail_at_s=5.0, lease_s=1.0)
    trace = generate_trace(config)
    sim = ClusterSim(config, trace, PolicyConfig(policy=PolicyKind(policy)),
                     check_invariants=True)
    result = sim.run()
    # then its job was requeued after the lease and finished on another worker
    assert result.lost_jobs
    for index in result.lost_jobs:
        assert result.status[index] == "done"
        finished = result.finished_s[index]
        assert finished is not None and finished > 5.0 + 1.0


def test_stress_run_keeps_every_plan_invariant_and_serves_urgent_jobs() -> None:
    # given the stress shape at small scale: urgent jobs and a failure under overload
    config = SimConfig.stress(workers=8, rate_per_s=8.0, duration_s=8.0, drain_s=5.0, seed=4,
                              lease_s=1.0)
    trace = generate_trace(config)
    result = ClusterSim(config, trace, PolicyConfig(), check_invariants=True).run()
    urgent = [a for a in trace if a.group == "urgent"]
    met = [a for a in urgent if (f := result.finished_s[a.index]) is not None
           and f <= a.deadline_s]
    # then most urgent jobs meet their sub-100 ms SLO and every tick was measured
    assert urgent and len(met) >= 0.8 * len(urgent)
    assert result.tick_ms and len(result.tick_ms) == len(result.tick_jobs)
