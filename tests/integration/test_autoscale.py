"""The autoscaled stack on a real Redis with real worker processes: a burst scales the pool up to
MAX, the quiet after it drains the pool back to MIN, and no job is lost or changed; a worker
drained in the middle of a chunk finishes (or checkpoints) it and the job continues elsewhere."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from app.autoscale import read_events
from app.drills.faults import audit_job
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import ROOT, wait_for
from tests.integration.test_model_jobs import uninterrupted_artifact

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

FAST_SCALING = {  # every threshold and timer small, so a burst of a few seconds is enough
    "STEPLINE_SERVICE__AUTOSCALE__INTERVAL": "0.2",
    "STEPLINE_SERVICE__AUTOSCALE__UP_AFTER": "0.4",
    "STEPLINE_SERVICE__AUTOSCALE__UP_COOLDOWN": "1",
    "STEPLINE_SERVICE__AUTOSCALE__UP_STEP": "1",
    "STEPLINE_SERVICE__AUTOSCALE__DOWN_AFTER": "1.5",
    "STEPLINE_SERVICE__AUTOSCALE__DOWN_COOLDOWN": "1",
    "STEPLINE_SERVICE__AUTOSCALE__DOWN_STEP": "1",
    "STEPLINE_SERVICE__AUTOSCALE__MAX_WAIT": "1",
}
BURST_PARAMS = {"steps": 6, "step_ms": 150}


class Supervisor:
    """The loop ``stepline up`` runs (``Stack.supervise`` every 50 ms), on a thread, with the
    largest pool it ever saw (draining workers included)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.dead: list[str] = []
        self.largest_pool = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="supervisor")

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            if dead := self.stack.supervise(time.time()):
                self.dead = dead
                return
            self.largest_pool = max(self.largest_pool, len(self.stack.pool))

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture()
def stack_factory(stack_env: dict[str, str], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Start a stack (workers, scheduler and beat; no API or Flower) on the test's Redis, with
    these extra settings; stopped at the end of the test."""
    started: list[Stack] = []

    def start(workers: int, max_workers: int, **env: str) -> Stack:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        current_settings.cache_clear()
        stack = Stack(settings=current_settings(), run_dir=tmp_path / "run", workers=workers,
                      max_workers=max_workers, with_api=False, with_flower=False,
                      extra_env={"PYTHONPATH": str(ROOT)})
        started.append(stack)
        stack.start()
        return stack

    yield start
    for stack in started:
        stack.stop()


def _ready(store: JobStore, count: int) -> bool:
    beats = store.heartbeats()
    return (sum(1 for name in beats if name.startswith("w")) >= count
            and any(name.startswith("scheduler") for name in beats)
            and bool(store.redis.exists(keys.ADMISSION)))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _artifact_digest(store: JobStore, job_id: str) -> str:
    record = store.record(job_id)
    return _digest((current_settings().artifacts_path / str(record.artifact)).read_bytes())


def _events(store: JobStore, kind: str) -> list[dict[str, str]]:
    return [fields for _, fields in read_events(store) if fields["kind"] == kind]


def _assert_exact(store: JobStore, job_ids: list[str], reference: str) -> None:
    """DONE, every chunk committed once and applied once in order, the reference's output."""
    artifacts = ArtifactStore(current_settings().artifacts_path)
    for job_id in job_ids:
        audit = audit_job(store, artifacts, job_id)
        assert audit.exact, audit.problem()
        assert _artifact_digest(store, job_id) == reference, f"job {job_id}: output changed"


def test_a_burst_scales_up_to_max_and_the_quiet_after_it_drains_back_to_min(
    stack_factory: Any, redis_client: redis.Redis
) -> None:
    # given an autoscaled stack, 1..3 workers, idle at its minimum
    reference = _digest(uninterrupted_artifact("simulated", BURST_PARAMS))
    stack = stack_factory(1, 3, **FAST_SCALING)
    store = JobStore(redis_client)
    service = JobService(store, current_settings())
    wait_for(lambda: _ready(store, 1), 60, "the first worker and the scheduler")

    with Supervisor(stack) as supervisor:
        # when a burst of 16 jobs (about 14 s of work for one worker) arrives at once
        burst_at = time.time()
        spec = JobSpec(kind="simulated", slo=SloClass.BATCH, params=BURST_PARAMS,
                       deadline_s=600)
        job_ids = [service.submit(spec)[0] for _ in range(16)]

        # then the pool grows to MAX (3) and all three workers come up while the burst lasts
        wait_for(lambda: len(stack.pool_view().active) == 3, 60, "the pool to reach 3")
        scaled_up_at = time.time()
        wait_for(lambda: _ready(store, 3), 40, "the new workers to start")
        all_ready_at = time.time()
        wait_for(lambda: all(store.state(j) is JobState.DONE for j in job_ids), 60,
                 "the burst to finish")
        done_at = time.time()

        # and once it is over the pool drains back to MIN (1), each worker exiting on its own
        wait_for(lambda: len(stack.pool) == 1, 60, "the pool to drain back to 1")
        back_at = time.time()
    assert not supervisor.dead, f"stack processes died: {supervisor.dead}"

    # 0 jobs lost, each output the uninterrupted run's
    _assert_exact(store, job_ids, reference)
    committed_by = {w.split("@")[0] for j in job_ids for w in audit_job(
        store, ArtifactStore(current_settings().artifacts_path), j).workers}
    assert committed_by & {"w2", "w3"}, committed_by  # the new workers took part of the burst

    # every decision is an event with its reason; never more than MAX processes
    decisions = _events(store, "decision")
    ups = [d for d in decisions if d["action"] == "up"]
    downs = [d for d in decisions if d["action"] == "down"]
    assert [(d["workers_from"], d["workers_to"]) for d in ups] == [("1", "2"), ("2", "3")]
    assert all(d["cause"] in {"backlog", "old_wait", "high_load"} and d["reason"] for d in ups)
    assert [(d["workers_from"], d["workers_to"], d["cause"]) for d in downs] == [
        ("3", "2", "idle"), ("2", "1", "idle")]
    assert "at_max" in {d["cause"] for d in decisions}  # the backlog outlasted the scale-up
    assert supervisor.largest_pool == 3
    drained = _events(store, "drained")
    assert len(drained) == 2 and all(d["exit_code"] == "0" for d in drained), drained
    assert not _events(store, "killed")

    first_up_s = float(ups[0]["ts"]) - burst_at
    first_down_s = float(downs[0]["ts"]) - done_at
    print(f"\nscale-up: first decision {first_up_s:.1f}s after the burst, pool at 3 after "
          f"{scaled_up_at - burst_at:.1f}s, all 3 ready after {all_ready_at - burst_at:.1f}s; "
          f"burst done after {done_at - burst_at:.1f}s; scale-down: first decision "
          f"{first_down_s:.1f}s after it, back to 1 after {back_at - done_at:.1f}s; drains "
          f"took {', '.join(d['drain_s'] + 's' for d in drained)}")
    # both scale-ups came while the burst lasted (how soon is printed, not asserted)
    assert all(float(d["ts"]) < done_at for d in ups), (ups, done_at)


@pytest.mark.parametrize(("how", "yield_after_s"), [("finishes", "30"), ("yields", "0.2")])
def test_a_worker_drained_mid_chunk_lets_its_job_continue_elsewhere_exactly(
    stack_factory: Any, redis_client: redis.Redis, how: str, yield_after_s: str
) -> None:
    # given two workers, and a job of 600 ms steps in four block groups
    params = {"steps": 6, "step_ms": 600, "block_groups": 4}
    reference = _digest(uninterrupted_artifact("simulated", params))
    stack = stack_factory(2, 2, STEPLINE_SERVICE__AUTOSCALE__DRAIN_PREEMPT_AFTER=yield_after_s)
    store = JobStore(redis_client)
    service = JobService(store, current_settings())
    wait_for(lambda: _ready(store, 2), 60, "the workers and the scheduler")
    job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.BATCH, params=params,
                                       deadline_s=600))

    with Supervisor(stack) as supervisor:
        # when the worker running it is drained early in its third chunk
        def early_in_chunk() -> tuple[str, int] | None:
            f = store.fields(job_id)
            if f["state"] != JobState.RUNNING.value or int(f["next_chunk"]) < 2:
                return None
            in_chunk_s = time.time() - float(f["chunk_started_at"])
            return (f["running_on"], int(f["next_chunk"])) if in_chunk_s < 0.15 else None

        found = wait_for(early_in_chunk, 30, "the job early in a chunk")
        victim, chunk = cast(tuple[str, int], found)
        stack.drain(victim, time.time())
        wait_for(lambda: not any(w.node == victim for w in stack.pool), 60,
                 "the drained worker to exit")
        wait_for(lambda: store.state(job_id) is JobState.DONE, 40, "the job to finish")
    assert not supervisor.dead, f"stack processes died: {supervisor.dead}"

    # then it exited by itself (no kill) after finishing its chunk, or yielding inside it
    drained = _events(store, "drained")
    assert [(d["worker"], d["exit_code"]) for d in drained] == [(victim, "0")]
    commits = [e for e in store.events(job_id) if e["kind"] == "commit"
               and e["chunk"] == str(chunk) and e["by"] == victim]
    assert commits, "the drained worker committed nothing of the chunk it was running"
    if how == "finishes":
        # the rest of its chunk and no other (no later commit of the victim, below); how long
        # that took is printed, not asserted: a loaded machine stretches it
        assert commits[-1]["complete"] == "1"
    else:
        assert commits[-1]["complete"] == "0"  # a block-group checkpoint, then the yield
        assert any(e.get("to") == JobState.PREEMPTED.value for e in store.events(job_id))
    print(f"\ndrained mid-chunk ({how}): the worker exited {drained[0]['drain_s']}s after "
          f"SIGTERM")
    # and the job continued on the other worker, with exactly the uninterrupted output
    later = {e["by"] for e in store.events(job_id)
             if e["kind"] == "commit" and int(e["chunk"]) > chunk}
    assert later and victim not in later
    _assert_exact(store, [job_id], reference)
