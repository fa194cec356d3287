"""The simulated device: chunks that sleep their declared step time.

Used for tests, demos and benchmarks at scale; always labelled as simulation. A step may be
split into block groups, so preemption inside a step behaves as it does for a real DiT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workers.errors import WorkerError
from workers.runner import Artifact, ChunkPlan, ChunkResult, ShouldYield

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint  # types only: the codec loads torch


class SimulatedRunner:
    """Runs ``simulated`` jobs: ``steps`` chunks of ``step_ms`` each."""

    kind = "simulated"

    def plan(self, params: Mapping[str, Any]) -> ChunkPlan:
        steps = int(params["steps"])
        # A simulated step's cost is known exactly, so its unit is the second.
        return ChunkPlan(
            names=tuple(f"step[{i}]" for i in range(steps)),
            cost_units=(float(params["step_ms"]) / 1000.0,) * steps,
            cost_key="simulated",
        )

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
        meta["group"] = 0
        meta["applied"] = [*meta["applied"], index]
        last = index == int(params["steps"]) - 1
        artifact = None
        if last:
            body = {"output": f"simulated {params['steps']} steps", "applied": meta["applied"]}
            artifact = Artifact(json.dumps(body).encode(), "application/json", "json")
        return ChunkResult(state=Checkpoint(meta=meta), artifact=artifact)
