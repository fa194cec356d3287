"""A quality floor with a step cache and a smaller size (``tasks.quality_floor``): refused with
what to fix when it cannot apply; under overload the level chosen is priced by the cost model,
and the degraded job is exactly the job asked at that level, down to its pixels."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from scheduler.cost import CostModel, chunk_cost_key
from scheduler.degradation import Level, choose_level
from scheduler.policy import PolicyConfig
from tasks.errors import InvalidJob
from tasks.quality_floor import check_floor, floor_sizes, level_params, quality_ladder
from tasks.spec import JobSpec, QualityFloor
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params

pytestmark = pytest.mark.timeout(180)

ASKED = {"model": "pixart-tiny", "prompt": "A red fox in snow", "num_inference_steps": 6,
         "seed": 3, "height": 48, "width": 48}
CACHE = {"kind": "first_block", "threshold": 0.1}


def _params(**extra: Any) -> dict[str, Any]:
    return validate_params("image", {**ASKED, **extra})


@pytest.mark.parametrize(("kind", "params", "floor", "problem"), [
    ("image", ASKED, {"min_steps": 2, "min_height": 64}, "min_height=64 is more than the "
     "job's height=48"),
    ("image", ASKED, {"min_steps": 2, "min_width": 20}, "min_width=20 does not fit model "
     "'pixart-tiny' \\(multiples of 8 px from 16\\); use 16 or 24"),
    ("image", {**ASKED, "model": "sd35-tiny"}, {"min_steps": 2, "step_cache": CACHE},
     "model 'sd35-tiny' takes no step cache"),
    ("image", {**ASKED, "step_cache": CACHE}, {"min_steps": 2, "step_cache": CACHE},
     "already asks for a step cache"),
    ("simulated", {"steps": 10}, {"min_steps": 2, "min_height": 16},
     "apply to image and video jobs, not simulated"),
    ("image", ASKED, {"min_steps": 9}, "min_steps=9 is more than the job's "
     "num_inference_steps=6"),
])
def test_a_floor_that_cannot_apply_is_refused_saying_what_to_fix(
        kind: str, params: dict[str, Any], floor: dict[str, Any], problem: str) -> None:
    # given a job whose floor is above its own value, a cache its model refuses, or a size off
    # the model's grid
    checked = validate_params(kind, params) if kind != "simulated" else params
    # then the floor is refused naming the field and what to use
    with pytest.raises(InvalidJob, match=problem):
        check_floor(kind, checked, QualityFloor.model_validate(floor))


def test_a_malformed_floor_is_a_pydantic_error_naming_the_field() -> None:
    # given a floor with an unknown cache kind or a negative size, then pydantic names it
    with pytest.raises(ValidationError, match=r"quality_floor\.step_cache\.kind"):
        JobSpec.model_validate({"kind": "image", "quality_floor": {
            "min_steps": 1, "step_cache": {"kind": "teacache"}}})
    with pytest.raises(ValidationError, match=r"quality_floor\.min_height"):
        JobSpec.model_validate({"kind": "image", "quality_floor": {"min_steps": 1,
                                                                   "min_height": 0}})


def test_smaller_sizes_step_down_the_models_grid_to_the_floor() -> None:
    # given a 48x48 job that allows down to 16x32
    floor = QualityFloor(min_steps=1, min_height=16, min_width=32)
    # then its sizes are the grid's 8 px steps, each side stopping at its floor
    assert floor_sizes(_params(), floor) == ((40, 40), (32, 32), (24, 32), (16, 32))


def _measured_cache_model() -> CostModel:
    """A cost model that measured this shape's cached denoise steps at 40 % of uncached ones."""
    key = "pixart-tiny:48x48x1"
    cost = CostModel()
    for _ in range(5):
        cost = cost.observe(chunk_cost_key(key, "denoise"), "cpu", 1.0, 1.0)
        cost = cost.observe(chunk_cost_key(key + "+first_block@0.1", "denoise"), "cpu", 1.0,
                            0.4)
    return cost


def test_the_ladder_prices_a_cached_step_by_its_measured_share_and_a_size_by_its_pixels(
        ) -> None:
    # given the cost model's measure of cached steps, and a job allowing a cache and 24x24
    params = _params()
    floor = QualityFloor(min_steps=3, step_cache=CACHE, min_height=24, min_width=24)
    ladder = quality_ladder("image", params, get_runner("image").plan(params), floor,
                            _measured_cache_model())
    # then a cached level costs the measured share (about 40 %, the running mean's) of its
    # steps' work and a 24x24 one a quarter
    full = ladder.level_work_s(Level(6)) - ladder.fixed_s
    assert ladder.cache_fraction == pytest.approx(0.4, abs=0.02)
    assert ladder.level_work_s(Level(6, "first_block")) - ladder.fixed_s == pytest.approx(
        ladder.cache_fraction * full)
    assert ladder.level_work_s(Level(6, None, (24, 24))) - ladder.fixed_s == pytest.approx(
        0.25 * full)
    # and without a measure a cache is assumed to save nothing
    unmeasured = quality_ladder("image", params, get_runner("image").plan(params), floor,
                                CostModel())
    assert unmeasured.cache_fraction == 1.0


def _run(params: dict[str, Any]) -> torch.Tensor:
    runner = get_runner("image")
    state: Checkpoint | None = None
    for index in range(runner.evaluations(params) + 1):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    return runner.decode_pixels(params, state)


def test_a_degraded_job_equals_the_job_asked_at_that_level_pixel_for_pixel() -> None:
    # given an overloaded fleet and a job allowing 3 of its 6 steps, a cache and 24x24, due
    # where only a lower level makes it
    params = _params()
    floor = QualityFloor(min_steps=3, step_cache=CACHE, min_height=24, min_width=24)
    ladder = quality_ladder("image", params, get_runner("image").plan(params), floor,
                            _measured_cache_model())
    deadline_s = 5.0 * (ladder.fixed_s + 0.3 * (ladder.level_work_s(Level(6)) - ladder.fixed_s))
    chosen = choose_level(ladder, deadline_s, 1.2, PolicyConfig())
    assert chosen is not None and chosen.meets and chosen.level != Level(6)
    # when the job is run at the chosen level, and the same job is asked at it directly
    degraded = validate_params("image", level_params("image", params, floor, chosen))
    direct = {**ASKED, "num_inference_steps": chosen.steps}
    if chosen.cache is not None:
        direct["step_cache"] = CACHE
    if chosen.size is not None:
        direct["height"], direct["width"] = chosen.size
    # then the two are the same job, and their pixels are bit-identical
    assert degraded == validate_params("image", direct)
    assert torch.equal(_run(degraded), _run(validate_params("image", direct)))
    assert chosen.as_json()["steps"] == chosen.steps
