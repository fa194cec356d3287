"""The simulated device: chunks that sleep their declared step time.

Used for tests, demos and benchmarks at scale; always labelled as simulation. A step may be
split into block groups, so preemption inside a step behaves as it does for a real DiT.

A job that names a ``model`` runs on it: the process's model residency holds it as a real CPU
tensor of the job's ``model_bytes`` (so the bytes it measures and counts against the budget are
real), a build sleeps ``load_ms``, a move back from host memory ``host_load_ms``, and each LoRA
adapter not yet loaded on it its own ``load_ms``. Loads, evictions and adapters are then the
residency's own, measured on a real worker process, and show in its heartbeat.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.errors import WorkerError
from workers.residency import (
    LoadSource,
    ModelResidency,
    Resident,
    adapters_to_unload,
    process_residency,
)
from workers.runner import Artifact, BatchItem, ChunkPlan, ChunkResult, ShouldYield

if TYPE_CHECKING:
    import torch

    from workers.checkpoint import Checkpoint  # types only: the codec loads torch

MODEL_PREFIX = "simulated:"
"""Residency keys of simulated models: ``simulated:<model>``."""


@dataclass(slots=True)
class SimulatedModel:
    """A simulated model as the residency holds it: its weights (real bytes), the time a move
    back from host memory takes, and the adapters loaded on it (least recently used first)."""

    weights: torch.Tensor
    host_load_s: float
    adapters: OrderedDict[str, None] = field(default_factory=OrderedDict)


SIMULATED_RESIDENT = Resident(
    tensors=lambda m: (m.weights,),
    to_host=lambda m: None,  # a CPU device: host memory is the same memory, nothing moves
    to_device=lambda m: time.sleep(m.host_load_s),
)
"""Simulated models in the residency: measured by their weights tensor; a move back from host
memory takes the model's declared host load time."""


def model_key(model: str) -> str:
    return MODEL_PREFIX + model


def _build(params: Mapping[str, Any]) -> SimulatedModel:
    """Load the job's model: the declared load time, then its bytes, allocated and written."""
    import torch  # deferred: a process that only plans jobs never builds one

    load_ms = float(params.get("load_ms", 0.0))
    time.sleep(load_ms / 1000.0)
    host_ms = params.get("host_load_ms")
    host_s = (load_ms / 4.0 if host_ms is None else float(host_ms)) / 1000.0
    return SimulatedModel(torch.zeros(int(params["model_bytes"]), dtype=torch.uint8), host_s)


def uses_model(params: Mapping[str, Any]) -> bool:
    return params.get("model") is not None


