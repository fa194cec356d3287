"""Warm start: one tiny job of each recipe, run in the worker before it takes work, so that
torch, the model, its kernels, the checkpoint codec and the artifact encoder are all built and
loaded, and the first real job runs as fast as the ones after it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.diffusion.params import validate_params
from workers.diffusion.recipes import DIFFUSION_KINDS, diffusion_recipe
from workers.registry import ModelRegistry, default_registry
from workers.runner import JobRunner

WARM_STEPS = 2
"""Denoising steps (and new tokens) of a warm-up job: enough to run every chunk kind once."""


@dataclass(frozen=True, slots=True)
class WarmJob:
    """The tiny job that warms one recipe."""

    recipe: str
    kind: str
    params: dict[str, Any]


def warm_jobs(registry: ModelRegistry | None = None,
              kinds: Sequence[str] = ("image", "video", "text")) -> list[WarmJob]:
    """One warm-up job per recipe of ``kinds``, with the recipe's own defaults otherwise (the
    shapes a first real job most likely has)."""
    registry = registry or default_registry()
    jobs = []
    for name in registry.names():
        kind = registry.get(name).kind
        if kind in kinds:
            jobs.append(WarmJob(name, kind, _params(name, kind, registry)))
    return jobs


def _params(name: str, kind: str, registry: ModelRegistry) -> dict[str, Any]:
    if kind not in DIFFUSION_KINDS:
        return {"prompt": "warm up", "max_new_tokens": WARM_STEPS, "chunk_tokens": 1,
                "model": name}
    conditioned = diffusion_recipe(name, registry).conditioning
    condition = {"class_label": 0} if conditioned == "class" else {"prompt": "warm up"}
    return validate_params(kind, {"model": name, "num_inference_steps": WARM_STEPS,
                                  **condition}, registry)


def run_to_end(runner: JobRunner, params: dict[str, Any]) -> float:
    """Run every chunk of one job in this process, encoding each checkpoint as a commit would;
    returns the seconds it took."""
    started_s = time.perf_counter()
    state = None
    for index in range(runner.plan(params).num_chunks):
        result = runner.run_chunk(params, index, state, lambda: False)
        result.state.encode()
        state = result.state
    return time.perf_counter() - started_s
