"""Placement by model residency on real workers: two worker processes whose budgets hold two
simulated models each serve jobs of four models. Released one at a time (each to two idle
workers with fresh heartbeats), Stepline's placement loads each model once — the first two on
one worker, the next two on the one with room, then every job finds its model warm — while the
model-oblivious placement of the same submissions loads more; neither worker ever holds more
than its budget (tensor bytes, measured, in the heartbeats)."""

from __future__ import annotations

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
