"""Step-level batching on real Celery workers and a real redis-server: batches form, grow and
split at step boundaries, and each job stays fenced by its own epoch and sequence number."""

from __future__ import annotations

import json
import time

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _stack(processes: Processes, client: redis.Redis, workers: int) -> JobService:
    """A tick and ``workers`` workers; the submit path, once the tick runs (while none does,
    submit releases every job alone at once: batches are the tick's to form)."""
    processes.scheduler()
    names = [f"w{k + 1}" for k in range(workers)]
    for name in names:
        processes.worker(name)
    wait_for_workers(client, names)
    wait_for(lambda: client.get(keys.ADMISSION), 30, "the first tick")
    return JobService(JobStore(client), current_settings())


def _batchable(steps: int, step_ms: float, slo: SloClass = SloClass.INTERACTIVE,
               deadline_s: float = 600) -> JobSpec:
    return JobSpec(kind="simulated", slo=slo, deadline_s=deadline_s,
                   params={"steps": steps, "step_ms": step_ms, "batch_growth": 0.2})


def _commits(store: JobStore, job_id: str) -> list[dict[str, str]]:
    return [e for e in store.events(job_id) if e["kind"] == "commit"]


def _all_done(store: JobStore, job_ids: list[str]) -> bool:
    states = [store.state(j) for j in job_ids]
    assert not {JobState.FAILED, JobState.CANCELLED} & set(states), [
        store.fields(j) for j in job_ids]
    return all(s is JobState.DONE for s in states)


def _applied(store: JobStore, job_id: str) -> list[int]:
    artifact = store.record(job_id).artifact
    assert artifact is not None
    body = json.loads(current_settings().artifacts_path.joinpath(artifact).read_bytes())
    return list(body["applied"])


def _batch_tasks(store: JobStore, job_id: str) -> set[str]:
    """The batch messages (their shared suffix) that ran the job's chunks."""
    return {c["task"] for c in _commits(store, job_id) if c["task"].startswith("batch.")}


@pytest.mark.parametrize("direct", [True, False], ids=["direct-publish", "celery-publish"])
def test_compatible_jobs_run_together_and_each_commits_every_chunk_once(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    direct: bool,
) -> None:
    # given a tick and a worker that put batch messages on the queues themselves, or through
    # Celery's send_task
    processes.env["STEPLINE_BROKER__DIRECT_PUBLISH"] = str(direct).lower()
    monkeypatch.setenv("STEPLINE_BROKER__DIRECT_PUBLISH", str(direct).lower())
    current_settings.cache_clear()
    service = _stack(processes, redis_client, workers=1)

    job_ids = [service.submit(_batchable(steps=12, step_ms=40))[0] for _ in range(4)]

    wait_for(lambda: _all_done(service.store, job_ids), 90, "the batched jobs to finish")
    for job_id in job_ids:
        commits = _commits(service.store, job_id)
        assert [int(c["chunk"]) for c in commits] == list(range(12))
        assert _applied(service.store, job_id) == list(range(12))
    shared = set.intersection(*(_batch_tasks(service.store, j) for j in job_ids))
    assert shared, "no step ran all four jobs in one batch task"
    # and the cost model was taught the batched step, under its own key
    timed = {fields[b"cost_key"].decode() for _, fields in redis_client.xrange(keys.TIMINGS)}
    assert any(key.endswith("@b4") for key in timed), timed


def test_a_job_preempted_out_of_a_batch_resumes_and_finishes_exactly(
    processes: Processes, redis_client: redis.Redis
) -> None:
    service = _stack(processes, redis_client, workers=2)
    store = service.store
    job_ids = [service.submit(_batchable(steps=30, step_ms=60))[0] for _ in range(3)]
    wait_for(lambda: all(store.record(j).next_chunk >= 3 for j in job_ids), 60,
             "the batch to run a few steps")

    victim = store.record(job_ids[0])
    assert store.request_preempt(victim.job_id, state=victim.state, epoch=victim.epoch)

    wait_for(lambda: store.record(victim.job_id).preemptions >= 1, 30, "the preemption")
    wait_for(lambda: _all_done(store, job_ids), 120, "every job to finish")
    assert _applied(store, victim.job_id) == list(range(30))
    assert [int(c["chunk"]) for c in _commits(store, victim.job_id)] == list(range(30))


def test_a_job_joins_a_running_batch_at_a_step_boundary(
    processes: Processes, redis_client: redis.Redis
) -> None:
    service = _stack(processes, redis_client, workers=1)
    store = service.store
    first = [service.submit(_batchable(steps=40, step_ms=50))[0] for _ in range(2)]
    wait_for(lambda: all(store.record(j).next_chunk >= 5 for j in first), 60,
             "the first batch to run a few steps")

    late, _ = service.submit(_batchable(steps=10, step_ms=50))

    wait_for(lambda: _all_done(store, [*first, late]), 120, "every job to finish")
    assert _applied(store, late) == list(range(10))
    assert _batch_tasks(store, late) & _batch_tasks(store, first[0]), \
        "the late job never ran in the first jobs' batch"


