"""Expert hot update on a real worker, started with ``stepline experts update``: a broken version
gets traffic, then is rolled back automatically; a healthy one is stepped up and promoted."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.expert_updates import ExpertUpdates, update_policy
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import PY, ROOT, Processes, wait_for_workers
from workers.moe.expert_cache import CacheConfig
from workers.moe.recipes import MODELS_DIR, build_model, load_recipe
from workers.moe.session import open_session
from workers.moe.versioned import BASE_VERSION, perturbed_experts, write_expert_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "qwen3-moe-tiny"
TEXT = {"inputs": "Tell me a story about a dragon", "max_new_tokens": 9, "chunk_tokens": 2,
        "routing": "native", "model": MODEL}
FAST_UPDATE = {  # quarter steps of a second: an update runs in seconds
    "STEPLINE_MOE__VERSIONS__TRAFFIC_STEP": "0.25",
    "STEPLINE_MOE__VERSIONS__STEP_INTERVAL": "1",
    "STEPLINE_MOE__VERSIONS__MIN_SAMPLES": "12",
    # A 2-layer toy model decodes a token in ~2 ms on a shared CPU, where timing noise alone
    # exceeds 15 %; the 15 % latency judgement is unit-tested on controlled latencies, so here
    # only a gross slowdown (or errors, judged at the default) would roll back.
    "STEPLINE_MOE__VERSIONS__ROLLBACK_DEGRADATION": "1.0",
}


def _version_file(tmp_path: Path, scale: float) -> Path:
    session = open_session(build_model(load_recipe(MODEL, MODELS_DIR)), CacheConfig())
    path = tmp_path / f"experts-{scale}.safetensors"
    write_expert_file(perturbed_experts(session.experts.host(BASE_VERSION), scale, seed=7), path)
    return path


def _start(processes: Processes, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> (
    JobService
):
    for key, value in FAST_UPDATE.items():
        monkeypatch.setenv(key, value)
        processes.env[key] = value
    current_settings.cache_clear()
    processes.worker("w1")
    processes.scheduler()
    wait_for_workers(client, ["w1", "scheduler"])
    return JobService(JobStore(client), current_settings())


def _update(path: Path, name: str) -> None:
    """``stepline experts update`` as an operator types it."""
    subprocess.run([PY, "-c", "from app.cli import main; main()", "experts", "update",
                    "--model", MODEL, "--from", str(path), "--name", name],
                   cwd=ROOT, check=True, capture_output=True, timeout=60)


def _drive(service: JobService, done: object, timeout_s: float) -> list[str]:
    """Keep text jobs flowing until ``done()`` holds; returns the jobs submitted."""
    submitted: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        waiting = [j for j in submitted if not service.store.state(j).is_terminal]
        if len(waiting) < 3:
            spec = JobSpec(kind="text", slo=SloClass.INTERACTIVE, params=TEXT, deadline_s=300)
            submitted.append(service.submit(spec)[0])
        time.sleep(0.02)
    assert done(), f"the update did not finish in {timeout_s}s"  # type: ignore[operator]
    return submitted


def test_a_broken_version_is_rolled_back_automatically_then_a_healthy_one_is_promoted(
    processes: Processes, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    service = _start(processes, redis_client, monkeypatch)
    updates = ExpertUpdates(redis_client, update_policy(current_settings().moe.versions))

    _update(_version_file(tmp_path, float("nan")), "broken")
    jobs = _drive(service, lambda: updates.versions(MODEL).candidate is None, 60)

    versions = updates.versions(MODEL)
    assert versions.live == BASE_VERSION and "error rate" in versions.last_reason
    failed = [j for j in jobs if service.store.state(j) is JobState.FAILED]
    assert failed and all("non-finite" in (service.store.record(j).error or "") for j in failed)
    assert all(service.store.fields(j)["expert_version"] == "broken" for j in failed)

    _update(_version_file(tmp_path, 0.01), "tuned")
    jobs = _drive(service, lambda: updates.versions(MODEL).candidate is None, 60)

    record = updates.record(MODEL)
    assert record is not None and record.state["live"] == "tuned", record.history
    shares = [h["share"] for h in record.history if h["decision"] == "step_up"]
    assert shares == [0.5, 0.75] and record.history[-1]["decision"] == "promoted"
    assert list(updates.versions(MODEL).kept) == [BASE_VERSION, "tuned"]
    assert not [j for j in jobs if service.store.state(j) is JobState.FAILED]
    ran = [j for j in jobs if service.store.state(j) is JobState.DONE]
    assert {service.store.fields(j)["expert_version"] for j in ran} == {BASE_VERSION, "tuned"}
