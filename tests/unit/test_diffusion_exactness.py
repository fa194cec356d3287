"""A chunked, preempted, migrated diffusion job equals the diffusers pipeline run in one go.

One test over every family and sampler in JOBS: the job runs uninterrupted, or with every
chunk's state through Checkpoint bytes, stopped once inside a step at a block boundary, moved
to a "fresh worker" (new runner, models rebuilt from the recipe) at random step boundaries and
one chunk lost to a crash and rerun. The reference is the family's pipeline ``__call__``
(``tests/unit/diffusion_reference.py``); outputs are compared with torch.equal: bit-exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from tests.unit.diffusion_reference import CALLS, INPUT_IMAGE_DIGEST, reference_run, with_inputs
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.blockwise import full_forward
from workers.diffusion.components import DiffusionComponents, clear_component_cache
from workers.diffusion.pipelines import ADAPTERS, FAMILIES
from workers.diffusion.recipes import diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.zimage import model_inputs

pytestmark = pytest.mark.timeout(180)


JOBS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "dit-tiny": ("image", {"class_label": 207, "guidance_scale": 4.0}, ("ddim", "dpmpp_2m")),
    "pixart-tiny": ("image", {"prompt": "A red fox in snow", "negative_prompt": "blurry",
                              "height": 32, "width": 48}, ("dpmpp_2m", "unipc")),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "negative_prompt": "static",
                           "num_frames": 9}, ("unipc", "flow_match_euler")),
    "wan22-tiny": ("video", {"prompt": "a kite over dunes", "negative_prompt": "static",
                             "num_frames": 9, "guidance_scale": 5.0, "guidance_scale_2": 3.0},
                   ("unipc", "flow_match_heun")),
    "wan22-i2v-tiny": ("video", {"prompt": "a kite over dunes", "negative_prompt": "static",
                                 "num_frames": 9, "guidance_scale": 5.0, "guidance_scale_2": 3.0,
                                 "image": INPUT_IMAGE_DIGEST}, ("unipc", "flow_match_euler")),
    "flux-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                            "height": 32, "width": 48, "guidance_scale": 3.5,
                            "true_cfg_scale": 2.0}, ("flow_match_euler", "unipc")),
    "sd35-tiny": ("image", {"prompt": "A lighthouse at dawn", "negative_prompt": "blurry",
                            "height": 64, "width": 96}, ("flow_match_euler", "flow_match_heun")),
    "qwen-image-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                                  "height": 32, "width": 48, "true_cfg_scale": 2.0},
                        ("flow_match_euler", "unipc")),
    "flux-kontext-tiny": ("image", {"prompt": "make it dusk", "negative_prompt": "fog",
                                    "height": 32, "width": 48, "guidance_scale": 2.5,
                                    "true_cfg_scale": 2.0, "image": INPUT_IMAGE_DIGEST},
                          ("flow_match_euler", "unipc")),
    "zimage-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                              "height": 32, "width": 48, "guidance_scale": 3.0},
                    ("flow_match_euler",)),  # its other samplers draw noise
    "flux2-klein-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                                   "height": 32, "width": 48, "guidance_scale": 3.0},
                         ("flow_match_euler", "unipc")),
    "hunyuan-video15-tiny": ("video", {"prompt": 'a sign that reads "open"', "num_frames": 5,
                                       "negative_prompt": "static", "height": 32, "width": 48,
                                       "guidance_scale": 6.0}, ("flow_match_euler",)),
}
"""Per recipe: its kind, the job, and the samplers it is checked with; a new family is one
entry here and one in ``diffusion_reference.CALLS``."""
CASES = [(model, scheduler) for model, (_, _, samplers) in JOBS.items() for scheduler in samplers]
WAYS = ("uninterrupted", "preempted, migrated and crash-resumed")
STEPS = 5


def _params(model: str, scheduler: str, seed: int = 7) -> dict[str, Any]:
    kind, extra, _ = JOBS[model]
    raw = {"model": model, "scheduler": scheduler, "seed": seed, "num_inference_steps": STEPS}
    return with_inputs(validate_params(kind, {**raw, **extra}))


def _yield_once_at(call: int) -> Callable[[], bool]:
    calls = iter(range(10_000))
    return lambda: next(calls) == call


def run_uninterrupted_job(params: Mapping[str, Any]) -> tuple[Checkpoint, DiffusionRunner]:
    """Every chunk on one runner, never told to yield, each state handed on as it is."""
    runner = get_runner("video" if params["num_frames"] > 1 else "image", block_groups=3)
    state: Checkpoint | None = None
    for index in range(runner.evaluations(params) + 1):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    return state, runner


def run_preempted_job(params: Mapping[str, Any], rng: random.Random,
                      yield_chunk: int | None = None, crash_chunk: int | None = None
                      ) -> tuple[Checkpoint, DiffusionRunner]:
    """Run every chunk through Checkpoint bytes, yielding once mid-step (in chunk
    ``yield_chunk``, else a random one) and migrating often; chunk ``crash_chunk`` first runs
    on a worker that dies before its result is kept, and reruns from the same checkpoint."""
    kind = "video" if params["num_frames"] > 1 else "image"
    runner = get_runner(kind, block_groups=3)
    evaluations = runner.evaluations(params)
    yield_step = rng.randrange(1, evaluations + 1) if yield_chunk is None else yield_chunk
    state: Checkpoint | None = None
    index, yields = 0, 0
    while index < evaluations + 1:
        should_yield = _yield_once_at(rng.randrange(2)) if index == yield_step else lambda: False
        if index == crash_chunk:
            runner.run_chunk(params, index, state, lambda: False)  # its result is lost
            crash_chunk = None
            clear_component_cache()
            runner = get_runner(kind, block_groups=3)
            state = None if state is None else Checkpoint.decode(state.encode())
        result = runner.run_chunk(params, index, state, should_yield)
        state = Checkpoint.decode(result.state.encode())
        if not result.complete:
            yields += 1
            yield_step = -1  # one mid-step preemption per job
        else:
            index += 1
        if not result.complete or rng.random() < 0.5:
            clear_component_cache()  # resume on a "fresh worker": models rebuilt from the recipe
            runner = get_runner(kind, block_groups=3)
    assert yields == 1, "the job never stopped inside a step"
    assert state is not None
    return state, runner


def _pipeline_latents_and_pixels(c: DiffusionComponents, params: Mapping[str, Any]
                                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The library pipeline in one go (``diffusion_reference``): its latents and pixels."""
    ref = reference_run(c, params)
    return ref.latents, ref.pixels


