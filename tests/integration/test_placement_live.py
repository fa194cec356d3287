"""Placement by model residency on real workers: two worker processes whose budgets hold two
simulated models each serve jobs of four models. Released one at a time (each to two idle
workers with fresh heartbeats), Stepline's placement loads each model once — the first two on
one worker, the next two on the one with room, then every job finds its model warm — while the
model-oblivious placement of the same submissions loads more; neither worker ever holds more
than its budget (tensor bytes, measured, in the heartbeats)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.heartbeat import Heartbeat
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL_BYTES = 1 << 20
BUDGET = 2 * MODEL_BYTES
WORKERS = ("w1@test", "w2@test")
ORDER = (1, 1, 2, 2, 3, 3, 4, 4, 1, 2, 3, 4)
"""Which of the four models each job runs on. Any placement that does not keep each model on
one worker with room for it loads more than four times: a worker taking jobs of three models
evicts one."""


def _params(model: str) -> dict[str, Any]:
    return {"steps": 1, "step_ms": 50.0, "model": model, "model_bytes": MODEL_BYTES,
            "load_ms": 150.0, "host_load_ms": 50.0}


def _loads(beats: dict[str, Heartbeat]) -> int:
    return sum(int(beats[w].residency.get("loads", {}).get(tier, 0))
               for w in WORKERS for tier in ("disk", "host"))


def test_stepline_placement_loads_each_model_once_where_oblivious_placement_reloads(
    processes: Processes, redis_client: redis.Redis
) -> None:
    env = {"STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(BUDGET), "STEPLINE_WARM_START": "false",
           "STEPLINE_BROKER__CHUNK_LEASE": "0.6"}  # a heartbeat every 0.2 s
    processes.worker("w1", extra_env=env)
    processes.worker("w2", extra_env=env)
    wait_for_workers(redis_client, ["w1", "w2"])
    store = JobStore(redis_client)
    peaks: list[int] = []
    chunks = 0

    def settled() -> dict[str, Heartbeat] | None:
        """Both heartbeats written after every chunk so far, both idle: what placement reads
        for the next release is then exact, not a beat behind."""
        beats = store.heartbeats()
        if set(WORKERS) - set(beats):
            return None
        for w in WORKERS:
            peaks.append(beats[w].resident_bytes("device"))
        fresh = sum(beats[w].chunks_run for w in WORKERS) == chunks
        return beats if fresh and all(beats[w].busy_job is None for w in WORKERS) else None

    def run(placement: str, prefix: str) -> int:
        """The jobs of ``ORDER`` on models ``<prefix>1..4``, one at a time; the loads they
        caused (from the heartbeats)."""
        nonlocal chunks
        settings = current_settings()
        service = JobService(store, settings.model_copy(update={
            "affinity": settings.affinity.model_copy(update={"placement": placement})}))
        before = _loads(wait_for(settled, 30, "settled heartbeats"))  # type: ignore[arg-type]
        for n in ORDER:
            job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                                               params=_params(f"{prefix}{n}"), deadline_s=120))
            wait_for(lambda j=job_id: store.state(j) is JobState.DONE, 30, f"job {job_id}")
            chunks += 1
            wait_for(settled, 30, "the heartbeats after the job")
        return _loads(wait_for(settled, 30, "settled heartbeats")) - before  # type: ignore[arg-type]

    # fresh workers first: Stepline's choices follow from what the heartbeats say they hold
    stepline = run("stepline", "s")
    oblivious = run("oblivious", "o")

    assert stepline == 4  # each model loaded once, every later job warm
    assert oblivious > stepline
    beats = store.heartbeats()
    for w in WORKERS:
        residency = beats[w].residency
        assert residency["budget_bytes"] == BUDGET
        assert residency["peak_device_bytes"] <= BUDGET
        assert len(residency["device"]) <= 2
    assert max(peaks) <= BUDGET


def test_a_submit_places_by_the_last_ticks_view_of_the_work_parked_on_each_worker(
    redis_client: redis.Redis,
) -> None:
    from tasks.affinity import PlacementView, publish_placement_view, release_queue
    from tasks.affinity import WorkerDirectory as Directory
    from tasks.heartbeat import write_heartbeat
    from tasks.record import JobRecord
    from tasks.routing import with_affinity

    settings = current_settings()
    settings = settings.model_copy(update={"affinity": settings.affinity.model_copy(
        update={"placement": "stepline"})})
    store = JobStore(redis_client)
    def read() -> Directory:
        """Two idle workers by their heartbeats (written after any placement so far): w1 holds
        m1, w2 holds nothing."""
        pipe = redis_client.pipeline()
        for name, device in (("w1@view", {"simulated:m1": MODEL_BYTES}), ("w2@view", {})):
            write_heartbeat(pipe, Heartbeat(
                name=name, ts=time.time() + 1.0,
                queues=with_affinity(name, ("interactive", "batch")),
                residency={"device": device, "host": {}, "budget_bytes": BUDGET}), lease_s=30.0)
        pipe.execute()
        return Directory.read(store)

    job = JobRecord(job_id="j-view", kind="simulated", slo=SloClass.INTERACTIVE, tenant="t",
                    params=_params("m1"), submitted_at_s=0.0, deadline_at_s=60.0, num_chunks=1,
                    cost_key="simulated", cost_units=(0.05,), state=JobState.PENDING,
                    queue="interactive", next_chunk=0, seq=0, epoch=0, updated_at_s=0.0)
    # when no tick has published a view, the submit sees w1 idle and warm
    assert release_queue(settings, job, "interactive", read()) == \
        "w1@view.interactive.placed"
    # but once the tick counted 30 s of work parked on w1, a load on w2 starts sooner
    publish_placement_view(store, PlacementView(time.time(), {"w1@view": 30.0},
                                                {"simulated:m1": 3}), ttl_s=10.0)
    assert release_queue(settings, job, "interactive", read()) == \
        "w2@view.interactive.placed"
    # a view that cannot be read is ignored: placement goes by the heartbeats
    redis_client.set("sl:placement", b"{not json")
    assert release_queue(settings, job, "interactive", read()) == \
        "w1@view.interactive.placed"


def test_the_tick_stages_a_model_whose_queue_builds_into_a_workers_host_memory(
    processes: Processes, redis_client: redis.Redis
) -> None:
    # given one worker busy with a long job on m0, its device holding one model and its host
    # memory four, and the scheduler placing by residency
    processes.env.update({
        "STEPLINE_AFFINITY__PLACEMENT": "stepline", "STEPLINE_WARM_START": "false",
        "STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(MODEL_BYTES),
        "STEPLINE_RESIDENCY__HOST_MEMORY_BUDGET_BYTES": str(4 * MODEL_BYTES),
        "STEPLINE_BROKER__CHUNK_LEASE": "3"})
    processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    processes.scheduler()
    store = JobStore(redis_client)
    settings = current_settings()
    service = JobService(store, settings.model_copy(update={
        "affinity": settings.affinity.model_copy(update={"placement": "stepline"})}))

    def submit(model: str, step_ms: float) -> str:
        params = {**_params(model), "step_ms": step_ms, "load_ms": 1500.0, "host_load_ms": 20.0}
        job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, params=params,
                                           deadline_s=300))
        return job_id

    long_job = submit("m0", 8000.0)
    wait_for(lambda: store.state(long_job) is JobState.RUNNING, 30, "the long job running")
    # when three jobs of m1, which no worker holds, queue behind it
    queued = [submit("m1", 50.0) for _ in range(3)]

    # then the tick asks the worker to read m1 into host memory while the long job runs, and
    # m1's first chunk moves it from there instead of reading it from disk
    def staged() -> Heartbeat | None:
        beat = store.heartbeats().get("w1@test")
        return beat if beat is not None and beat.residency.get("staged") else None

    beat = wait_for(staged, 30, "m1 staged")
    assert beat.busy_job == long_job  # type: ignore[attr-defined]  # read beside its chunk
    assert "simulated:m1" in beat.residency["host"]  # type: ignore[attr-defined]
    for job_id in [long_job, *queued]:
        wait_for(lambda j=job_id: store.state(j) is JobState.DONE, 60, f"job {job_id}")

    def settled() -> dict[str, Any] | None:
        beat = store.heartbeats().get("w1@test")
        return beat.residency if beat is not None and beat.busy_job is None \
            and beat.chunks_run >= 4 else None

    residency = wait_for(settled, 30, "the worker's last heartbeat")
    assert residency["loads"] == {"disk": 1, "host": 1}, residency  # type: ignore[index]
    assert residency["staged"] == 1  # type: ignore[index]
    assert max(b for b in residency["device"].values()) <= MODEL_BYTES  # type: ignore[index]
    assert "asked w1@test to stage" in processes.log("scheduler")
    assert "w1@test staged simulated:m1 into host memory" in processes.log("w1")


def test_a_load_is_announced_in_the_heartbeat_and_left_out_of_the_chunks_timing(
    processes: Processes, redis_client: redis.Redis
) -> None:
    """A worker loading a job's model says so at once (the model, when it began, the declared
    seconds), so the tick counts the rest of the load into when it is free; the chunk's
    service and the cost model's sample are its work alone, the load left out (as the
    simulator times a chunk from its load's end)."""
    from tasks import keys

    env = {"STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(BUDGET), "STEPLINE_WARM_START": "false",
           "STEPLINE_BROKER__CHUNK_LEASE": "30"}  # a periodic beat only every 10 s
    processes.worker("w1", extra_env=env)
    wait_for_workers(redis_client, ["w1"])
    store = JobStore(redis_client)
    service = JobService(store, current_settings())
    params = {"steps": 2, "step_ms": 50.0, "model": "slow", "model_bytes": MODEL_BYTES,
              "load_ms": 1500.0}
    job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, params=params,
                                       deadline_s=120))
    announced = wait_for(lambda: store.heartbeats().get("w1@test", Heartbeat("w1")).residency
                         .get("loading"), 30, "the load announced in the heartbeat")
    beat = store.heartbeats()["w1@test"]
    assert announced["model"] == "simulated:slow" and announced["expected_s"] == 1.5
    assert beat.busy_job == job_id and beat.chunk_since is not None
    assert announced["since"] >= beat.chunk_since
    # what the tick reads of it: the rest of the load still to come, no work run yet
    phase = beat.load_phase(beat.chunk_since, time.time())
    assert phase is not None and 0.0 < phase[0] <= 1.5
    wait_for(lambda: store.state(job_id) is JobState.DONE, 60, "the job")
    ended = wait_for(lambda: store.heartbeats()["w1@test"].residency.get("loaded_at"), 60,
                     "the load's end in the heartbeat")
    assert ended >= announced["since"] + 1.4
    # then each chunk's service lies after the load's end: its work alone, the load left out
    commits = [e for e in store.events(job_id) if e["kind"] == "commit"]
    assert commits
    for commit in commits:
        assert float(commit["ts"]) - float(commit["service_s"]) >= ended - 1e-3, (commit, ended)
    # and the cost model's samples are those services per unit, no more
    samples = [float(f["s_per_unit"]) for _, f in store.read_stream(keys.TIMINGS)
               if f["cost_key"].startswith("simulated")]
    units = store.record(job_id).cost_units
    print(f"load: chunk services {[c['service_s'] for c in commits]} s, samples {samples} s/unit")
    assert samples == pytest.approx(
        [float(c["service_s"]) / units[int(c["chunk"])] for c in commits], rel=1e-3)


