"""The simulated device with models: a job naming a model runs on it, held in a model
residency as real tensor bytes, loaded in its declared time, evicted under the budget, moved
back from host memory in its host load time; adapters loaded once per model and reported."""

from __future__ import annotations

from typing import Any

from workers.residency import ModelResidency
from workers.simulated import SimulatedRunner

KB = 1024


def _params(model: str, **extra: Any) -> dict[str, Any]:
    return {"steps": 1, "step_ms": 0.0, "model": model, "model_bytes": 64 * KB,
            "load_ms": 20.0, "host_load_ms": 5.0, **extra}


def _run(runner: SimulatedRunner, residency: ModelResidency, params: dict[str, Any]) -> None:
    with residency.in_use():
        result = runner.run_chunk(params, 0, None, lambda: False)
    assert result.complete and result.artifact is not None


def test_a_model_is_loaded_in_its_declared_time_and_counted_by_its_bytes() -> None:
    residency = ModelResidency(budget_bytes=128 * KB)
    runner = SimulatedRunner(residency)
    _run(runner, residency, _params("m1"))
    _run(runner, residency, _params("m1"))  # held: no second load
    summary = residency.summary()
    assert summary["device"] == {"simulated:m1": 64 * KB}  # the tensor's bytes, measured
    assert summary["loads"] == {"disk": 1, "host": 0}
    assert summary["hits"] == 1
    (load,) = summary["recent"]
    assert load["model"] == "simulated:m1" and load["tier"] == "disk"
    assert load["s"] >= 0.02 and "at" in load


def test_a_budget_of_two_models_evicts_and_a_host_tier_moves_them_back() -> None:
    residency = ModelResidency(budget_bytes=128 * KB, host_budget_bytes=64 * KB,
                               policy="lru")
    runner = SimulatedRunner(residency)
    for model in ("m1", "m2", "m3", "m1"):
        _run(runner, residency, _params(model))
        assert residency.tier_bytes("device") <= 128 * KB
    summary = residency.summary()
    # m3 pushed m1 (least recently used) to host memory, and m1 came back from there
    assert summary["loads"] == {"disk": 3, "host": 1}
    host_load = summary["recent"][-1]
    assert host_load["tier"] == "host" and host_load["s"] >= 0.005
    assert set(summary["device"]) == {"simulated:m3", "simulated:m1"}
    assert summary["peak_device_bytes"] <= 128 * KB


def test_adapters_load_once_per_model_and_go_with_it() -> None:
    residency = ModelResidency(budget_bytes=64 * KB)
    runner = SimulatedRunner(residency)
    styled = _params("m1", adapters=[{"name": "ink", "load_ms": 10.0}])
    _run(runner, residency, styled)
    _run(runner, residency, styled)
    summary = residency.summary()
    assert summary["adapters"] == {"simulated:m1": ["ink"]}
    assert summary["adapter_loads"] == 1 and summary["adapter_load_s"] >= 0.01
    assert [r.get("adapter") for r in summary["recent"]] == [None, "ink"]
    _run(runner, residency, _params("m2"))  # m1 evicted: its adapters with it
    assert residency.summary()["adapters"] == {}
    _run(runner, residency, styled)  # back from disk: the adapter loads again
    assert residency.summary()["adapter_loads"] == 2


def test_a_model_moved_to_host_memory_keeps_its_adapters() -> None:
    residency = ModelResidency(budget_bytes=64 * KB, host_budget_bytes=64 * KB)
    runner = SimulatedRunner(residency)
    styled = _params("m1", adapters=[{"name": "ink", "load_ms": 10.0}])
    _run(runner, residency, styled)
    _run(runner, residency, _params("m2"))  # m1 to host memory, its adapter loaded on it
    summary = residency.summary()
    assert summary["host"] == {"simulated:m1": 64 * KB}
    assert summary["adapters"] == {"simulated:m1": ["ink"]}  # what placement reads
    _run(runner, residency, styled)  # back from host memory: the adapter is still on it
    summary = residency.summary()
    assert summary["loads"] == {"disk": 2, "host": 1} and summary["adapter_loads"] == 1


def test_a_job_without_a_model_holds_nothing() -> None:
    residency = ModelResidency(budget_bytes=64 * KB)
    runner = SimulatedRunner(residency)
    _run(runner, residency, {"steps": 1, "step_ms": 0.0})
    assert residency.summary()["device"] == {}


def test_batched_jobs_share_a_model_only_with_the_same_model_and_adapters() -> None:
    runner = SimulatedRunner(ModelResidency())
    base = {"steps": 2, "step_ms": 10.0, "batch_growth": 0.5}
    keys = {runner.batch_key({**base, **p}, 0) for p in (
        {"model": "m1"}, {"model": "m1"}, {"model": "m2"},
        {"model": "m1", "adapters": [{"name": "ink"}]}, {})}
    assert len(keys) == 4


def test_a_chunks_load_is_announced_as_its_declared_base_and_missing_adapters() -> None:
    """What the heartbeat says a load under way will take: the declared time of the tier the
    base comes from and of each adapter it lacks; nothing when all is resident."""
    residency = ModelResidency(budget_bytes=64 * KB, host_budget_bytes=64 * KB)
    runner = SimulatedRunner(residency)
    announced: list[Any] = []
    residency.on_load = lambda: announced.append(residency.summary().get("loading"))
    ink = {"name": "ink", "load_ms": 10.0}
    _run(runner, residency, _params("m1", adapters=[ink]))  # from disk: 20 ms + 10 ms
    _run(runner, residency, _params("m1", adapters=[ink]))  # all resident: nothing
    _run(runner, residency, _params("m2"))  # m1 to host memory with its adapter
    _run(runner, residency, _params("m1", adapters=[ink, {"name": "dot", "load_ms": 3.0}]))
    expected = [a["expected_s"] for a in announced if a is not None]
    assert expected == [0.03, 0.02, 0.008]  # m1 from disk, m2 from disk, m1 from host + dot
    assert announced.count(None) == 3  # each announcement ended
    assert residency.summary()["loaded_at"] >= announced[0]["since"]
