"""A job with a First Block Cache: preempted, migrated or crash-resumed anywhere it equals its
uninterrupted run, which equals diffusers' own pipeline with the library's cache, bit for bit.

diffusers keeps one cache state per ``cache_context`` name of each transformer: WanPipeline runs
CFG as two calls (``cond``, ``uncond``), so each pass has its own state; DiTPipeline and
PixArt-Sigma run CFG as one doubled batch, so one state covers both halves, its decision taken
over the whole batch. Stepline keeps one state per expert and pass, which is the same thing.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
from diffusers.hooks.hooks import CacheContext, StateManager
from diffusers.models.cache_utils import CacheMixin

from scheduler.cost import CostModel, chunk_cost_key
from tests.unit.test_diffusion_exactness import JOBS, _pipeline_latents_and_pixels
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.cache_params import FIRST_BLOCK_THRESHOLD
from workers.diffusion.components import DiffusionComponents, clear_component_cache
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.state import STATE_VERSION, STEP_CACHE_STATE_VERSION
from workers.diffusion.step_cache import should_compute
from workers.errors import CheckpointError, ParamsError

pytestmark = pytest.mark.timeout(180)

STEPS = 5
CASES = [("wan-tiny", "unipc", 0.1), ("pixart-tiny", "dpmpp_2m", 0.1),
         ("dit-tiny", "ddim", 0.5), ("wan22-tiny", "unipc", 0.1),
         ("flux-tiny", "flow_match_euler", 0.6)]
"""Thresholds at which the tiny random models both reuse and recompute within five steps."""


def _params(model: str, scheduler: str, threshold: float | None) -> dict[str, Any]:
    kind, extra, _ = JOBS[model]
    cache = {} if threshold is None else {"step_cache": {"kind": "first_block",
                                                         "threshold": threshold}}
    return validate_params(kind, {"model": model, "scheduler": scheduler, "seed": 7,
                                  "num_inference_steps": STEPS, **extra, **cache})


def _kind(params: Mapping[str, Any]) -> str:
    return "video" if params["num_frames"] > 1 else "image"


def _uninterrupted(params: Mapping[str, Any]) -> tuple[Checkpoint, DiffusionRunner]:
    """Every chunk on one worker, never stopped: the state stays in memory between chunks."""
    runner = get_runner(_kind(params), block_groups=3)
    state: Checkpoint | None = None
    for index in range(runner.evaluations(params) + 1):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    return state, runner


def _interrupted(params: Mapping[str, Any], rng: random.Random, crash_chunk: int
                 ) -> tuple[Checkpoint, DiffusionRunner, int]:
    """Every chunk through Checkpoint bytes, stopped at every block-group boundary and often
    moved to a fresh worker; chunk ``crash_chunk`` first runs on a worker that dies before its
    result is kept. Returns the state after the last denoise chunk and how often it stopped."""
    kind = _kind(params)
    runner = get_runner(kind, block_groups=3)
    state: Checkpoint | None = None
    index, stops = 0, 0
    while index < runner.evaluations(params) + 1:
        if index == crash_chunk:
            runner.run_chunk(params, index, state, lambda: rng.random() < 0.5)  # lost
            crash_chunk = -1
            clear_component_cache()
            runner = get_runner(kind, block_groups=3)
            state = None if state is None else Checkpoint.decode(state.encode())
        result = runner.run_chunk(params, index, state, lambda: True)
        state = Checkpoint.decode(result.state.encode())
        index, stops = (index + 1, stops) if result.complete else (index, stops + 1)
        if rng.random() < 0.3:
            clear_component_cache()  # a fresh worker: models rebuilt from the recipe
            runner = get_runner(kind, block_groups=3)
    assert state is not None
    return state, runner, stops


def _library_with_cache(c: DiffusionComponents, params: Mapping[str, Any], threshold: float
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The library's pipeline on copies of the transformers with its First Block Cache on (the
    worker's resident models stay unhooked)."""
    config = FirstBlockCacheConfig(threshold=threshold)
    transformer = copy.deepcopy(c.transformer)
    if c.recipe.family in ("wan", "wan22"):  # CacheMixin models: WanPipeline sets the contexts
        transformer.enable_cache(config)
        second = copy.deepcopy(c.transformer_2)
        if second is not None:
            second.enable_cache(config)
        return _pipeline_latents_and_pixels(replace(c, transformer=transformer,
                                                    transformer_2=second), params)
    # DiT and PixArt have no CacheMixin and their pipelines set no context: one for the run
    apply_first_block_cache(transformer, config)
    with CacheMixin.cache_context(transformer, "cond"):
        return _pipeline_latents_and_pixels(replace(c, transformer=transformer), params)


