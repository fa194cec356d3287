"""Residency in the simulator: a worker's device never holds more bytes than its budget, a
chunk on a worker holding its model pays no load, and a trace without models runs exactly as
before residency existed."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.bench.models_sim import (
    max_load_at,
    paired_points,
    pool_figures,
    residency_for,
    run_placement,
)
from app.bench.models_workload import ModelsWorkload, model_catalog
from app.bench.sim_residency import GB, WorkerMemory
from app.bench.sim_workload import SimConfig, generate_trace, sim_policy
from app.bench.simulate import ClusterSim

WORKLOAD = ModelsWorkload(models=12, jobs=40, workers=3, load=0.7, steps=4, seed=5,
                          batch_slo_x=4.0)
CATALOG = model_catalog(WORKLOAD)
NAMES = [m.name for m in CATALOG.models]


def _memory(eviction: str, host_gb: int = 0) -> WorkerMemory:
    config = replace(residency_for("stepline", CATALOG, 20 * GB, host_gb * GB, 60.0),
                     eviction=eviction)  # type: ignore[arg-type]
    return WorkerMemory(config, random.Random(1))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["lru", "cost"]), st.sampled_from([0, 30]),
       st.lists(st.tuples(st.sampled_from(NAMES), st.booleans()), min_size=1, max_size=40))
def test_a_worker_never_holds_more_than_its_budgets(eviction: str, host_gb: int,
                                                    uses: list[tuple[str, bool]]) -> None:
    mem = _memory(eviction, host_gb)
    for t, (model, with_adapter) in enumerate(uses):
        adapters = CATALOG.by_name[model].adapters[:1] if with_adapter else ()
        load = mem.acquire(model, adapters, float(t))
        assert model in mem.device and set(adapters) <= set(mem.adapters)
        assert mem.device_bytes() <= mem.config.device_budget_bytes
        assert mem.host_bytes() <= mem.config.host_budget_bytes
        assert not set(mem.device) & set(mem.host)
        for base in mem.device:  # each resident base keeps at most its slots
            assert sum(a.split("/")[0] == base for a in mem.adapters) \
                <= mem.config.adapter_slots
        assert all(a.split("/")[0] in mem.device for a in mem.adapters)
        assert all(a.split("/")[0] in mem.host for a in mem.host_adapters)
        assert load.base_s >= 0.0 and load.adapter_s >= 0.0
    assert mem.peak_device_bytes <= mem.config.device_budget_bytes


def test_a_base_moved_to_host_memory_brings_its_adapters_back_and_one_dropped_does_not() -> None:
    mem = _memory("lru", host_gb=12)
    first, *rest = sorted(NAMES, key=lambda m: CATALOG.by_name[m].bytes)
    adapter = CATALOG.by_name[first].adapters[0]
    assert mem.acquire(first, (adapter,), 0.0).adapters == 1
    t = 1.0
    for model in rest:  # push it off the device into host memory
        mem.acquire(model, (), t)
        t += 1.0
        if first not in mem.device:
            break
    assert first in mem.host and adapter in mem.host_adapters and adapter not in mem.adapters
    back = mem.acquire(first, (adapter,), t)
    assert back.base_tier == "host" and back.adapters == 0 and adapter in mem.adapters
    gone = _memory("lru", host_gb=0)  # no host tier: an evicted base goes to disk
    gone.acquire(first, (adapter,), 0.0)
    for k, model in enumerate(rest, start=1):
        gone.acquire(model, (), float(k))
        if first not in gone.device:
            break
    assert not gone.host_adapters
    assert gone.acquire(first, (adapter,), 99.0).adapters == 1


def test_a_warm_start_pays_no_load_and_a_host_copy_loads_faster() -> None:
    mem = _memory("lru", host_gb=40)
    first = mem.acquire(NAMES[0], (), 0.0)
    assert first.base_tier == "disk" and first.base_s > 0.0
    again = mem.acquire(NAMES[0], (), 1.0)
    assert again.base_tier is None and again.seconds == 0.0
    for t, model in enumerate(NAMES[1:], start=2):  # push it off the device into host memory
        mem.acquire(model, (), float(t))
        if NAMES[0] not in mem.device:
            break
    assert NAMES[0] in mem.host
    back = mem.acquire(NAMES[0], (), 99.0)
    assert back.base_tier == "host"
    assert back.base_s < CATALOG.by_name[NAMES[0]].disk_median_s * 2


def test_the_simulated_cluster_stays_in_budget_and_only_cold_starts_load() -> None:
    figures = run_placement(WORKLOAD, "stepline", device_models=2.0, host_models=4.0,
                            tick_s=2.0)
    assert figures["peak_device_bytes"] <= figures["device_budget_bytes"]
    assert figures["groups"]["all"]["jobs"] == WORKLOAD.jobs
    assert figures["groups"]["all"]["unfinished"] == 0
    assert figures["base_loads_per_100"] > 0.0
    assert 0.0 < figures["load_share_of_capacity"] < 1.0
    one_model = replace(WORKLOAD, models=1, adapter_share=0.0)
    warm = run_placement(one_model, "oblivious", tick_s=2.0)
    # one model, no adapters: each worker loads it once, every later chunk starts warm
    assert warm["base_loads_per_100"] * one_model.jobs / 100 <= one_model.workers
    assert warm["adapter_loads_per_100"] == 0.0
    free = run_placement(WORKLOAD, "oracle", tick_s=2.0)
    assert free["load_share_of_capacity"] == 0.0


def test_a_trace_without_models_runs_as_before() -> None:
    config = SimConfig(workers=4, rate_per_s=40.0, duration_s=2.0, drain_s=2.0, seed=2)
    trace = generate_trace(config)
    with_residency = replace(config, residency=residency_for("stepline", CATALOG, 20 * GB,
                                                             40 * GB, 60.0))
    a = ClusterSim(config, trace, sim_policy(config, "stepline")).run()
    b = ClusterSim(with_residency, trace, sim_policy(with_residency, "stepline")).run()
    assert a.finished_s == b.finished_s and a.status == b.status
    assert a.busy_s == b.busy_s and a.preemptions == b.preemptions
    assert b.residency is None


def test_the_max_load_search_pools_its_seeds_jobs_in_every_probe() -> None:
    one = max_load_at(WORKLOAD, "oracle", steps=1, seeds=1)
    two = max_load_at(WORKLOAD, "oracle", steps=1, seeds=2)
    assert [p["jobs"] for p in two["probes"]] == [2 * p["jobs"] for p in one["probes"]]
    for probe in two["probes"]:
        low, high = probe["ci95"]
        assert low - 1e-9 <= probe["attainment"] <= high + 1e-9
    assert 0.0 <= two["max_load"] <= 1.3


def test_a_rows_traces_pool_into_one_figure_with_the_spread_between_them() -> None:
    w = ModelsWorkload(models=8, jobs=80, workers=2, load=0.7, seed=2)
    traces = [run_placement(replace(w, seed=w.seed + k), "stepline", warmup=0.2)
              for k in range(3)]
    pooled = pool_figures(traces)
    for name in ("all", "interactive", "batch"):
        jobs = sum(t["groups"][name]["jobs"] for t in traces)
        met = sum(t["groups"][name]["met"] for t in traces)
        assert pooled["groups"][name]["jobs"] == jobs
        assert pooled["groups"][name]["attainment"] == met / jobs
        low, high = pooled["groups"][name]["ci95"]
        assert low <= met / jobs <= high
    weights = [t["measured_jobs"] for t in traces]
    expected = sum(t["base_loads_per_100"] * n for t, n in zip(traces, weights, strict=True))
    assert pooled["base_loads_per_100"] == pytest.approx(expected / sum(weights))
    assert pooled["measured_jobs"] == sum(weights)
    attained = [t["groups"]["all"]["attainment"] for t in traces]
    assert pooled["trace_attainment"] == attained
    low, high = pooled["trace_mean"]["ci95"]
    assert low <= sum(attained) / 3 <= high
    # one trace pools to itself
    alone = pool_figures(traces[:1])
    assert alone["groups"]["all"] == traces[0]["groups"]["all"]
    assert alone["base_loads_per_100"] == traces[0]["base_loads_per_100"]
    with pytest.raises(ValueError):
        pool_figures([])


def test_the_paired_difference_is_taken_trace_by_trace() -> None:
    found = paired_points([0.9, 0.8, 0.95], [0.85, 0.82, 0.9])
    assert found["mean_points"] == pytest.approx((5.0 - 2.0 + 5.0) / 3)
    assert found["ahead"] == 2 and found["traces"] == 3
    low, high = found["ci95"]
    assert low < found["mean_points"] < high
    assert paired_points([90.0], [85.0], scale=1.0)["mean_points"] == 5.0
    with pytest.raises(ValueError):
        paired_points([], [])


def test_a_simulated_chunk_parked_where_its_model_was_evicted_is_marked_and_placed_anew() -> None:
    from scheduler.recovery import Recovery, RecoveryCause

    sim = _stepline_sim()
    # given its last chunk ran on w0, its next waits on w0's own queue; w1 holds its model
    job, model, w0, w1 = _parked_on_w0(sim)
    assert w0.mem is not None and w1.mem is not None
    w1.mem.acquire(model, (), 0.0)
    w0.mem.acquire(model, (), 0.0)
    sim._mark_moves([job])
    assert not job.model_left  # w0 still holds it
    w0.mem.device.clear()  # evicted for another job's
    sim._mark_moves([job])
    assert job.model_left and job.job_view().model_left
    # a chunk placed to load there is not marked: the load is what placement chose
    job.parked_q = f"{w0.name}.batch.placed"
    sim._mark_moves([job])
    assert not job.model_left
    # the recovery places it anew: on w1, which holds its model (idle: it takes it at once)
    job.parked_q, job.model_left = f"{w0.name}.batch", True
    epoch = job.epoch
    assert sim.recover(Recovery(job.id, RecoveryCause.MODEL_LEFT, "evicted"))
    assert job.running_on == w1.name and w1.job is job
    assert job.epoch == epoch + 1 and not job.model_left
    assert sim.counts["model_left"] == 1


def test_a_simulated_chunk_parked_on_a_busy_worker_moves_to_an_idle_one_holding_its_model(
) -> None:
    from scheduler.recovery import Recovery, RecoveryCause

    sim = _stepline_sim()
    other = sim.jobs[1]
    # given its next chunk waits on w0's own queue, and w0 holds its model but runs another's
    job, model, w0, w1 = _parked_on_w0(sim)
    assert w0.mem is not None and w1.mem is not None
    w0.mem.acquire(model, job.arrival.adapters, 0.0)
    sim._mark_moves([job])
    assert not job.idle_holder  # w0 idle: it takes the chunk itself
    w0.job = other
    sim.idle.pop(w0.name, None)
    sim._mark_moves([job])
    assert not job.idle_holder  # no idle worker holds its model
    # when idle w1 holds its model and adapters, the chunk is marked to move
    w1.mem.acquire(model, job.arrival.adapters, 0.0)
    sim._mark_moves([job])
    assert job.idle_holder and job.job_view().idle_holder and not job.model_left
    # not while a chunk is parked on w1 (it is about to take that one)
    other.parked_on = w1.name
    sim._mark_moves([job, other])
    assert not job.idle_holder
    other.parked_on = None
    sim._mark_moves([job])
    # the recovery places it anew: on w1, which takes it at once
    epoch = job.epoch
    assert sim.recover(Recovery(job.id, RecoveryCause.IDLE_HOLDER, "idle holder"))
    assert job.running_on == w1.name and w1.job is job
    assert job.epoch == epoch + 1 and not job.idle_holder
    assert sim.counts["idle_holder"] == 1


def _stepline_sim() -> ClusterSim:
    """The workload's trace in a simulator under the Stepline placement, not yet run."""
    from app.bench.models_sim import models_config, sim_trace
    from app.bench.models_workload import generate_jobs

    jobs = generate_jobs(WORKLOAD, CATALOG)
    residency = residency_for("stepline", CATALOG, 20 * GB, 0, 60.0)
    config = models_config(WORKLOAD, residency, jobs, tick_s=1.0)
    return ClusterSim(config, sim_trace(jobs), sim_policy(config, "stepline"))