def test_a_worker_killed_mid_batch_loses_no_job(
    processes: Processes, redis_client: redis.Redis
) -> None:
    service = _stack(processes, redis_client, workers=2)
    store = service.store
    job_ids = [service.submit(_batchable(steps=40, step_ms=80))[0] for _ in range(4)]

    def running_on_w1() -> bool:
        return any(store.record(j).state is JobState.RUNNING
                   and (store.record(j).running_on or "").startswith("w1") for j in job_ids)

    wait_for(running_on_w1, 60, "a batch to run on w1")
    processes.kill("w1")

    wait_for(lambda: _all_done(store, job_ids), 150, "every job to finish on w2")
    for job_id in job_ids:
        assert _applied(store, job_id) == list(range(40))


def test_a_realtime_job_runs_alone_by_default(
    processes: Processes, redis_client: redis.Redis
) -> None:
    service = _stack(processes, redis_client, workers=1)
    store = service.store

    others = [service.submit(_batchable(steps=20, step_ms=30))[0] for _ in range(2)]
    urgent, _ = service.submit(_batchable(steps=5, step_ms=30, slo=SloClass.REALTIME,
                                          deadline_s=30))
    time.sleep(0.1)

    wait_for(lambda: _all_done(store, [*others, urgent]), 90, "every job to finish")
    assert store.record(urgent).batch_group is None
    assert not _batch_tasks(store, urgent)


def _image(seed: int, guidance: float, steps: int) -> JobSpec:
    return JobSpec(kind="image", slo=SloClass.INTERACTIVE, deadline_s=600,
                   params={"model": "dit-tiny", "class_label": 3 + seed % 5, "seed": seed,
                           "num_inference_steps": steps, "height": 32, "width": 32,
                           "guidance_scale": guidance, "scheduler": "dpmpp_2m"})


def _schedule(store: JobStore, job_ids: list[str]) -> list[list[tuple[str, int]]]:
    """Who ran with whom, step by step: the (job, chunk) pairs each batch task committed, in
    the order the tasks ran."""
    tasks: dict[str, list[tuple[float, str, int]]] = {}
    for job_id in job_ids:
        for c in _commits(store, job_id):
            tasks.setdefault(c["task"], []).append((float(c["ts"]), job_id, int(c["chunk"])))
    ordered = sorted(tasks.values(), key=lambda members: min(ts for ts, _, _ in members))
    return [[(job_id, chunk) for _, job_id, chunk in members] for members in ordered]


def test_a_job_that_joins_mid_way_finishes_with_the_output_its_batch_schedule_predicts(
    processes: Processes, redis_client: redis.Redis
) -> None:
    from workers.checkpoint import Checkpoint
    from workers.kinds import RunnerOptions, get_runner
    from workers.runner import BatchItem

    service = _stack(processes, redis_client, workers=1)
    store = service.store
    first = [service.submit(_image(seed, guidance, 100))[0]
             for seed, guidance in ((1, 1.0), (2, 4.0))]
    wait_for(lambda: all(store.record(j).next_chunk >= 4 for j in first), 90,
             "the first jobs to run a few steps")

    late, _ = service.submit(_image(3, 1.0, 16))  # joins the running batch at a step boundary

    jobs = [*first, late]
    wait_for(lambda: _all_done(store, jobs), 120, "every job to finish")
    schedule = _schedule(store, jobs)
    assert any({late, first[0]} <= {j for j, _ in step} for step in schedule), \
        "the late job never shared a step with the first ones"
    # replay the schedule in this process: each step as the worker ran it, in its order
    runner = get_runner("image", RunnerOptions(
        block_groups=current_settings().diffusion.block_groups))
    params = {j: dict(store.record(j).params) for j in jobs}
    states: dict[str, Checkpoint | None] = dict.fromkeys(jobs)
    outputs: dict[str, bytes] = {}
    for step in schedule:
        members = sorted(step)
        items = [BatchItem(params[j], chunk, states[j]) for j, chunk in members]
        for (j, _), result in zip(members, runner.run_batch(items), strict=True):  # type: ignore[attr-defined]
            states[j] = Checkpoint.decode(result.state.encode())
            if result.artifact is not None:
                outputs[j] = result.artifact.data
    for j in jobs:
        artifact = store.record(j).artifact
        assert artifact is not None
        live = current_settings().artifacts_path.joinpath(artifact).read_bytes()
        assert live == outputs[j], f"job {j}: the live output differs from its schedule's"