@pytest.mark.parametrize(("model", "scheduler", "threshold"), CASES)
def test_a_cached_job_stopped_moved_and_crash_resumed_equals_it_run_in_one_go(
        model: str, scheduler: str, threshold: float) -> None:
    # given a job with a first block cache
    params = _params(model, scheduler, threshold)
    # when it runs once uninterrupted, and once through checkpoint bytes, stopped at every
    # block-group boundary, moved between workers and its third chunk lost to a crash
    expected, runner = _uninterrupted(params)
    got, _, stops = _interrupted(params, random.Random(f"{model}/{threshold}"), crash_chunk=3)
    # then latents, cache counts and decoded pixels are bit-identical
    assert stops > STEPS, "the job must have stopped inside steps"
    assert got.meta["step_cache"]["hits"] == expected.meta["step_cache"]["hits"] > 0
    assert got.meta["step_cache"]["misses"] == expected.meta["step_cache"]["misses"] > 0
    assert torch.equal(got.tensors["latents"], expected.tensors["latents"])
    assert torch.equal(runner.decode_pixels(params, got), runner.decode_pixels(params, expected))


@pytest.mark.parametrize(("model", "scheduler", "threshold"), CASES)
def test_an_uninterrupted_cached_job_equals_the_library_pipeline_with_first_block_cache(
        model: str, scheduler: str, threshold: float) -> None:
    # given a job with a first block cache that both reuses and recomputes
    params = _params(model, scheduler, threshold)
    state, runner = _uninterrupted(params)
    assert state.meta["step_cache"]["hits"] > 0 and state.meta["step_cache"]["misses"] > 0
    pixels = runner.decode_pixels(params, state)
    # when the library's pipeline runs with its own cache at the same threshold
    c = runner.components(params)
    ref_latents, ref_pixels = _library_with_cache(c, params, threshold)
    # then latents and pixels are bit-identical, and differ from the uncached pipeline's
    if ref_latents is not None:
        assert torch.equal(state.tensors["latents"], ref_latents)
    assert torch.equal(pixels, ref_pixels)
    _, uncached_pixels = _pipeline_latents_and_pixels(c, params)
    assert not torch.equal(pixels, uncached_pixels), "a cache that reused must change the output"


def test_a_family_the_librarys_cache_cannot_run_refuses_a_step_cache_saying_why() -> None:
    # given SD 3.5, where diffusers' own First Block Cache hook fails
    params = {"model": "sd35-tiny", "prompt": "a cat", "num_inference_steps": STEPS,
              "step_cache": {"kind": "first_block", "threshold": 0.1}}
    # when a job asks for a cache on it, then it is refused with the reason
    with pytest.raises(ParamsError, match=r"sd35-tiny.*takes no step_cache.*SD3Transformer2DModel"):
        validate_params("image", params)
    # and the refusal stands on the library's failure: its pipeline with its cache still fails
    plain = validate_params("image", {k: v for k, v in params.items() if k != "step_cache"})
    c = get_runner("image").components(plain)
    with pytest.raises(TypeError):
        _library_with_cache(c, plain, 0.1)


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
def test_the_skip_decision_is_the_librarys_including_a_change_equal_to_the_threshold(
        scale: float) -> None:
    # given a previous and a current first-block residual
    gen = torch.Generator().manual_seed(int(scale * 10))
    previous = torch.randn(2, 8, 16, generator=gen)
    residual = previous + scale * 0.1 * torch.randn(2, 8, 16, generator=gen)
    exact = ((residual - previous).abs().mean() / previous.abs().mean()).item()
    hook = FBCHeadBlockHook(StateManager(FBCSharedBlockState, (), {}), threshold=0.0)
    hook.state_manager.set_context(CacheContext("cond"))
    hook.state_manager.get_state().head_block_residual = previous
    for threshold in (exact / 2, exact, math.nextafter(exact, 0.0), exact * 2):
        # when both decide at a threshold below, at, just below and above the change
        hook.threshold = threshold
        theirs = hook._should_compute_remaining_blocks(residual)
        # then they agree (at the threshold itself the rest is skipped)
        assert should_compute(residual, previous, threshold) == theirs
    assert should_compute(residual, previous, exact) is False


