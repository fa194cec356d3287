"""Warm start: one tiny job of each recipe, run in the worker before it takes work, so that
torch, the model, its kernels, the checkpoint codec and the artifact encoder are all built and
loaded, and the first real job runs as fast as the ones after it."""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from workers.diffusion.inputs import INPUT_BYTES, required_inputs
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
    """Its validated parameters, as a submit would store them."""
    inputs: dict[str, bytes] = field(default_factory=dict)
    """The bytes of its inputs by role (an image-to-video model's first frame), which a worker
    would read from the artifact store for the encode chunk."""

    @property
    def chunk_params(self) -> dict[str, Any]:
        """``params`` as its chunks take them: with the inputs' bytes (``INPUT_BYTES``)."""
        return {**self.params, INPUT_BYTES: self.inputs} if self.inputs else self.params


def warm_jobs(registry: ModelRegistry | None = None,
              kinds: Sequence[str] = ("image", "video", "text")) -> list[WarmJob]:
    """One warm-up job per recipe of ``kinds``, with the recipe's own defaults otherwise (the
    shapes a first real job most likely has)."""
    registry = registry or default_registry()
    jobs = []
    for name in registry.names():
        kind = registry.get(name).kind
        if kind in kinds:
            inputs = _inputs(name, kind, registry)
            jobs.append(WarmJob(name, kind, _params(name, kind, registry, inputs), inputs))
    return jobs


def _inputs(name: str, kind: str, registry: ModelRegistry) -> dict[str, bytes]:
    """An input image (a small grey PNG) for a recipe that needs one: an image-to-video model's
    first frame, an edit model's image."""
    if kind not in DIFFUSION_KINDS:
        return {}
    recipe = diffusion_recipe(name, registry)
    if "image" not in required_inputs(recipe.family, recipe.conditioning):
        return {}
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(out, format="PNG")
    return {"image": out.getvalue()}


def _params(name: str, kind: str, registry: ModelRegistry, inputs: dict[str, bytes]
            ) -> dict[str, Any]:
    if kind not in DIFFUSION_KINDS:
        return {"prompt": "warm up", "max_new_tokens": WARM_STEPS, "chunk_tokens": 1,
                "model": name}
    conditioned = diffusion_recipe(name, registry).conditioning
    condition = {"class_label": 0} if conditioned == "class" else {"prompt": "warm up"}
    digests = {role: "sha256:" + hashlib.sha256(data).hexdigest() for role, data in inputs.items()}
    return validate_params(kind, {"model": name, "num_inference_steps": WARM_STEPS,
                                  **condition, **digests}, registry)


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
