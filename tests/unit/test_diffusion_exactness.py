"""A chunked, preempted, migrated diffusion job equals the diffusers pipeline run in one go.

Every chunk's state goes through Checkpoint bytes; the job stops once inside a step at a block
boundary and moves to a "fresh worker" (new runner, models rebuilt from the recipe) at random
step boundaries. Outputs are compared with torch.equal: bit-exact, no tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from diffusers import DiTPipeline, PixArtSigmaPipeline, WanPipeline

from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.blockwise import full_forward
from workers.diffusion.components import DiffusionComponents, clear_component_cache
from workers.diffusion.pipelines import ADAPTERS
from workers.diffusion.runner import DiffusionRunner

pytestmark = pytest.mark.timeout(120)

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 207, "guidance_scale": 4.0}),
    "pixart-tiny": ("image", {"prompt": "A red fox in snow", "negative_prompt": "blurry",
                              "height": 32, "width": 48}),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "negative_prompt": "static",
                           "num_frames": 9}),
}
CASES = [
    ("dit-tiny", "ddim"), ("dit-tiny", "dpmpp_2m"),
    ("pixart-tiny", "dpmpp_2m"), ("pixart-tiny", "unipc"),
    ("wan-tiny", "unipc"), ("wan-tiny", "flow_match_euler"),
]
STEPS = 5


def _params(model: str, scheduler: str, seed: int = 7) -> dict[str, Any]:
    kind, extra = JOBS[model]
    raw = {"model": model, "scheduler": scheduler, "seed": seed, "num_inference_steps": STEPS}
    return validate_params(kind, {**raw, **extra})


def _yield_once_at(call: int) -> Callable[[], bool]:
    calls = iter(range(10_000))
    return lambda: next(calls) == call


def run_preempted_job(params: Mapping[str, Any], rng: random.Random) -> tuple[Checkpoint,
                                                                              DiffusionRunner]:
    """Run every chunk through Checkpoint bytes, yielding once mid-step and migrating often."""
    kind = "video" if params["num_frames"] > 1 else "image"
    runner = get_runner(kind, block_groups=3)
    yield_step = rng.randrange(1, STEPS + 1)
    state: Checkpoint | None = None
    index, yields = 0, 0
    while index < STEPS + 1:
        should_yield = _yield_once_at(rng.randrange(2)) if index == yield_step else lambda: False
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
    gen = torch.Generator().manual_seed(int(params["seed"]))
    scheduler = c.scheduler(str(params["scheduler"]))
    common = {"num_inference_steps": STEPS, "guidance_scale": params["guidance_scale"],
              "generator": gen}
    if c.recipe.family == "dit":
        pipe = DiTPipeline(transformer=c.transformer, vae=c.vae, scheduler=scheduler)
        return None, pipe(class_labels=[params["class_label"]], output_type="pt", **common).images
    captured: dict[str, torch.Tensor] = {}
    if c.recipe.family == "pixart":
        pipe = PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                   transformer=c.transformer, scheduler=scheduler)
        pixels = pipe(
            prompt=params["prompt"], negative_prompt=params["negative_prompt"],
            height=params["height"], width=params["width"], output_type="pt",
            use_resolution_binning=False, clean_caption=False,
            max_sequence_length=c.recipe.text_max_length,
            callback=lambda i, t, lat: captured.update(latents=lat.clone()), **common,
        ).images
        return captured["latents"], pixels

    def keep(_p: Any, _i: int, _t: Any, kw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        captured["latents"] = kw["latents"].clone()
        return {}

    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                       transformer=c.transformer, scheduler=scheduler)
    frames = pipe(
        prompt=params["prompt"], negative_prompt=params["negative_prompt"],
        height=params["height"], width=params["width"], num_frames=params["num_frames"],
        output_type="pt", max_sequence_length=c.recipe.text_max_length,
        callback_on_step_end=keep, **common,
    ).frames
    return captured["latents"], frames


@pytest.mark.parametrize(("model", "scheduler"), CASES)
def test_preempted_migrated_job_equals_uninterrupted_pipeline(model: str, scheduler: str) -> None:
    # given a job and the library's own pipeline built from the same recipe
    params = _params(model, scheduler)
    rng = random.Random(f"{model}/{scheduler}")
    # when the job runs chunk by chunk, preempted inside a step and moved between workers
    final_state, runner = run_preempted_job(params, rng)
    pixels = runner.decode_pixels(params, final_state)
    # then latents and decoded pixels are bit-identical to the uninterrupted pipeline
    ref_latents, ref_pixels = _pipeline_latents_and_pixels(runner.components(params), params)
    if ref_latents is not None:
        assert torch.equal(final_state.tensors["latents"], ref_latents)
    assert pixels.shape == ref_pixels.shape
    assert torch.equal(pixels, ref_pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


@pytest.mark.parametrize("model", sorted(JOBS))
def test_blockwise_forward_equals_the_models_own_forward(model: str) -> None:
    # given the transformer inputs of the first step of a job
    kind, extra = JOBS[model]
    params = validate_params(kind, {"model": model, **extra})
    runner = get_runner(kind)
    state = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    job = runner._restore(params, 1, state)
    progress = runner._start_step(params, job)
    c = runner.components(params)
    for inputs in progress.inputs:
        # when the adapter runs prologue, every block and epilogue
        with torch.no_grad():
            ours = full_forward(ADAPTERS[c.recipe.family], c.transformer, inputs)
            kwargs = dict(inputs)
            if c.recipe.family == "pixart":
                kwargs["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
            theirs = c.transformer(**kwargs, return_dict=False)[0]
        # then it is bit-identical to the model's forward
        assert torch.equal(ours, theirs)