def test_a_chunk_whose_model_left_its_worker_is_placed_anew_on_the_worker_holding_it(
    redis_client: redis.Redis,
) -> None:
    """The tick's MODEL_LEFT recovery on the real store: the job's next chunk, parked on the
    own queue of a worker that has since evicted its model, is released like a release is,
    through placement, to the worker that holds the model now (under a new epoch: the parked
    message is stale)."""
    from scheduler.recovery import Recovery, RecoveryCause
    from tasks.adapter import LiveTarget
    from tasks.heartbeat import write_heartbeat
    from tasks.routing import with_affinity

    settings = current_settings()
    settings = settings.model_copy(update={"affinity": settings.affinity.model_copy(
        update={"placement": "stepline"})})
    store = JobStore(redis_client)
    job_id, _ = JobService(store, settings).submit(JobSpec(
        kind="simulated", slo=SloClass.INTERACTIVE, params=_params("m1"), deadline_s=60))
    # given its first chunk ran on w1, which evicted m1 for m2 since; w2 holds m1
    store.set_fields(job_id, state=JobState.QUEUED, queue="w1@left.interactive",
                     next_chunk=1, service_s=0.05)
    pipe = redis_client.pipeline()
    for name, model in (("w1@left", "m2"), ("w2@left", "m1")):
        write_heartbeat(pipe, Heartbeat(
            name=name, ts=time.time() + 1.0, queues=with_affinity(name, ("interactive", "batch")),
            residency={"device": {f"simulated:{model}": MODEL_BYTES}, "host": {},
                       "budget_bytes": MODEL_BYTES}), lease_s=30.0)
    pipe.execute()
    seen = store.record(job_id)
    # when the tick recovers it
    target = LiveTarget(store, {job_id: seen}, settings)
    assert target.recover(Recovery(job_id, RecoveryCause.MODEL_LEFT, "w1@left evicted m1"))
    # then its next chunk waits on w2's placement queue under a new epoch
    moved = store.record(job_id)
    assert moved.state is JobState.QUEUED
    assert moved.queue == "w2@left.interactive.placed"
    assert moved.epoch == seen.epoch + 1
    assert moved.next_chunk == 1


