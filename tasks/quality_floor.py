"""A job's quality floor checked against its kind and params, its ladder of levels priced by the
cost model, and the params of the level admission chose (``scheduler.degradation``).

The params of a degraded job are the validated params of the same job asked at that level
(steps, step cache, size): the runner cannot tell the two apart, so its output is exactly the
library's at that level.
"""

from __future__ import annotations

from typing import Any

from scheduler.cost import CostModel, chunk_cost_key, chunk_kind
from scheduler.degradation import Degradation, QualityLadder, Size
from tasks.errors import InvalidJob
from tasks.spec import QualityFloor
from workers.diffusion.cache_params import REFUSED_FAMILIES, step_cache_key
from workers.diffusion.recipes import diffusion_recipe
from workers.errors import ModelConfigError
from workers.runner import ChunkPlan

STEPS_PARAM = {"image": "num_inference_steps", "video": "num_inference_steps",
               "simulated": "steps"}
"""The parameter a quality floor lowers, per kind that can be degraded."""
FIXED_CHUNKS = frozenset({"encode", "decode", "prefill"})
"""Chunks every level runs once (their cost does not scale with the steps)."""
MAX_SIZES = 16
"""At most this many smaller sizes are levels (the grid's steps nearest the job's size)."""


def full_steps(kind: str, params: dict[str, Any], min_steps: int) -> int:
    """The steps a job asked for (validated ``params``); :class:`InvalidJob` when its quality
    floor cannot apply (a kind without steps, or a floor above them)."""
    if kind not in STEPS_PARAM:
        raise InvalidJob(f"quality_floor applies to {', '.join(STEPS_PARAM)} jobs, not {kind}")
    steps = int(params[STEPS_PARAM[kind]])
    if min_steps > steps:
        raise InvalidJob(f"quality_floor.min_steps={min_steps} is more than the job's "
                         f"{STEPS_PARAM[kind]}={steps}; use 1 to {steps}")
    return steps


def check_floor(kind: str, params: dict[str, Any], floor: QualityFloor) -> int:
    """The job's full steps once its whole floor is checked (:class:`InvalidJob` says what to
    fix): steps as :func:`full_steps`; a cache or size floor only on an image or video job, a
    cache the model takes and the job did not ask already, a size on the model's grid and not
    above the job's own."""
    steps = full_steps(kind, params, floor.min_steps)
    if not floor.lowers_more_than_steps():
        return steps
    if kind not in ("image", "video"):
        raise InvalidJob(f"quality_floor.step_cache, min_height and min_width apply to image "
                         f"and video jobs, not {kind}")
    try:
        recipe = diffusion_recipe(str(params["model"]))
    except ModelConfigError as exc:
        raise InvalidJob(str(exc)) from exc
    if floor.step_cache is not None:
        if recipe.family in REFUSED_FAMILIES:
            raise InvalidJob(f"quality_floor.step_cache: model {recipe.name!r} takes no step "
                             f"cache: {REFUSED_FAMILIES[recipe.family]}")
        if params.get("step_cache") is not None:
            raise InvalidJob("quality_floor.step_cache: the job already asks for a step cache; "
                             "drop one of the two")
    for name, low in (("height", floor.min_height), ("width", floor.min_width)):
        own, step = int(params[name]), recipe.size_multiple_px
        if low is None:
            continue
        if low > own:
            raise InvalidJob(f"quality_floor.min_{name}={low} is more than the job's "
                             f"{name}={own}; use {recipe.min_size_px} to {own}")
        if low % step or low < recipe.min_size_px:
            raise InvalidJob(f"quality_floor.min_{name}={low} does not fit model "
                             f"{recipe.name!r} (multiples of {step} px from "
                             f"{recipe.min_size_px}); use {max(low // step * step, step)} or "
                             f"{-(-low // step) * step}")
    if recipe.square_only and floor.min_height != floor.min_width:
        raise InvalidJob(f"model {recipe.name!r} makes square images only: give min_height "
                         f"and min_width alike")
    return steps


def floor_sizes(params: dict[str, Any], floor: QualityFloor) -> tuple[Size, ...]:
    """The smaller sizes a job allows: both sides step down the model's grid together, each
    stopping at its floor (at most :data:`MAX_SIZES`, the nearest the job's own size first)."""
    if floor.min_height is None and floor.min_width is None:
        return ()
    step = diffusion_recipe(str(params["model"])).size_multiple_px
    height, width = int(params["height"]), int(params["width"])
    low_h = height if floor.min_height is None else floor.min_height
    low_w = width if floor.min_width is None else floor.min_width
    out: list[Size] = []
    for k in range(1, MAX_SIZES + 1):
        size = (max(height - k * step, low_h), max(width - k * step, low_w))
        if size == (height, width) or (out and size == out[-1]):
            break
        out.append(size)
    return tuple(out)


def cache_fraction(cost: CostModel, cost_key: str, floor: QualityFloor) -> float:
    """A cached denoise step's measured share of an uncached one's (1.0 until the cost model
    has measured cached steps of this model and shape: an unmeasured cache is never assumed
    to save anything)."""
    if floor.step_cache is None:
        return 1.0
    cached = chunk_cost_key(cost_key + step_cache_key(floor.step_cache), "denoise")
    if cost.samples(cached) == 0:
        return 1.0
    full = cost.seconds_per_unit(chunk_cost_key(cost_key, "denoise"))
    return min(cost.seconds_per_unit(cached) / full, 1.0) if full > 0 else 1.0


def quality_ladder(kind: str, params: dict[str, Any], plan: ChunkPlan, floor: QualityFloor,
                   cost: CostModel) -> QualityLadder:
    """The job's levels priced by the cost model: its encode, decode and prefill chunks are run
    at every level, its other chunks (the steps, all their evaluations) scale with the steps,
    a cached step by the cache's measured share, a smaller size by its pixels."""
    steps = full_steps(kind, params, floor.min_steps)
    fixed_s = step_total_s = 0.0
    for name, units in zip(plan.names, plan.cost_units, strict=True):
        seconds = cost.estimate_step_s(chunk_cost_key(plan.cost_key, name), units=units)
        if chunk_kind(name) in FIXED_CHUNKS:
            fixed_s += seconds
        else:
            step_total_s += seconds
    sized = kind in ("image", "video")
    return QualityLadder(
        full_steps=steps, min_steps=floor.min_steps, step_s=step_total_s / steps,
        fixed_s=fixed_s,
        cache=None if floor.step_cache is None else floor.step_cache.kind,
        cache_fraction=cache_fraction(cost, plan.cost_key, floor),
        full_size=(int(params["height"]), int(params["width"])) if sized else None,
        sizes=floor_sizes(params, floor) if sized else ())


def level_params(kind: str, params: dict[str, Any], floor: QualityFloor,
                 chosen: Degradation) -> dict[str, Any]:
    """The params of the job asked at ``chosen``'s level (to be validated as any job's)."""
    out = {**params, STEPS_PARAM[kind]: chosen.steps}
    if chosen.cache is not None and floor.step_cache is not None:
        out["step_cache"] = floor.step_cache.model_dump()
    if chosen.size is not None:
        out["height"], out["width"] = chosen.size
    return out
