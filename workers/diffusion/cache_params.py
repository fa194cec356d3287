"""A job's step cache as its parameters ask for it, read without torch: which cache, how eagerly
it reuses, and the text that keys the job's cost estimates apart from uncached ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FIRST_BLOCK_THRESHOLD = 0.05
"""diffusers' ``FirstBlockCacheConfig`` default threshold (a unit test checks they agree)."""
MAX_THRESHOLD = 1.0
"""Above 1 a step would be skipped while its first block changed by more than its own size."""


REFUSED_FAMILIES = {
    "sd3": "diffusers' First Block Cache hook fails on SD3Transformer2DModel's joint blocks "
           "(it finds no encoder output to compare), so a cached job would have no library "
           "output to equal",
    "zimage": "diffusers' First Block Cache hook fails on ZImageTransformerBlock (it asks for a "
              "hidden_states argument the block names x), so a cached job would have no library "
              "output to equal",
    "flux2_klein": "diffusers' First Block Cache hook fails on Flux2Transformer2DModel (its tail "
                   "single-stream block's tensor is subtracted from the head double-stream "
                   "block's pair: TypeError), so a cached job would have no library output to "
                   "equal",
    "hunyuan_video15": "diffusers' First Block Cache cannot hook HunyuanVideo15Transformer3DModel "
                       "(ValueError: its HunyuanVideo15TransformerBlock is not in the hook's "
                       "block registry), so a cached job would have no library output to equal",
}
"""Families whose jobs may not ask for a step cache, and why."""


class StepCacheParams(BaseModel):
    """``params.step_cache``: reuse the transformer's work of an earlier step when this step
    barely differs from it (a speed tier; the output differs from the uncached run's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["first_block"]
    """``first_block``: diffusers' First Block Cache. Each forward runs the first block; when the
    mean absolute change of its residual relative to the last fully computed forward's is at
    most ``threshold``, the other blocks are skipped and their cached residual is added."""
    threshold: float = Field(default=FIRST_BLOCK_THRESHOLD, gt=0, le=MAX_THRESHOLD,
                             allow_inf_nan=False)
    """In (0, 1]; higher skips more steps (faster, further from the uncached output)."""


def step_cache_of(params: Mapping[str, Any]) -> StepCacheParams | None:
    """The step cache of a job's validated parameters (None: every block of every step runs)."""
    raw = params.get("step_cache")
    return None if raw is None else StepCacheParams.model_validate(raw)


def step_cache_key(cache: StepCacheParams | None) -> str:
    """``""`` without a cache, else e.g. ``"+first_block@0.1"``: appended to a job's cost key so
    cached steps are learned apart from full ones, while priors still match by prefix."""
    return "" if cache is None else f"+{cache.kind}@{cache.threshold!r}"
