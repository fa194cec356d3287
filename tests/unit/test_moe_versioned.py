"""Expert versions side by side on one worker: loaded from a file beside the live one, chosen
per job and kept in its checkpoint, checked on load, and dropped when no longer kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.errors import ExpertVersionError, NonFiniteOutput
from workers.moe.runner import TextRunner
from workers.moe.versioned import (
    BASE_VERSION,
    perturbed_experts,
    read_expert_file,
    write_expert_file,
)
from workers.moe.versions import ExpertVersions, UpdatePolicy, VersionStats, degradation

pytestmark = pytest.mark.timeout(60)

PARAMS = {"prompt": "Tell me a story about a dragon", "max_new_tokens": 9, "chunk_tokens": 2,
          "routing": "native", "model": "qwen3-moe-tiny"}


def _run(runner: TextRunner, params: dict[str, Any], stop_after: int | None = None) -> Any:
    plan, state, result = runner.plan(params), None, None
    for index in range(plan.num_chunks if stop_after is None else stop_after):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = result.state
    return result


def _text(result: Any) -> str:
    return str(json.loads(result.artifact.data)["output"])


@pytest.fixture(scope="module")
def runner() -> TextRunner:
    return TextRunner()


@pytest.fixture(scope="module")
def v2_file(runner: TextRunner, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = runner.session("qwen3-moe-tiny").experts.host(BASE_VERSION)
    path = tmp_path_factory.mktemp("versions") / "v2.safetensors"
    write_expert_file(perturbed_experts(base, scale=1.0, seed=3), path)
    return path


def test_a_version_loaded_beside_the_live_one_serves_only_the_jobs_routed_to_it(
    runner: TextRunner, v2_file: Path
) -> None:
    live_before = _text(_run(runner, PARAMS))
    runner.session("qwen3-moe-tiny").experts.load_file("v2", v2_file)

    on_v2 = _run(runner, {**PARAMS, "expert_version": "v2"})
    live_after = _run(runner, PARAMS)

    assert json.loads(on_v2.artifact.data)["metrics"]["expert_version"] == "v2"
    assert _text(on_v2) != live_before
    assert _text(live_after) == live_before


def test_a_resumed_job_keeps_the_version_its_checkpoint_names(
    runner: TextRunner, v2_file: Path
) -> None:
    runner.session("qwen3-moe-tiny").experts.load_file("v2", v2_file)
    uninterrupted = _text(_run(runner, {**PARAMS, "expert_version": "v2"}))
    partial = _run(runner, {**PARAMS, "expert_version": "v2"}, stop_after=2)
    assert partial.state.meta["expert_version"] == "v2"

    state, result = partial.state, None
    for index in range(2, runner.plan(PARAMS).num_chunks):  # resumed without naming a version
        result = runner.run_chunk(PARAMS, index, state, lambda: False)
        state = result.state

    assert _text(result) == uninterrupted


def test_a_version_with_the_wrong_shapes_or_tensors_is_refused(
    runner: TextRunner, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    base = runner.session("qwen3-moe-tiny").experts.host(BASE_VERSION)
    layer = base.layers[0]
    save_file({f"layers.{layer}.down_proj": torch.zeros(1, 2, 3)}, str(tmp_path / "bad.st"))
    save_file({"router.weight": torch.zeros(2)}, str(tmp_path / "odd.st"))

    with pytest.raises(ExpertVersionError, match="shape"):
        read_expert_file(tmp_path / "bad.st", base)
    with pytest.raises(ExpertVersionError, match="unexpected tensor"):
        read_expert_file(tmp_path / "odd.st", base)
    with pytest.raises(ExpertVersionError, match="not loaded"):
        runner.session("qwen3-moe-tiny").experts.use("never-loaded")


def test_a_broken_version_fails_its_jobs_with_a_clear_error(
    runner: TextRunner, tmp_path: Path
) -> None:
    experts = runner.session("qwen3-moe-tiny").experts
    experts.add("broken", perturbed_experts(experts.host(BASE_VERSION), scale=float("nan")))

    with pytest.raises(NonFiniteOutput, match="broken"):
        _run(runner, {**PARAMS, "expert_version": "broken"}, stop_after=1)


def test_versions_no_longer_kept_are_dropped_but_never_the_live_or_active_one(
    runner: TextRunner,
) -> None:
    experts = runner.session("qwen3-moe-tiny").experts
    base = experts.host(BASE_VERSION)
    for name in ("a", "b", "c"):
        experts.add(name, perturbed_experts(base, scale=0.1))
    experts.use("c")

    dropped = experts.retain(hosts=["a"], caches=[])

    assert {"b"} <= set(dropped) and experts.has("a") and experts.has("c")
    assert experts.has(BASE_VERSION)  # live
    experts.use(BASE_VERSION)


def test_the_update_state_survives_a_round_trip_and_judges_the_median_latency() -> None:
    policy = UpdatePolicy(min_samples=3)
    versions = ExpertVersions(live="v1", policy=policy)
    versions.begin_update("v2", now_s=5.0)
    again = ExpertVersions.from_json(json.loads(json.dumps(versions.to_json())), policy)
    assert (again.live, again.candidate, again.share, list(again.kept)) == (
        "v1", "v2", pytest.approx(0.05), ["v1"])

    live, cand = VersionStats(), VersionStats()
    for ms in (10.0, 10.0, 10.0):
        live.record(ms, True)
    for ms in (10.0, 10.5, 500.0):  # one cold, slow request
        cand.record(ms, True)
    assert degradation(live, cand, 0.15) == ""
    cand.record(12.0, True)
    cand.record(12.0, True)
    assert "latency" in degradation(live, cand, 0.15)