def _boundary_chunks(params: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """A two-expert job's first chunk on ``transformer_2`` and its last on ``transformer``
    (both inside the run), else (None, None)."""
    runner = get_runner("video")
    if not runner.recipe(params).two_experts:
        return None, None
    experts = [runner._planned_expert(params, i) for i in range(1, runner.evaluations(params) + 1)]
    first_low = experts.index("transformer_2") + 1
    assert 1 < first_low <= len(experts), "the boundary must fall inside the run"
    return first_low, first_low - 1


def _crash_chunk(params: Mapping[str, Any], rng: random.Random) -> tuple[int | None, int]:
    """The chunk to yield in (None: a random one) and the chunk lost to a crash: for a
    two-expert job the first low-noise step and the last high-noise one, else a random one."""
    yield_chunk, crash_chunk = _boundary_chunks(params)
    if crash_chunk is None:
        kind = "video" if params["num_frames"] > 1 else "image"
        crash_chunk = rng.randrange(1, get_runner(kind).evaluations(params) + 1)
    return yield_chunk, crash_chunk


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("model", "scheduler"), CASES)
def test_a_job_run_any_way_equals_the_uninterrupted_library_pipeline(
    model: str, scheduler: str, way: str
) -> None:
    # given a job and the library's own pipeline built from the same recipe
    params = _params(model, scheduler)
    rng = random.Random(f"{model}/{scheduler}")
    # when the job runs chunk by chunk: in one go, or preempted inside a step (a two-expert
    # job: inside its first low-noise step), moved between workers and a chunk lost to a crash
    if way == WAYS[0]:
        final_state, runner = run_uninterrupted_job(params)
    else:
        final_state, runner = run_preempted_job(params, rng, *_crash_chunk(params, rng))
    pixels = runner.decode_pixels(params, final_state)
    # then latents and decoded pixels are bit-identical to the uninterrupted pipeline
    ref = reference_run(runner.components(params), params)
    if ref.latents is not None:
        assert torch.equal(final_state.tensors["latents"], ref.latents)
    assert pixels.shape == ref.pixels.shape
    assert torch.equal(pixels, ref.pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


def test_every_family_has_a_job_here_and_a_pipeline_call_to_compare_with() -> None:
    # given every family the runner knows
    families = set(FAMILIES)
    # when the exactness cases and the reference calls are listed
    checked = {diffusion_recipe(model).family for model in JOBS}
    # then none is left out of either
    assert families == checked == set(CALLS) == set(ADAPTERS)


@pytest.mark.parametrize("model", sorted(JOBS))
def test_blockwise_forward_equals_the_models_own_forward(model: str) -> None:
    # given the transformer inputs of the first step of a job
    kind, extra, _ = JOBS[model]
    params = with_inputs(validate_params(kind, {"model": model, **extra}))
    runner = get_runner(kind)
    state = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    job = runner._restore(params, 1, state)
    progress = runner._start_step(params, job)
    c = runner.components(params)
    models = [c.transformer] if c.transformer_2 is None else [c.transformer, c.transformer_2]
    for model, inputs in ((m, x) for m in models for x in progress.inputs):
        # when the adapter runs prologue, every block and epilogue (of each expert)
        with torch.no_grad():
            ours = full_forward(ADAPTERS[c.recipe.family], model, inputs)
            kwargs = dict(inputs)
            if c.recipe.family == "pixart":
                kwargs["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
            if c.recipe.family == "qwen_image":  # the model takes its token grid as a list
                kwargs["img_shapes"] = [[tuple(int(v) for v in inputs["img_shapes"][0])]]
            if c.recipe.family == "zimage":  # the model takes lists of per-image tensors
                kwargs = model_inputs(inputs)
            theirs = model(**kwargs, return_dict=False)[0]
            if c.recipe.family == "zimage":
                theirs = torch.stack(theirs)
        # then it is bit-identical to the model's forward
        assert torch.equal(ours, theirs)