def test_a_chunk_parked_on_a_busy_worker_moves_to_an_idle_worker_holding_its_model(
    redis_client: redis.Redis,
) -> None:
    """The tick's IDLE_HOLDER move on the real store, from the read to the release: a job's
    next chunk waits on the own queue of a worker running another job's chunk while an idle
    worker holds its model; the tick's read marks it (``tasks.load_estimates.ExpectedLoads``), the
    plan recovers it, and the release places it on the idle worker's placement queue under a
    new epoch (the parked message is stale)."""
    from scheduler import plan_tick
    from scheduler.recovery import RecoveryCause
    from tasks.adapter import LiveTarget, policy_config
    from tasks.heartbeat import write_heartbeat
    from tasks.load_estimates import ExpectedLoads
    from tasks.routing import with_affinity
    from tasks.snapshot import learned_cost_model, read_snapshot

    settings = current_settings()
    settings = settings.model_copy(update={"affinity": settings.affinity.model_copy(
        update={"placement": "stepline"})})
    store = JobStore(redis_client)
    service = JobService(store, settings)
    busy, waiting = (service.submit(JobSpec(kind="simulated", slo=SloClass.INTERACTIVE,
                                            params=_params("m1"), deadline_s=60))[0]
                     for _ in range(2))
    # given w1 runs "busy" and holds m1, "waiting" parked on w1's own queue, w2 idle with m1
    now = time.time()
    store.set_fields(busy, state=JobState.RUNNING, queue="w1@idle.interactive",
                     running_on="w1@idle", lease_until_s=now + 30.0, next_chunk=0)
    store.set_fields(waiting, state=JobState.QUEUED, queue="w1@idle.interactive",
                     next_chunk=1, service_s=0.05, queued_at_s=now - 0.1)
    pipe = redis_client.pipeline()
    for name, job in (("w1@idle", busy), ("w2@idle", None)):
        write_heartbeat(pipe, Heartbeat(
            name=name, ts=now, busy_job=job, batch=1 if job else 0,
            queues=with_affinity(name, ("interactive", "batch")),
            residency={"device": {"simulated:m1": MODEL_BYTES}, "host": {},
                       "budget_bytes": BUDGET}), lease_s=30.0)
    pipe.execute()
    # when the tick reads, marks, plans and applies the recovery
    policy = policy_config(settings, store)
    seen = read_snapshot(store, learned_cost_model(store, policy), policy, now)
    snapshot = ExpectedLoads().apply(settings, seen.snapshot, seen.records, seen.heartbeats)
    assert {v.job_id for v in snapshot.jobs if v.idle_holder} == {waiting}
    plan = plan_tick(snapshot, policy, now)
    moves = [r for r in plan.recoveries if r.job_id == waiting]
    assert [r.cause for r in moves] == [RecoveryCause.IDLE_HOLDER]
    before = store.record(waiting)
    assert LiveTarget(store, dict(seen.records), settings).recover(moves[0])
    # then its next chunk waits on w2's placement queue under a new epoch
    moved = store.record(waiting)
    assert moved.state is JobState.QUEUED
    assert moved.queue == "w2@idle.interactive.placed"
    assert moved.epoch == before.epoch + 1 and moved.next_chunk == 1
