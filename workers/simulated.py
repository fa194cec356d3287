"""The simulated device: chunks that sleep their declared step time.

Used for tests, demos and benchmarks at scale; always labelled as simulation. A step may be
split into block groups, so preemption inside a step behaves as it does for a real DiT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.errors import WorkerError
from workers.runner import Artifact, BatchItem, ChunkPlan, ChunkResult, ShouldYield

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint  # types only: the codec loads torch


class SimulatedRunner:
    """Runs ``simulated`` jobs: ``steps`` chunks of ``step_ms`` each. Jobs that give a
    ``batch_growth`` batch: ``b`` of them sleep one step of ``step_ms × (1 + growth × (b − 1))``
    together (the batched step of a device that a lone step leaves partly idle)."""

    kind = "simulated"

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
        return f"simulated:{float(params['step_ms'])!r}:{float(growth)!r}"

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