def _parked_on_w0(sim: ClusterSim) -> tuple[Any, str, Any, Any]:
    """The trace's first job, its last chunk run on the simulator's first worker: its next
    waits on that worker's own batch queue. Returns (job, its model, w0, w1)."""
    from scheduler.lifecycle import JobState

    job = sim.jobs[0]
    model = job.arrival.model
    assert model is not None
    w0, w1 = sim.workers[0], sim.workers[1]
    sim.live[job.id] = job
    job.state, job.queue, job.parked_on = JobState.QUEUED, "batch", w0.name
    job.parked_q, job.service_s = f"{w0.name}.batch", 1.0
    return job, model, w0, w1


@settings(max_examples=200, deadline=None)
@given(loaded=st.lists(st.sampled_from("abcdefghijkl"), unique=True, max_size=12),
       wanted=st.sets(st.sampled_from("abcdefghijkl"), max_size=4),
       cap=st.integers(0, 10))
def test_an_adapter_beyond_the_cap_is_the_least_recently_used_one_the_chunk_does_not_apply(
        loaded: list[str], wanted: set[str], cap: int) -> None:
    from workers.residency import adapters_to_unload

    out = adapters_to_unload(loaded, wanted, cap)
    left = [a for a in loaded if a not in out]
    # nothing the chunk applies is unloaded, and only what must go to get within the cap
    assert not set(out) & wanted
    assert len(left) == max(cap, len([a for a in loaded if a in wanted]), 0) \
        or len(left) == len(loaded) <= cap
    # the ones unloaded are the oldest of those it does not apply
    unused = [a for a in loaded if a not in wanted]
    assert out == unused[:len(out)]


