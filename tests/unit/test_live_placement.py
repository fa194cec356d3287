"""The live release path's use of the placement policy: workers as placement sees them, built
from heartbeat bodies; load estimates fed from their measured loads; the release choice per
policy; a job on a model keeping its worker between chunks."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind
from scheduler.placement import Holding, LoadEstimates, ModelNeed, PlacementPolicy
from tasks.affinity import (
    WorkerDirectory,
    hop_queues,
    needs_directory,
    queued_demand,
    release_queue,
)
from tasks.heartbeat import Heartbeat
from tasks.holdings import StageRequest, held_models, holding, host_slots, model_need
from tasks.load_estimates import LearnedLoads, observe_loads
from tasks.record import JobRecord
from tasks.routing import affinity_worker, class_queue_of, hop_worker, with_affinity
from tasks.runtime import current_settings
from tasks.settings import Settings
from tasks.submit import InvalidJob, validate_params

QUEUES = ("realtime", "{w}.interactive", "{w}.interactive.placed", "interactive", "{w}.batch",
          "{w}.batch.placed", "batch", "{w}.standby", "standby")
MB = 1 << 20


def _beat(name: str, device: dict[str, int], busy: str | None = None,
          **residency: Any) -> Heartbeat:
    return Heartbeat(name=name, busy_job=busy, batch=1 if busy else 0, ts=0.0,
                     queues=tuple(q.format(w=name) for q in QUEUES),
                     residency={"device": device, "host": {}, "budget_bytes": 2 * MB,
                                **residency})


def _sim(model: str, job_id: str = "j1", state: JobState = JobState.PENDING,
         **params: Any) -> JobRecord:
    return JobRecord(
        job_id=job_id, kind=JobKind.SIMULATED, slo=SloClass.INTERACTIVE, tenant="acme",
        params={"steps": 2, "step_ms": 100.0, "model": model, "model_bytes": MB,
                "load_ms": 500.0, **params},
        submitted_at_s=100.0, deadline_at_s=160.0, num_chunks=2, cost_key="simulated",
        cost_units=(0.1, 0.1), state=state, queue="interactive", next_chunk=0, seq=0,
        epoch=0, updated_at_s=100.0)


def _placing(placement: str) -> Settings:
    s = current_settings()
    return s.model_copy(update={"affinity": s.affinity.model_copy(
        update={"placement": placement})})


def _sim_key(model: str) -> str:
    return f"simulated:{model}"


# workers as placement sees them ----------------------------------------------------------------
def test_a_holding_is_built_from_a_heartbeats_residency() -> None:
    beat = _beat("w1", {_sim_key("m1"): MB, "diffusion:dit-tiny:cpu:seeded": MB,
                        "text:moe:qwen3-moe-tiny": 5 * MB},
                 host={_sim_key("m2"): MB, _sim_key("m1"): MB},
                 adapters={_sim_key("m1"): ["style", "ink"], "text:moe:x": ["no"]})
    h = holding("w1", beat, 0.0)
    assert h.device == {"simulated:m1", "diffusion:dit-tiny"}  # a MoE model is not placed
    assert h.host == {"simulated:m2"}  # a model on the device is not counted in host memory
    assert h.adapters == {"simulated:style", "simulated:ink"}
    assert h.capacity == 2  # a budget of 2 MiB over models of 1 MiB each
    assert h.free_bytes == 0  # the MoE model's bytes count against the budget too
    assert holding("w2", _beat("w2", {_sim_key("m1"): MB}), 0.0).free_bytes == MB
    assert h.idle and h.holds(ModelNeed("simulated:m1", frozenset({"simulated:ink"})))
    assert not h.holds(ModelNeed("simulated:m1", frozenset({"simulated:other"})))


def test_a_holding_of_unknown_budget_or_no_models_has_no_capacity() -> None:
    assert holding("w1", _beat("w1", {}), 0.0).capacity == 0
    unlimited = _beat("w1", {_sim_key("m1"): MB}, budget_bytes=None)
    assert holding("w1", unlimited, 1.5).capacity == 0
    assert holding("w1", unlimited, 1.5).free_in_s == 1.5
    assert holding("w1", Heartbeat(name="w1"), math.inf) == Holding("w1", math.inf)


def test_measured_loads_from_heartbeats_are_learned_once_each() -> None:
    recent = [{"model": _sim_key("m1"), "tier": "disk", "s": 0.8, "bytes": MB, "at": 10.0},
              {"model": _sim_key("m1"), "tier": "host", "s": 0.2, "bytes": MB, "at": 11.0},
              {"model": _sim_key("m1"), "tier": "adapter", "s": 0.3, "bytes": 0, "at": 12.0,
               "adapter": "style"},
              {"model": "text:moe:x", "tier": "disk", "s": 9.0, "bytes": MB, "at": 13.0},
              {"model": _sim_key("m9"), "tier": "disk", "s": 9.0, "bytes": MB}]  # no time
    beat = _beat("w1", {}, recent=recent)
    estimates = LoadEstimates()
    observe_loads(estimates, [beat])
    observe_loads(estimates, [beat])  # the next heartbeat lists the same loads again
    assert estimates.estimate("simulated:m1", "disk") == pytest.approx(0.8)
    assert estimates.estimate("simulated:m1", "host") == pytest.approx(0.2)
    assert estimates.estimate("simulated:style", "adapter") == pytest.approx(0.3)
    # a model never measured from disk gets the mean of what was (the MoE load is not one)
    assert estimates.estimate("simulated:m2", "disk") == pytest.approx(0.8)


def test_what_a_job_needs_and_the_queued_demand_per_model() -> None:
    assert model_need("simulated", {"model": "m1", "adapters": [{"name": "a"}]}) == \
        ModelNeed("simulated:m1", frozenset({"simulated:a"}))
    assert model_need("image", {"model": "dit-tiny"}) == ModelNeed("diffusion:dit-tiny")
    assert model_need("simulated", {"model": "m1", "model_bytes": MB}) == \
        ModelNeed("simulated:m1", bytes=MB)
    assert model_need("simulated", {"steps": 2}) is None
    assert model_need("text", {"model": "qwen3-moe-tiny"}) is None
    jobs = [_sim("m1", "a"), _sim("m1", "b", JobState.QUEUED), _sim("m2", "c"),
            _sim("m1", "d", JobState.RUNNING)]
    assert queued_demand(jobs) == {"simulated:m1": 2, "simulated:m2": 1}


# the release choice per policy -----------------------------------------------------------------
def _directory(busy_free_in_s: dict[str, float] | None = None,
               demand: dict[str, int] | None = None, **beats: Heartbeat) -> WorkerDirectory:
    estimates = LoadEstimates()
    estimates.observe("simulated:m1", "disk", 0.5)
    return WorkerDirectory(dict(beats), busy_free_in_s=busy_free_in_s or {},
                           demand=lambda: demand or {}, learned=LearnedLoads(estimates))


def test_oblivious_placement_releases_to_the_class_queue_without_reading_workers() -> None:
    settings, job = _placing("oblivious"), _sim("m1")
    assert not needs_directory(settings, job)
    warm = _directory(w1=_beat("w1", {_sim_key("m1"): MB}))
    assert release_queue(settings, job, "interactive", warm) == "interactive"


def test_warm_placement_takes_an_idle_warm_worker_else_the_class_queue() -> None:
    settings, job = _placing("warm"), _sim("m1")
    assert needs_directory(settings, job)
    beats = {"w1": _beat("w1", {_sim_key("m1"): MB}, busy="other"), "w2": _beat("w2", {})}
    assert release_queue(settings, job, "interactive", _directory(**beats)) == "interactive"
    beats["w3"] = _beat("w3", {_sim_key("m1"): MB})
    assert release_queue(settings, job, "interactive", _directory(**beats)) == \
        "w3.interactive.placed"


def test_stepline_placement_loads_on_a_worker_with_room_before_one_that_must_evict() -> None:
    settings, job = _placing("stepline"), _sim("m3")
    full = _beat("w1", {_sim_key("m1"): MB, _sim_key("m2"): MB})
    room = _beat("w2", {_sim_key("m4"): MB})
    assert release_queue(settings, job, "interactive", _directory(w1=full, w2=room)) == \
        "w2.interactive.placed"


def test_a_release_goes_where_the_model_was_just_built_though_no_heartbeat_lists_it_yet(
) -> None:
    from tasks.affinity import PlacementView

    # given two idle workers whose heartbeats list nothing, w2 having just run a chunk on m1
    settings, job = _placing("stepline"), _sim("m1")
    need = model_need(job.kind, job.params)
    assert need is not None
    w1, w2 = _beat("w1", {}), _beat("w2", {})
    directory = _directory(w1=w1, w2=w2)
    directory.built = (("w2", need),)
    # then the tick's release goes to w2, which holds m1 from that chunk on
    assert release_queue(settings, job, "interactive", directory) == "w2.interactive.placed"
    # and the view a submit places by carries what was built, as the tick read it
    view = PlacementView(5.0, {}, {}, {}, (("w2", need),))
    assert PlacementView.decode(view.encode()) == view


def test_stepline_placement_waits_for_a_warm_worker_soon_free_not_for_an_unknown_one() -> None:
    settings, job = _placing("stepline"), _sim("m1")
    warm_busy = _beat("w1", {_sim_key("m1"): MB}, busy="other")
    cold_idle = _beat("w2", {})
    soon = _directory({"w1": 0.2}, w1=warm_busy, w2=cold_idle)
    assert release_queue(settings, job, "interactive", soon) == "w1.interactive.placed"
    late = _directory({"w1": 3.0}, w1=warm_busy, w2=cold_idle)  # the load (0.5 s) is sooner
    assert release_queue(settings, job, "interactive", late) == "w2.interactive.placed"
    unknown = _directory({}, w1=warm_busy, w2=cold_idle)
    assert release_queue(settings, job, "interactive", unknown) == "w2.interactive.placed"
    # a busy worker not holding the model: the same load, after its work
    cold_busy = _beat("w1", {_sim_key("m2"): MB}, busy="other")
    swap = _directory({"w1": 0.01}, w1=cold_busy, w2=_beat("w2", {_sim_key("m3"): MB}))
    assert release_queue(settings, job, "interactive", swap) == "w2.interactive.placed"


def test_stepline_placement_evicts_the_model_no_queued_job_needs() -> None:
    settings, job = _placing("stepline"), _sim("m1")
    wanted = _beat("w1", {_sim_key("m2"): MB, _sim_key("m3"): MB})
    unwanted = _beat("w2", {_sim_key("m4"): MB, _sim_key("m5"): MB})
    directory = _directory(demand={"simulated:m2": 3, "simulated:m3": 1},
                           w1=wanted, w2=unwanted)
    assert release_queue(settings, job, "interactive", directory) == "w2.interactive.placed"


def test_releases_queue_on_a_warm_worker_while_its_work_ends_sooner_than_a_load() -> None:
    # given w1 holding m1 and w2 empty; each m1 job has 0.2 s of work, a load takes 0.5 s
    settings = _placing("stepline")
    directory = _directory(w1=_beat("w1", {_sim_key("m1"): MB}), w2=_beat("w2", {}))
    queues = [release_queue(settings, _sim("m1", f"j{i}"), "interactive", directory)
              for i in range(4)]
    # then the first three wait on w1 (free at 0, 0.2, 0.4 s), the fourth loads on w2
    assert queues == ["w1.interactive.placed"] * 3 + ["w2.interactive.placed"]
    # a job whose work is not known leaves its worker busy until it says otherwise
    unknown = _directory(w1=_beat("w1", {_sim_key("m1"): MB}), w2=_beat("w2", {}))
    assert unknown.place(ModelNeed("simulated:m1"), "interactive", PlacementPolicy.STEPLINE,
                         work_s=0.0).worker == "w1"
    assert unknown.place(ModelNeed("simulated:m1"), "interactive", PlacementPolicy.STEPLINE,
                         work_s=0.0).worker == "w2"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from(["m1", "m2", "m3", "m4"]), max_size=2),
                          st.booleans(), st.booleans()), min_size=1, max_size=5),
       st.sampled_from(["m1", "m2", "m3", "m4"]), st.sampled_from(["warm", "stepline"]))
def test_a_release_goes_only_to_an_alive_worker_that_consumes_its_own_queue(
    workers: list[tuple[set[str], bool, bool]], model: str, placement: str
) -> None:
    beats = {}
    for n, (held, busy, consumes) in enumerate(workers):
        name = f"w{n}"
        beat = _beat(name, {_sim_key(m): MB for m in held}, busy="x" if busy else None)
        if not consumes:  # a reserved worker: realtime only
            beat = Heartbeat(name=name, busy_job=beat.busy_job, queues=("realtime",),
                             residency=beat.residency)
        beats[name] = beat
    queue = release_queue(_placing(placement), _sim(model), "interactive", _directory(**beats))
    if queue == "interactive":
        return
    worker = queue.removesuffix(".interactive.placed")
    assert f"{worker}.interactive.placed" in beats[worker].queues
    if placement == "warm":  # route-to-warm: only an idle worker that holds the model
        assert beats[worker].busy_job is None
        assert _sim_key(model) in beats[worker].residency["device"]


# a job's chunks keep their worker --------------------------------------------------------------
def test_a_job_on_a_model_hops_to_its_own_worker_unless_placement_is_oblivious() -> None:
    mine = with_affinity("w1", ("realtime", "interactive", "batch", "standby"))
    params = _sim("m1").params
    assert hop_queues(_placing("stepline"), "w1", mine, "simulated", params) == \
        {"interactive": "w1.interactive", "batch": "w1.batch", "standby": "w1.standby"}
    assert hop_queues(_placing("warm"), "w1", mine, "simulated", params) != {}
    assert hop_queues(_placing("oblivious"), "w1", mine, "simulated", params) == {}
    assert hop_queues(_placing("stepline"), "w1", mine, "simulated", {"steps": 2}) == {}


def test_a_queued_chunk_moved_by_the_tick_stays_on_the_worker_holding_its_model() -> None:
    from tasks.affinity import kept_queue

    directory = _directory(w1=_beat("w1", {_sim_key("m1"): MB}), w2=_beat("w2", {}))
    placed = replace(_sim("m1", state=JobState.QUEUED), queue="w1.interactive.placed")
    # not run yet: from its placement queue to the worker's placement queue of the new class
    assert kept_queue(placed, "batch", directory) == "w1.batch.placed"
    assert kept_queue(placed, "standby", directory) == "w1.standby"
    hopped = replace(placed, queue="w1.interactive", service_s=0.4)
    assert kept_queue(hopped, "batch", directory) == "w1.batch"
    assert kept_queue(hopped, "realtime", directory) is None  # realtime: first free worker
    gone = _directory(w2=_beat("w2", {}))
    assert kept_queue(hopped, "batch", gone) is None  # placed again like a release
    assert kept_queue(replace(hopped, queue="interactive"), "batch", directory) is None


def test_a_workers_own_queues_name_it_and_their_class() -> None:
    for worker in ("w1", "w1@host.example.org"):
        own = with_affinity(worker, ("realtime", "interactive", "batch", "standby"))
        assert own == ("realtime", f"{worker}.interactive", f"{worker}.interactive.placed",
                       "interactive", f"{worker}.batch", f"{worker}.batch.placed", "batch",
                       f"{worker}.standby", "standby")
        assert [affinity_worker(q) for q in own] == [
            None, worker, worker, None, worker, worker, None, worker, None]
        # the worker whose hops a queue holds: not a placement queue's
        assert [hop_worker(q) for q in own] == [
            None, worker, None, None, worker, None, None, worker, None]
        assert [class_queue_of(q) for q in own] == [
            "realtime", "interactive", "interactive", "interactive", "batch", "batch", "batch",
            "standby", "standby"]
    assert affinity_worker("w1.standby.placed") is None  # standby has no placement queue
    assert affinity_worker("w1.realtime") is None


def test_a_parked_chunk_of_a_job_on_a_model_waits_as_long_as_its_load_elsewhere() -> None:
    from scheduler.recovery import RecoveryCause, RecoveryConfig, plan_recoveries
    from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot

    def moved(reload_s: float, waited_s: float, slack_s: float = 10.0) -> bool:
        job = make_job("p", state=JobState.QUEUED, work_s=1.0, queue="batch",
                       parked_on="w1", waiting_since_s=NOW_S - waited_s, reload_s=reload_s,
                       deadline_s=NOW_S + 1.0 + slack_s)
        snap = make_snapshot([job])
        config = RecoveryConfig(affinity_max_wait_s=0.3, wait_within_slack=True)
        recoveries, _ = plan_recoveries(snap.jobs, frozenset({"w1"}), snap.cost, config,
                                        NOW_S)
        return any(r.cause is RecoveryCause.PARKED for r in recoveries)

    assert moved(0.0, 0.5)  # no model: the affinity wait
    assert not moved(0.0, 0.2)
    assert not moved(8.0, 5.0)  # a load elsewhere would take 8 s: waiting 5 s is cheaper
    assert moved(8.0, 8.5)  # 10 s of slack left: moving now still makes its deadline
    # with slack for twice the load, waiting on costs no job anything: it stays
    assert not moved(8.0, 8.5, slack_s=16.5)
    assert moved(8.0, 8.5, slack_s=15.5)


def test_the_ticks_waiting_jobs_on_a_model_no_worker_holds_count_its_load() -> None:
    from tasks.load_estimates import ExpectedLoads
    from tasks.snapshot import job_view
    from tests.unit.test_scheduler_support import make_snapshot

    # given a worker holding m1 that measured a 3 s load of mx from disk
    recent = [{"model": "simulated:mx", "tier": "disk", "s": 3.0, "at": 7_000_001.5}]
    beats = {"w1": _beat("w1", {_sim_key("m1"): MB}, recent=recent)}
    records = {r.job_id: r for r in (
        _sim("mx", "cold"), _sim("m1", "warm"),
        replace(_sim("mz", "running", state=JobState.RUNNING), running_on="w1"),
        replace(_sim("mx", "plain"), params={"steps": 2, "step_ms": 100.0}))}
    snapshot = make_snapshot([job_view(r) for r in records.values()])
    loads = ExpectedLoads()
    # when the Stepline placement's tick reads it
    planned = loads.apply(_placing("stepline"), snapshot, records, beats)
    # then the cold job expects the load, the warm one, the running one and one on no model none
    load = {v.job_id: v.load_s for v in planned.jobs}
    assert load == {"cold": pytest.approx(3.0), "warm": 0.0, "running": 0.0, "plain": 0.0}
    # the next tick hands out the same view objects (the incremental planner's rows)
    again = loads.apply(_placing("stepline"), snapshot, records, beats)
    assert all(a is b for a, b in zip(planned.jobs, again.jobs, strict=True))
    # once a worker holds mx, its load is gone; other placements count no loads
    beats["w2"] = _beat("w2", {_sim_key("mx"): MB})
    assert loads.apply(_placing("stepline"), snapshot, records, beats) is snapshot
    assert ExpectedLoads().apply(_placing("warm"), snapshot, records, beats) is snapshot


def test_a_model_counts_as_resident_from_the_chunk_that_built_it_not_the_next_heartbeat(
) -> None:
    from tasks.load_estimates import ExpectedLoads
    from tasks.snapshot import job_view
    from tests.unit.test_scheduler_support import make_snapshot

    # given w1's heartbeat, written at 0.0, lists no model, and a 3 s load of mx measured
    recent = [{"model": "simulated:mx", "tier": "disk", "s": 3.0, "at": 7_000_002.5}]
    beats = {"w1": _beat("w1", {}, recent=recent)}
    joiner = _sim("mx", "joiner")

    def load_of(*others: JobRecord) -> float:
        records = {r.job_id: r for r in (joiner, *others)}
        snapshot = make_snapshot([job_view(r) for r in records.values()])
        planned = ExpectedLoads().apply(_placing("stepline"), snapshot, records, beats)
        return next(v.load_s for v in planned.jobs if v.job_id == "joiner")

    # when nothing ran on mx since, a job on mx expects its load
    assert load_of() == pytest.approx(3.0)
    # a chunk on mx running on w1 (the worker loads it or holds it) takes the load away
    assert load_of(replace(_sim("mx", "first", state=JobState.RUNNING),
                           running_on="w1")) == 0.0
    # so does one whose chunk ended on w1 after its heartbeat (its next chunk queued there)
    ended = replace(_sim("mx", "first", state=JobState.QUEUED), queue="w1.interactive",
                    next_chunk=1, queued_at_s=1.0)
    assert load_of(ended) == 0.0
    # but not one queued there before the heartbeat, which lists what w1 holds since
    assert load_of(replace(ended, queued_at_s=-1.0)) == pytest.approx(3.0)
    # nor one only placed there (it has not run: nothing was built)
    assert load_of(replace(ended, queue="w1.interactive.placed", next_chunk=0)) == \
        pytest.approx(3.0)


def test_built_models_join_a_holding_and_take_its_free_bytes() -> None:
    from scheduler.placement import built_on

    w = Holding("w1", 0.0, frozenset({"a"}), frozenset({"b"}), frozenset(), 2, 3 * MB)
    # when w1 ran a chunk on b (with adapter "ink") and one on a, and w9 (unknown) one on c
    after = built_on([w], [("w1", ModelNeed("b", frozenset({"ink"}), MB)),
                           ("w1", ModelNeed("a", frozenset(), MB)),
                           ("w9", ModelNeed("c", frozenset(), MB))])
    # then w1 holds a and b on its device, b no longer only in host memory, b's bytes taken
    assert after == [Holding("w1", 0.0, frozenset({"a", "b"}), frozenset(),
                             frozenset({"ink"}), 2, 2 * MB)]
    assert built_on([w], []) == [w]


def test_a_chunk_parked_on_a_worker_that_evicted_its_model_is_marked_for_the_tick() -> None:
    from tasks.load_estimates import ExpectedLoads
    from tasks.snapshot import job_view
    from tests.unit.test_scheduler_support import make_snapshot

    # given w1 now holding m2 only (it evicted m1), w2 holding m1, both beating since the hop
    beats = {"w1": _beat("w1", {_sim_key("m2"): MB}), "w2": _beat("w2", {_sim_key("m1"): MB})}
    hop = replace(_sim("m1", "hop", state=JobState.QUEUED), queue="w1.batch", next_chunk=1,
                  queued_at_s=-1.0)
    records = {r.job_id: r for r in (
        hop,  # its last chunk ran on w1: its next waits on w1's own queue
        replace(hop, job_id="home", params={**hop.params, "model": "m2"}),  # w1 holds m2
        replace(hop, job_id="placed", queue="w1.batch.placed"),  # placed to load there
        replace(hop, job_id="gone", queue="w9.batch"),  # no heartbeat: recovery's business
        replace(hop, job_id="class", queue="batch"))}  # not parked
    snapshot = make_snapshot([job_view(r) for r in records.values()])
    # when the Stepline placement's tick reads the heartbeats
    planned = ExpectedLoads().apply(_placing("stepline"), snapshot, records, beats)
    # then only the hop whose worker no longer holds its model is marked
    assert {v.job_id for v in planned.jobs if v.model_left} == {"hop"}
    # a worker loading the model (its heartbeat's announcement) still holds it
    loading = {**beats, "w1": _beat("w1", {_sim_key("m2"): MB},
                                    loading={"model": _sim_key("m1"), "since": 0.0})}

    def left(beats: dict[str, Heartbeat], hop: JobRecord) -> bool:
        records = {"hop": hop}
        planned = ExpectedLoads().apply(_placing("stepline"),
                                        make_snapshot([job_view(hop)]), records, beats)
        return planned.jobs[0].model_left

    assert left(beats, hop)
    assert not left(loading, hop)
    # a heartbeat older than the hop may predate the load of the chunk that just ran
    assert not left(beats, replace(hop, queued_at_s=5.0))
    assert not left({**beats, "w1": replace(beats["w1"], ts=None)}, hop)


def test_a_chunk_parked_on_a_busy_worker_is_marked_when_an_idle_worker_holds_its_model() -> None:
    from tasks.load_estimates import ExpectedLoads
    from tasks.snapshot import job_view
    from tests.unit.test_scheduler_support import make_snapshot, running

    # given w1 runs job "busy"; chunks of m1 wait on w1's own queues; idle w2 holds m1 and the
    # adapter "ink", idle w3 holds m1 alone; w4 holds m1 but a chunk is placed on it
    beats = {"w1": _beat("w1", {_sim_key("m1"): MB}, busy="busy"),
             "w2": _beat("w2", {_sim_key("m1"): MB}, adapters={_sim_key("m1"): ["ink"]}),
             "w3": _beat("w3", {_sim_key("m1"): MB}),
             "w4": _beat("w4", {_sim_key("m1"): MB})}
    hop = replace(_sim("m1", "hop", state=JobState.QUEUED), queue="w1.batch", next_chunk=1,
                  queued_at_s=-1.0)
    styled = replace(hop, job_id="styled", deadline_at_s=150.0,
                     params={**hop.params, "adapters": [{"name": "ink", "scale": 1.0}]})
    records = {r.job_id: r for r in (
        hop, styled,
        replace(hop, job_id="placed", queue="w1.batch.placed", deadline_at_s=900.0),
        replace(hop, job_id="onw4", queue="w4.batch.placed"),
        replace(hop, job_id="class", queue="batch"))}  # not parked

    def marked(beats: dict[str, Heartbeat], *running_jobs: Any) -> set[str]:
        views = [job_view(r) for r in records.values()]
        snapshot = make_snapshot([*views, *running_jobs])
        planned = ExpectedLoads().apply(_placing("stepline"), snapshot, records, beats)
        return {v.job_id for v in planned.jobs if v.idle_holder}

    # when the tick reads the heartbeats: w1 runs "busy", so its parked chunks are candidates,
    # earliest deadline first: the styled one takes w2, the only holder of "ink", the hop
    # w3; the one placed there with the latest deadline finds no idle holder left (w4 has a
    # chunk parked on it)
    on_w1 = running("busy", "w1")
    assert marked(beats, on_w1) == {"styled", "hop"}
    # with w1 idle in the snapshot nothing moves: it takes its own chunks next
    assert marked(beats) == set()
    # an idle worker whose heartbeat says it runs a chunk is not idle
    assert marked({**beats, "w3": _beat("w3", {_sim_key("m1"): MB}, busy="x")}, on_w1) == \
        {"styled"}
    # the baselines' placements mark nothing
    snapshot = make_snapshot([*(job_view(r) for r in records.values()), on_w1])
    assert ExpectedLoads().apply(_placing("warm"), snapshot, records, beats) is snapshot


# the simulated job's model params --------------------------------------------------------------
def test_simulated_model_params_are_validated_and_stored_only_with_a_model() -> None:
    plain = validate_params("simulated", {"steps": 2})
    assert "model" not in plain and "adapters" not in plain
    stored = validate_params("simulated", {"model": "m1", "model_bytes": 4096, "load_ms": 800,
                                           "adapters": [{"name": "ink", "load_ms": 300}]})
    assert stored["host_load_ms"] == 200.0  # a quarter of the load from disk
    assert stored["adapters"] == [{"name": "ink", "load_ms": 300.0}]
    with pytest.raises(InvalidJob, match="name it"):
        validate_params("simulated", {"load_ms": 800})
    with pytest.raises(InvalidJob, match="each adapter once"):
        validate_params("simulated", {"model": "m1", "adapters": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(InvalidJob, match="model_bytes"):
        validate_params("simulated", {"model": "m1", "model_bytes": 0})
    with pytest.raises(InvalidJob, match="model"):
        validate_params("simulated", {"model": "a b"})


# when a busy worker frees up, as the tick's snapshot tells ------------------------------------
def test_a_workers_free_time_is_the_work_that_stays_on_it() -> None:
    from tasks.adapter import busy_free_in_s
    from tests.unit.test_scheduler_support import (
        NOW_S,
        make_job,
        make_snapshot,
        running,
    )

    snapshot = make_snapshot([
        running("a", "w1", work_s=2.0, chunk_running_since_s=NOW_S - 0.5),
        running("b", "w2", work_s=2.0, chunk_running_since_s=NOW_S - 5.0),
        running("c", "w3", work_s=2.0),  # not known when its chunk began
        make_job("d", state=JobState.QUEUED, work_s=1.0, queue="w3.batch", parked_on="w3"),
        make_job("e", state=JobState.QUEUED, work_s=1.0, queue="batch"),
    ])
    free = busy_free_in_s(snapshot, NOW_S)
    # w1: 2 s of work less the 0.5 s its chunk ran; w2 overdue; w3: its job and the parked one
    assert free == {"w1": pytest.approx(1.5), "w2": 0.0, "w3": pytest.approx(3.0)}


def test_a_chunk_placed_after_a_workers_heartbeat_counts_toward_its_free_time() -> None:
    settings, job = _placing("stepline"), _sim("m1")
    warm = _beat("w1", {_sim_key("m1"): MB})  # written at ts 0.0
    cold = _beat("w2", {})
    estimates = LoadEstimates()
    estimates.observe("simulated:m1", "disk", 0.5)
    # 3 s of work given to w1 after its heartbeat: a 0.5 s load on w2 starts sooner
    marked = WorkerDirectory({"w1": warm, "w2": cold}, placed={"w1": [(5.0, 3.0)]},
                             learned=LearnedLoads(estimates))
    assert release_queue(settings, job, "interactive", marked) == "w2.interactive.placed"
    # 0.1 s of it: w1 still starts sooner
    short = WorkerDirectory({"w1": warm, "w2": cold}, placed={"w1": [(5.0, 0.1)]},
                            learned=LearnedLoads(estimates))
    assert release_queue(settings, job, "interactive", short) == "w1.interactive.placed"
    # given before the heartbeat was written: the heartbeat counts it
    stale_mark = WorkerDirectory({"w1": warm, "w2": cold}, placed={"w1": [(-1.0, 3.0)]},
                                 learned=LearnedLoads(estimates))
    assert release_queue(settings, job, "interactive", stale_mark) == "w1.interactive.placed"
    # the tick's free times count the chunks placed up to its read: only later ones add
    tick = WorkerDirectory({"w1": warm, "w2": cold}, busy_free_in_s={"w1": 0.2},
                           placed={"w1": [(5.0, 3.0)]}, counted_until_s=6.0,
                           learned=LearnedLoads(estimates))
    assert release_queue(settings, job, "interactive", tick) == "w1.interactive.placed"


def test_without_the_ticks_estimate_a_busy_workers_heartbeat_tells_when_its_job_ends() -> None:
    settings, job = _placing("stepline"), _sim("m1")
    began = Heartbeat(name="w1", busy_job="other", ts=10.0, chunk_since=10.0, left_s=0.2,
                      queues=_beat("w1", {}).queues,
                      residency={"device": {_sim_key("m1"): MB}, "budget_bytes": 2 * MB})
    assert began.free_in_s(10.05) == pytest.approx(0.15)
    assert Heartbeat.decode(began.encode()) == began
    cold = _beat("w2", {})
    soon = WorkerDirectory({"w1": began, "w2": cold}, learned=LearnedLoads(), now_s=10.05)
    assert release_queue(settings, job, "interactive", soon) == "w1.interactive.placed"
    unknown = replace(began, left_s=None)
    assert unknown.free_in_s(10.05) is None
    late = WorkerDirectory({"w1": unknown, "w2": cold}, learned=LearnedLoads(), now_s=10.05)
    assert release_queue(settings, job, "interactive", late) == "w2.interactive.placed"


# staging into host memory ----------------------------------------------------------------------
def test_a_model_whose_queue_builds_is_staged_on_the_worker_free_soonest_with_host_room() -> None:
    # given m2 with three jobs waiting and held by no worker, m3 with one, m1 held
    waiting = [_sim("m2", "a"), _sim("m2", "b", JobState.QUEUED), _sim("m2", "c"),
               _sim("m3", "d"), _sim("m1", "e"), _sim("m1", "f")]
    stager = {"stager": True, "host_budget_bytes": 4 * MB}
    directory = _directory(
        {"w1": 5.0, "w2": 1.0}, queued_demand(waiting),
        w1=_beat("w1", {_sim_key("m1"): MB}, **stager),
        w2=_beat("w2", {_sim_key("m4"): MB}, **stager),
        w3=_beat("w3", {}, host_budget_bytes=4 * MB))  # no stager thread: never asked
    # when the tick asks which models to stage
    asked = directory.stage_models(waiting, min_queued=2)
    # then m2 goes to w2 (free soonest, host room), with a waiting job's params to build it
    assert [(w, m, r.params["model"]) for w, m, r in asked] == [("w2", "simulated:m2", "m2")]
    assert asked[0][2].kind is JobKind.SIMULATED and asked[0][2].params["model_bytes"] == MB
    # and nothing when the queue is short, or no worker has host room
    assert directory.stage_models(waiting, min_queued=4) == []
    assert directory.stage_models(waiting, min_queued=0) == []
    full = _directory({}, queued_demand(waiting), w1=_beat(
        "w1", {}, stager=True, host_budget_bytes=MB, host={_sim_key("m5"): MB}))
    assert full.stage_models(waiting, min_queued=2) == []


def test_the_models_held_anywhere_are_read_from_every_tier_and_staging() -> None:
    beats = [_beat("w1", {_sim_key("m1"): MB, "text:moe:qwen3-moe-tiny": MB},
                   host={_sim_key("m2"): MB}),
             _beat("w2", {}, staging=[_sim_key("m3")])]
    assert held_models(beats) == {"simulated:m1", "simulated:m2", "simulated:m3"}


def test_a_model_a_worker_is_staging_counts_as_held_in_its_host_memory() -> None:
    waiting = [_sim("m2", "a"), _sim("m2", "b")]
    beat = _beat("w1", {}, stager=True, host_budget_bytes=None, staging=[_sim_key("m2")])
    assert holding("w1", beat, 0.0).host == {"simulated:m2"}
    assert _directory({}, queued_demand(waiting), w1=beat).stage_models(waiting, 2) == []
    # an unlimited host tier has room for more; a model being staged takes one slot, however
    # many of its residency keys the heartbeat names
    assert host_slots(beat, MB) > 1 and host_slots(_beat("w2", {}), MB) == 0
    two_keys = _beat("w3", {}, stager=True, host_budget_bytes=3 * MB,
                     staging=["diffusion:dit-tiny", "diffusion:dit-tiny:cpu:seeded"])
    assert host_slots(two_keys, MB) == 2


def test_a_stage_request_is_validated_before_a_worker_reads_anything() -> None:
    request = StageRequest(kind=JobKind.SIMULATED, params={"model": "m1", "model_bytes": MB})
    assert StageRequest.model_validate_json(request.model_dump_json()) == request
    with pytest.raises(ValueError, match="kind"):
        StageRequest.model_validate_json('{"kind": "teleport", "params": {}}')
    with pytest.raises(ValueError, match="extra"):
        StageRequest.model_validate_json('{"kind": "simulated", "params": {}, "x": 1}')


def test_a_release_with_slack_waits_for_the_busy_warm_worker_an_urgent_one_loads() -> None:
    settings = _placing("stepline")

    def released(deadline_at_s: float) -> str:
        directory = _directory({"w1": 20.0, "w2": 0.5}, {"simulated:m1": 1},
                               w1=_beat("w1", {_sim_key("m1"): MB}, busy="x"),
                               w2=_beat("w2", {}))
        directory.now_s = 100.0
        job = replace(_sim("m1"), deadline_at_s=deadline_at_s)
        return release_queue(settings, job, "interactive", directory)

    # w1 holds m1 but is busy for 20 s; w2 is free in 0.5 s and loads it in 0.5 s
    assert released(deadline_at_s=130.0) == "w2.interactive.placed"  # 20 s > half its slack
    assert released(deadline_at_s=160.0) == "w1.interactive.placed"  # 20 s < half of ~60 s


def test_a_worker_loading_its_chunks_model_is_free_after_the_load_and_the_work() -> None:
    """The heartbeat announces the load a running chunk waits for: the tick adds the rest of
    it, and counts the chunk's work as run only from the load's end (as the simulator, which
    knows when a load ends)."""
    from tasks.adapter import busy_free_in_s
    from tests.unit.test_scheduler_support import NOW_S, make_snapshot, running

    since = NOW_S - 1.0
    snapshot = make_snapshot([running("a", "w1", work_s=2.0, chunk_running_since_s=since),
                              running("b", "w2", work_s=2.0, chunk_running_since_s=since),
                              running("c", "w3", work_s=2.0, chunk_running_since_s=since)])

    def beat(name: str, job: str, residency: dict[str, object],
             chunk_since: float = since) -> Heartbeat:
        return Heartbeat(name=name, busy_job=job, chunk_since=chunk_since, left_s=2.0,
                         residency=residency)

    loading = {"loading": {"model": "simulated:m1", "since": since + 0.1, "expected_s": 3.0}}
    beats = {
        "w1": beat("w1", "a", loading),  # 1.1 s of its 3 s load to come, then 2 s of work
        "w2": beat("w2", "b", {"loaded_at": since + 0.5}),  # its work began 0.5 s ago
        "w3": beat("w3", "c", loading, chunk_since=since - 4.0),  # about an earlier chunk
    }
    free = busy_free_in_s(snapshot, NOW_S, beats)
    assert free == {"w1": pytest.approx(2.1 + 2.0), "w2": pytest.approx(1.5),
                    "w3": pytest.approx(1.0)}
    # a heartbeat of another job says nothing of this one
    assert busy_free_in_s(snapshot, NOW_S, {"w1": beat("w1", "zz", loading)})["w1"] \
        == pytest.approx(1.0)
    # the heartbeat's own estimate (a submit's, before the tick's) counts the load alike
    assert beats["w1"].free_in_s(NOW_S) == pytest.approx(4.1)
    # a load of unknown length: nothing of the work has run yet
    unknown = beat("w1", "a", {"loading": {"model": "simulated:m1", "since": since + 0.1}})
    assert busy_free_in_s(snapshot, NOW_S, {"w1": unknown})["w1"] == pytest.approx(2.0)
    # and the model it loads counts as on its device for placement
    assert "simulated:m1" in holding("w1", beats["w1"], 0.0).device


def test_a_load_the_worker_could_not_size_is_sized_by_the_learned_load_times() -> None:
    """A first load on a worker that never measured one: the heartbeat names the model and
    the tier, and the tick sizes the load by what it learned from every worker."""
    from tasks.adapter import busy_free_in_s
    from tests.unit.test_scheduler_support import NOW_S, make_snapshot, running

    since = NOW_S - 1.0
    unsized = Heartbeat(name="w1", busy_job="a", chunk_since=since, left_s=2.0, residency={
        "loading": {"model": "simulated:m7", "since": since, "from": "disk"}})
    assert unsized.load_phase(since, NOW_S, lambda key, tier: 3.0) == (2.0, NOW_S)
    assert unsized.load_phase(since, NOW_S) == (0.0, NOW_S)  # no estimate: 0 still to come
    snapshot = make_snapshot([running("a", "w1", work_s=2.0, chunk_running_since_s=since)])
    learned = LearnedLoads()
    expected = learned.window_estimate("simulated:m7", "disk")
    assert expected > 0.0 and learned.window_estimate("moe:x", "disk") == 0.0
    free = busy_free_in_s(snapshot, NOW_S, {"w1": unsized}, learned)["w1"]
    assert free == pytest.approx(max(expected - 1.0, 0.0) + 2.0)


def test_a_worker_names_the_model_it_stages_once_from_the_request_to_the_build() -> None:
    """The stager is asked for a model by its placement name; once the residency builds it,
    the heartbeat lists its residency key instead of both."""
    from tasks.context import staging_list

    assert staging_list([], None) == []
    assert staging_list([], "diffusion:dit-tiny") == ["diffusion:dit-tiny"]
    building = ["diffusion:dit-tiny:cpu:seeded"]
    assert staging_list(building, "diffusion:dit-tiny") == building
    assert staging_list([_sim_key("m1")], _sim_key("m1")) == [_sim_key("m1")]
    # another model's build does not hide the asked one
    assert staging_list([_sim_key("m2")], _sim_key("m1")) == [_sim_key("m2"), _sim_key("m1")]
