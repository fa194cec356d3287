"""A real worker process whose memory budget holds two models serves jobs of four: it evicts
and reloads (its heartbeat counts the loads), never holds more than the budget (tensor bytes,
measured, in its heartbeat) and every output equals the unconstrained run's."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers
from tests.integration.test_model_jobs import _artifact, _comparable, uninterrupted_artifact
from workers.residency import process_residency

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

JOBS: list[tuple[str, dict[str, Any]]] = [
    ("image", {"model": "dit-tiny", "class_label": 3, "num_inference_steps": 4, "seed": 5,
               "height": 32, "width": 32}),
    ("image", {"model": "pixart-tiny", "prompt": "a red fox", "num_inference_steps": 4,
               "seed": 7}),
    ("text", {"inputs": "Explain quantum computing", "max_new_tokens": 6, "chunk_tokens": 2,
              "routing": "native", "model": "qwen3-moe-tiny"}),
    ("text", {"inputs": "Tell me a story about a dragon", "max_new_tokens": 6,
              "chunk_tokens": 2, "routing": "native", "model": "olmoe-tiny"}),
]


def _model_of(key: str) -> str:
    """The model of a residency key (``diffusion:<model>:…``, ``text:<runner>:<model>``)."""
    parts = key.split(":")
    return parts[1] if parts[0] == "diffusion" else parts[-1]


def _model_bytes() -> dict[str, int]:
    """Measured bytes of each job's model, as this (unconstrained) process holds it."""
    held = process_residency().summary()["device"]
    return {model: max(size for key, size in held.items() if _model_of(key) == model)
            for model in (params["model"] for _, params in JOBS)}


def test_a_worker_with_a_two_model_budget_serves_four_models_exactly(
    processes: Processes, redis_client: redis.Redis
) -> None:
    expected = [uninterrupted_artifact(kind, params) for kind, params in JOBS]
    sizes = sorted(_model_bytes().values())
    budget = sizes[-1] + sizes[-2]  # any two fit; no three do:
    assert sum(sizes[:3]) > budget, sizes

    processes.worker("w1", extra_env={"STEPLINE_RESIDENCY__MEMORY_BUDGET_BYTES": str(budget),
                                      "STEPLINE_WARM_START": "false"})
    wait_for_workers(redis_client, ["w1"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    peaks: list[int] = []

    def run_all() -> list[str]:
        ids = [service.submit(JobSpec(kind=kind, slo=SloClass.BATCH, params=params,  # type: ignore[arg-type]
                                      deadline_s=600))[0] for kind, params in JOBS]

        def done() -> bool:
            beat = store.heartbeats().get("w1@test")
            if beat is not None and beat.residency:
                peaks.append(beat.resident_bytes("device"))
            return all(store.state(j) is JobState.DONE for j in ids)

        wait_for(done, 150, "the four jobs to finish on w1")
        return ids

    # a second round: two models at most stayed, so the others are built again
    job_ids = run_all() + run_all()
    wait_for(lambda: store.heartbeats()["w1@test"].residency.get("loads", {}).get("disk", 0)
             >= 6 and not store.heartbeats()["w1@test"].busy_job, 30, "a heartbeat after them")
    residency = store.heartbeats()["w1@test"].residency

    assert residency["budget_bytes"] == budget
    assert max(peaks) <= budget
    assert residency["peak_device_bytes"] <= budget
    assert sum(residency["device"].values()) <= budget
    assert len(residency["device"]) <= 2
    assert residency["loads"]["disk"] >= len(JOBS) + 2  # evicted models built again
    assert residency["loads"]["disk"] - residency["evictions"]["disk"] == len(residency["device"])
    assert all(load["s"] > 0 and load["bytes"] > 0 for load in residency["recent"])
    for (kind, _), job_id, want in zip(JOBS * 2, job_ids, expected * 2, strict=True):
        assert _comparable(kind, _artifact(store, job_id)) == _comparable(kind, want)