def test_the_keep_score_halves_per_half_life_and_grows_with_use_and_reload_cost() -> None:
    from workers.residency import counted_use, decayed, eviction_score

    once = counted_use(None, 100.0, 60.0)
    twice = counted_use(once, 130.0, 60.0)
    # a use counts 1, decayed by half per half-life since
    assert decayed(once, 160.0, 60.0) == pytest.approx(0.5)
    assert decayed(twice, 130.0, 60.0) == pytest.approx(1.0 + 0.5 ** 0.5)
    # more use, or a dearer reload, keeps a model longer; one never used or timed goes first
    assert eviction_score(twice, 2.0, 190.0, 60.0) > eviction_score(once, 2.0, 190.0, 60.0)
    assert eviction_score(once, 9.0, 190.0, 60.0) > eviction_score(once, 2.0, 190.0, 60.0)
    assert eviction_score(None, 9.0, 190.0, 60.0) == 0.0
    assert eviction_score(once, 0.0, 190.0, 60.0) > 0.0
    # the simulator's worker memory scores by the same rule
    memory = _memory("cost")
    memory.reuse["m"], memory.cost_s[("m", "disk")] = twice, 2.0
    half_life_s = memory.config.half_life_s
    assert memory.score("m", "disk", 190.0) == eviction_score(twice, 2.0, 190.0, half_life_s)