class SimulatedRunner:
    """Runs ``simulated`` jobs: ``steps`` chunks of ``step_ms`` each. Jobs that give a
    ``batch_growth`` batch: ``b`` of them sleep one step of ``step_ms × (1 + growth × (b − 1))``
    together (the batched step of a device that a lone step leaves partly idle)."""

    kind = "simulated"

    def __init__(self, residency: ModelResidency | None = None) -> None:
        self._residency = residency
        self._adapter_lock = threading.Lock()

    @property
    def models(self) -> ModelResidency:
        return self._residency or process_residency()

    def load_model(self, params: Mapping[str, Any]) -> SimulatedModel | None:
        """The job's model (and its adapters) resident, loaded first if it must be; None for a
        job that names no model."""
        if not uses_model(params):
            return None
        key = model_key(str(params["model"]))
        expected_s = self._expected_load_s(key, params)
        if expected_s <= 0.0:  # resident with its adapters: nothing to announce
            return self._load(key, params)
        tier = self.models.tier_of(key)
        source: LoadSource = "adapter" if tier == "device" else tier
        with self.models.loading(key, expected_s, source):
            return self._load(key, params)

    def _expected_load_s(self, key: str, params: Mapping[str, Any]) -> float:
        """What making the job's model and adapters resident will take: the declared times of
        the base's tier (a model in host memory moves back in the time it was built with) and
        of each adapter it lacks (a model built anew has none)."""
        held = self.models.peek(key)
        host_s = None if held is None else held.host_load_s
        base_s = self.models.expected_load_s(key, {
            "disk": float(params.get("load_ms", 0.0)) / 1000.0,
            **({"host": host_s} if host_s is not None else {})})
        loaded = held.adapters if held is not None else {}
        return base_s + sum(float(a.get("load_ms", 0.0)) / 1000.0
                            for a in params.get("adapters") or () if str(a["name"]) not in loaded)

    def _load(self, key: str, params: Mapping[str, Any]) -> SimulatedModel:
        model = self.models.acquire(key, lambda: _build(params), SIMULATED_RESIDENT)
        with self._adapter_lock:
            for adapter in params.get("adapters") or ():
                name = str(adapter["name"])
                if name in model.adapters:
                    model.adapters.move_to_end(name)
                    continue
                started_s = time.perf_counter()
                time.sleep(float(adapter.get("load_ms", 0.0)) / 1000.0)
                self.models.adapter_loaded(key, name, time.perf_counter() - started_s)
                model.adapters[name] = None
            wanted = {str(a["name"]) for a in params.get("adapters") or ()}
            for name in adapters_to_unload(list(model.adapters), wanted):
                del model.adapters[name]
            self.models.note_adapters(key, model.adapters)
        return model

    def stage(self, params: Mapping[str, Any]) -> bool:
        """Read the job's model into host memory ahead of it: its declared load time (a read
        from disk), its bytes allocated; its chunk then pays ``host_load_ms`` instead."""
        if not uses_model(params):
            return False
        return self.models.stage(model_key(str(params["model"])), lambda: _build(params),
                                 SIMULATED_RESIDENT)

    def plan(self, params: Mapping[str, Any]) -> ChunkPlan:
        steps = int(params["steps"])
        # A simulated step's cost is known exactly, so its unit is the second.
        return ChunkPlan(
            names=tuple(f"step[{i}]" for i in range(steps)),
            cost_units=(float(params["step_ms"]) / 1000.0,) * steps,
            cost_key="simulated",
        )

    def batch_key(self, params: Mapping[str, Any], index: int) -> str | None:
        growth = params.get("batch_growth")
        if growth is None:
            return None
        key = f"simulated:{float(params['step_ms'])!r}:{float(growth)!r}"
        if uses_model(params):  # one forward runs one model with one adapter set
            adapters = "".join(f"+{a['name']}" for a in params.get("adapters") or ())
            key += f":{params['model']}{adapters}"
        return key

    def run_batch(self, items: Sequence[BatchItem]) -> list[ChunkResult]:
        results: list[ChunkResult | None] = [None] * len(items)
        groups: dict[str, list[int]] = {}
        for n, item in enumerate(items):
            key = self.batch_key(item.params, item.index)
            partial = item.state is not None and int(item.state.meta.get("group", 0)) > 0
            if key is None or partial:
                results[n] = self._alone(item)
            else:
                groups.setdefault(key, []).append(n)
        for members in groups.values():
            if len(members) == 1:
                results[members[0]] = self._alone(items[members[0]])
                continue
            first = items[members[0]].params
            self.load_model(first)
            growth = float(first["batch_growth"])
            time.sleep(float(first["step_ms"]) / 1000.0 * (1.0 + growth * (len(members) - 1)))
            for n in members:
                result = self._finish_step(items[n].params, items[n].index, items[n].state)
                result.metrics["batch_size"] = len(members)
                results[n] = result
        return [r for r in results if r is not None]

    def _alone(self, item: BatchItem) -> ChunkResult:
        result = self.run_chunk(item.params, item.index, item.state, lambda: False)
        result.metrics["batch_size"] = 1
        return result

    def run_chunk(
        self,
        params: Mapping[str, Any],
        index: int,
        state: Checkpoint | None,
        should_yield: ShouldYield,
    ) -> ChunkResult:
        # a process that only plans jobs (the API) never needs the codec
        from workers.checkpoint import Checkpoint  # deferred: loads torch

        fresh: dict[str, Any] = {"applied": [], "group": 0}
        meta = dict(state.meta) if state is not None else fresh
        if params.get("fail_at") is not None and int(params["fail_at"]) == index:
            raise WorkerError(f"simulated failure at chunk {index} (fail_at={index})")
        self.load_model(params)
        groups = int(params.get("block_groups", 1))
        slice_s = float(params["step_ms"]) / 1000.0 / groups
        first_group = group = int(meta.get("group", 0))
        while group < groups:
            if group > first_group and should_yield():
                meta["group"] = group
                return ChunkResult(state=Checkpoint(meta=meta), complete=False)
            time.sleep(slice_s)
            group += 1
        return self._finish_step(params, index, Checkpoint(meta=meta))

    def _finish_step(self, params: Mapping[str, Any], index: int,
                     state: Checkpoint | None) -> ChunkResult:
        """The state after chunk ``index`` has slept (alone or in a batch)."""
        from workers.checkpoint import Checkpoint  # deferred: loads torch

        if params.get("fail_at") is not None and int(params["fail_at"]) == index:
            raise WorkerError(f"simulated failure at chunk {index} (fail_at={index})")
        meta: dict[str, Any] = dict(state.meta) if state is not None else {"applied": []}
        meta["group"] = 0
        meta["applied"] = [*meta.get("applied", []), index]
        last = index == int(params["steps"]) - 1
        artifact = None
        if last:
            body = {"output": f"simulated {params['steps']} steps", "applied": meta["applied"]}
            artifact = Artifact(json.dumps(body).encode(), "application/json", "json")
        return ChunkResult(state=Checkpoint(meta=meta), artifact=artifact)