def test_the_default_threshold_is_the_librarys() -> None:
    # given a job asking for a first block cache without a threshold
    params = validate_params("video", {"prompt": "x", "step_cache": {"kind": "first_block"}})
    # then it runs at diffusers' default
    assert params["step_cache"] == {"kind": "first_block", "threshold": FIRST_BLOCK_THRESHOLD}
    assert FirstBlockCacheConfig().threshold == FIRST_BLOCK_THRESHOLD


@pytest.mark.parametrize(("cache", "message"), [
    ({"kind": "first_block", "threshold": 0}, "step_cache.threshold: Input should be greater"),
    ({"kind": "first_block", "threshold": 1.5}, "step_cache.threshold: Input should be less"),
    ({"kind": "first_block", "threshold": float("nan")}, "step_cache.threshold: Input should be "
                                                         "a finite number"),
    ({"kind": "teacache"}, "step_cache.kind: Input should be 'first_block'"),
    ({"threshold": 0.1}, "step_cache.kind: Field required"),
    ({"kind": "first_block", "every": 2}, "step_cache.every: Extra inputs"),
])
def test_a_step_cache_out_of_bounds_is_refused_naming_the_field(cache: dict[str, Any],
                                                                message: str) -> None:
    # when a job asks for a step cache that does not exist or is out of bounds
    # then it is refused at validation, naming the field and what it should be
    with pytest.raises(ParamsError, match=message):
        validate_params("video", {"prompt": "x", "step_cache": cache})


def test_a_job_without_a_step_cache_carries_no_step_cache_key_and_a_version_2_checkpoint() -> None:
    # given a job without a step cache
    params = validate_params("image", {"class_label": 3, "num_inference_steps": 2})
    # when its encode chunk runs
    state = get_runner("image").run_chunk(params, 0, None, lambda: False).state
    # then its parameters and checkpoint are what they were before step caches existed
    assert "step_cache" not in params
    assert state.meta["version"] == STATE_VERSION and "step_cache" not in state.meta


def test_a_cached_jobs_checkpoint_is_version_3_and_refused_under_another_threshold() -> None:
    # given a cached job's checkpoint after its first denoise step
    params = _params("pixart-tiny", "dpmpp_2m", 0.1)
    runner = get_runner("image")
    state = runner.run_chunk(params, 0, None, lambda: False).state
    state = runner.run_chunk(params, 1, Checkpoint.decode(state.encode()), lambda: False).state
    blob = state.encode()
    assert Checkpoint.decode(blob).meta["version"] == STEP_CACHE_STATE_VERSION
    assert any(key.startswith("cache.transformer.0.") for key in Checkpoint.decode(blob).tensors)
    # when it resumes under another threshold, or without the cache
    for other in (_params("pixart-tiny", "dpmpp_2m", 0.2),
                  _params("pixart-tiny", "dpmpp_2m", None)):
        # then it is refused rather than resumed with another cache
        with pytest.raises(CheckpointError, match="step cache"):
            get_runner("image").run_chunk(other, 2, Checkpoint.decode(blob), lambda: False)


def test_cached_jobs_are_costed_apart_and_their_steps_share_no_forward() -> None:
    # given the same job with and without a first block cache
    plain, cached = _params("wan-tiny", "unipc", None), _params("wan-tiny", "unipc", 0.1)
    runner = get_runner("video")
    plain_key, cached_key = runner.plan(plain).cost_key, runner.plan(cached).cost_key
    # when a cached denoise step's time is learned
    cost = CostModel(priors_s_per_unit={"wan-tiny": 0.5}, prior_samples=0)
    cost = cost.observe(chunk_cost_key(cached_key, "denoise[0]"), "cpu", 1.0, 0.1)
    # then it teaches the cached key only, and both start from the model's prior
    assert cached_key == f"{plain_key}+first_block@0.1"
    assert cost.seconds_per_unit(chunk_cost_key(cached_key, "denoise[1]"), "cpu") \
        == pytest.approx(0.1)
    assert cost.seconds_per_unit(chunk_cost_key(plain_key, "denoise[1]"), "cpu") == 0.5
    assert cost.prior_s_per_unit(cached_key) == cost.prior_s_per_unit(plain_key) == 0.5
    # and its denoise chunks run alone (the skip is each job's own), its encode batches
    assert runner.batch_key(cached, 1) is None and runner.batch_key(plain, 1) is not None
    assert runner.batch_key(cached, 0) == runner.batch_key(plain, 0)
