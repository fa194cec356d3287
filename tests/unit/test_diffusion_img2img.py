"""An image-to-image job, chunked, preempted and migrated, equals the library's img2img
arithmetic run in one go, bit for bit.

Flux and SD3 are compared with their own img2img pipelines (``FluxImg2ImgPipeline``,
``StableDiffusion3Img2ImgPipeline``, called in ``diffusion_reference``). PixArt has none: its
reference is built from diffusers' own parts: ``PixArtSigmaPipeline`` for the prompt
embeddings, image processor, transformer, scheduler and VAE, and
``StableDiffusionImg2ImgPipeline``'s own ``get_timesteps`` and ``prepare_latents`` (called on
the PixArt pipeline: they read only its scheduler and VAE) for the strength rule and the noised
image latents; the denoising loop is PixArtSigmaPipeline's.
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import PixArtSigmaPipeline, StableDiffusionImg2ImgPipeline
from PIL import Image

from tests.unit.diffusion_reference import reference_run
from tests.unit.test_diffusion_exactness import JOBS, run_preempted_job, run_uninterrupted_job
from workers.diffusion import get_runner, validate_params
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.inputs import INPUT_BYTES
from workers.errors import ParamsError

pytestmark = pytest.mark.timeout(180)

STEPS = 6


def png_bytes(width: int, height: int, seed: int = 3) -> bytes:
    """A random RGB PNG (not a flat colour: the comparison must see the image)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def img2img_params(scheduler: str, strength: float, image: bytes) -> dict[str, Any]:
    params = validate_params("image", {
        "model": "pixart-tiny", "prompt": "a lighthouse at dawn", "negative_prompt": "blurry",
        "height": 32, "width": 48, "num_inference_steps": STEPS, "scheduler": scheduler,
        "seed": 11, "image": digest(image), "strength": strength})
    return {**params, INPUT_BYTES: {"image": image}}


def reference_img2img(c: DiffusionComponents, p: Mapping[str, Any], image: bytes
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Final latents and pixels of the img2img arithmetic, from the library's own parts."""
    pipe = PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                               transformer=c.transformer, scheduler=c.scheduler(p["scheduler"]))
    gen = torch.Generator().manual_seed(int(p["seed"]))
    embeds, mask, neg, neg_mask = pipe.encode_prompt(
        p["prompt"], True, negative_prompt=p["negative_prompt"], clean_caption=False,
        max_sequence_length=c.recipe.text_max_length)
    embeds, mask = torch.cat([neg, embeds]), torch.cat([neg_mask, mask])
    pixels = pipe.image_processor.preprocess(Image.open(io.BytesIO(image)).convert("RGB"),
                                             height=p["height"], width=p["width"])
    pipe.scheduler.set_timesteps(STEPS)
    timesteps, _ = StableDiffusionImg2ImgPipeline.get_timesteps(pipe, STEPS, p["strength"], "cpu")
    latents = StableDiffusionImg2ImgPipeline.prepare_latents(
        pipe, pixels, timesteps[:1].repeat(1), 1, 1, embeds.dtype, "cpu", gen)
    extra = pipe.prepare_extra_step_kwargs(gen, 0.0)
    for t in timesteps:
        x = pipe.scheduler.scale_model_input(torch.cat([latents] * 2), t)
        noise = pipe.transformer(x, encoder_hidden_states=embeds, encoder_attention_mask=mask,
                                 timestep=t[None].expand(x.shape[0]),
                                 added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                 return_dict=False)[0]
        uncond, text = noise.chunk(2)
        noise = (uncond + p["guidance_scale"] * (text - uncond)).chunk(2, dim=1)[0]
        latents = pipe.scheduler.step(noise, t, latents, **extra, return_dict=False)[0]
    decoded = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return latents, pipe.image_processor.postprocess(decoded, output_type="pt")


@pytest.mark.parametrize(("scheduler", "strength"),
                         [("dpmpp_2m", 0.6), ("ddim", 0.8), ("euler_a", 0.5)])
def test_a_preempted_migrated_img2img_job_equals_the_librarys_img2img_arithmetic(
        scheduler: str, strength: float) -> None:
    # given an image-to-image job and a non-flat input image of another size than the job's
    image = png_bytes(40, 24)
    params = img2img_params(scheduler, strength, image)
    # when it runs chunk by chunk, preempted inside a step, crashed once and moved between workers
    state, runner = run_preempted_job(params, random.Random(scheduler), crash_chunk=2)
    pixels = runner.decode_pixels(params, state)
    # then it ran only the steps its strength leaves, and latents and pixels equal the reference
    assert runner.evaluations(params) == int(STEPS * strength)
    with torch.no_grad():
        ref_latents, ref_pixels = reference_img2img(runner.components(params), params, image)
    assert torch.equal(state.tensors["latents"], ref_latents)
    assert torch.equal(pixels, ref_pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


FLOW_CASES = [("flux-tiny", "flow_match_euler", 0.6, 4), ("flux-tiny", "flow_match_euler", 0.3, 2),
              ("sd35-tiny", "flow_match_euler", 0.7, 5), ("sd35-tiny", "flow_match_heun", 0.5, 5),
              ("qwen-image-tiny", "flow_match_euler", 0.6, 4)]
"""Model, sampler, strength and the model evaluations the pipeline runs: its strength rule,
``int(steps - steps * strength)`` steps skipped, is not PixArt's (0.6 of 6 steps: 4, not 3;
Heun evaluates twice a step but the last)."""


def flow_img2img_params(model: str, scheduler: str, strength: float, image: bytes
                        ) -> dict[str, Any]:
    _, extra, _ = JOBS[model]
    params = validate_params("image", {
        **extra, "model": model, "num_inference_steps": STEPS, "scheduler": scheduler,
        "seed": 11, "image": digest(image), "strength": strength})
    return {**params, INPUT_BYTES: {"image": image}}


@pytest.mark.parametrize("preempted", [False, True], ids=["uninterrupted", "preempted"])
@pytest.mark.parametrize(("model", "scheduler", "strength", "evaluations"), FLOW_CASES)
def test_a_flux_or_sd3_img2img_job_equals_the_librarys_own_img2img_pipeline(
        model: str, scheduler: str, strength: float, evaluations: int, preempted: bool) -> None:
    # given an image-to-image job and a non-flat input image of another size than the job's
    image = png_bytes(40, 24)
    params = flow_img2img_params(model, scheduler, strength, image)
    # when it runs in one go, or chunk by chunk preempted inside a step, crashed once and moved
    # between workers
    state, runner = run_preempted_job(params, random.Random(model + scheduler), crash_chunk=2) \
        if preempted else run_uninterrupted_job(params)
    pixels = runner.decode_pixels(params, state)
    # then it ran the steps the pipeline's strength rule leaves, and its latents and pixels
    # equal the library's img2img pipeline's, given the same image, generator and strength
    assert runner.evaluations(params) == evaluations
    ref = reference_run(runner.components(params), params)
    assert torch.equal(state.tensors["latents"], ref.latents)
    assert torch.equal(pixels, ref.pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


def test_the_input_image_changes_the_output() -> None:
    # given two img2img jobs alike but for their input image
    outputs = []
    for seed in (1, 2):
        image = png_bytes(32, 32, seed)
        params = img2img_params("dpmpp_2m", 0.5, image)
        # when each runs to the end
        state, runner = run_preempted_job(params, random.Random(seed))
        outputs.append(runner.decode_pixels(params, state))
    # then their pixels differ: the image conditions the job
    assert not torch.equal(*outputs)


def test_a_chunk_without_its_input_bytes_is_refused_by_name() -> None:
    # given an img2img job whose worker did not read its image
    image = png_bytes(32, 32)
    params = {k: v for k, v in img2img_params("ddim", 0.5, image).items() if k != INPUT_BYTES}
    # when its encode chunk runs, then it says which input is missing
    with pytest.raises(ParamsError, match="input image"):
        get_runner("image").run_chunk(params, 0, None, lambda: False)


@pytest.mark.parametrize(("params", "problem"), [
    ({"model": "dit-tiny", "class_label": 1}, "takes no input image"),
    ({"model": "pixart-tiny", "prompt": "x", "mask": True}, "takes no mask"),
    ({"model": "pixart-tiny", "prompt": "x", "num_inference_steps": 4, "strength": 0.2},
     "runs no step"),
    ({"model": "flux-tiny", "prompt": "x", "scheduler": "unipc"},
     "'unipc' .* has no scale_noise.*use one of flow_match_euler, flow_match_lcm$"),
    ({"model": "sd35-tiny", "prompt": "x", "scheduler": "flow_match_euler_a"}, "no scale_noise"),
    ({"model": "qwen-image-tiny", "prompt": "x", "scheduler": "unipc"}, "no scale_noise"),
    ({"model": "flux-kontext-tiny", "prompt": "x", "strength": 0.5}, "edit model.*no strength"),
    ({"model": "flux-kontext-tiny", "prompt": "x", "mask": True}, "edit model.*no mask"),
])
def test_an_input_a_model_cannot_use_is_refused_naming_why(params: dict[str, Any],
                                                           problem: str) -> None:
    # given a job with an input image its model cannot take (or a strength that runs nothing)
    image = digest(png_bytes(16, 16))
    raw = {**params, "image": image} | ({"mask": image} if params.get("mask") else {})
    # when it is validated, then the refusal says what is wrong
    with pytest.raises(ParamsError, match=problem):
        validate_params("image", raw)


def test_a_job_without_an_image_carries_no_input_fields() -> None:
    # given a plain text-to-image job, when it is validated
    params = validate_params("image", {"model": "pixart-tiny", "prompt": "x"})
    # then it has none of the input fields (stored jobs and their plans are as before)
    assert not {"image", "mask", "strength"} & set(params)


def test_an_edit_model_refuses_a_job_without_an_image_and_says_to_pass_one() -> None:
    # given a job on the edit model with no input image, when it is validated
    # then it is refused: an edit model makes nothing without the image it edits
    with pytest.raises(ParamsError, match=r"edit model.*pass image"):
        validate_params("image", {"model": "flux-kontext-tiny", "prompt": "make it dusk"})


def edit_params(image: bytes, seed: int = 11) -> dict[str, Any]:
    params = validate_params("image", {
        "model": "flux-kontext-tiny", "prompt": "make it dusk", "height": 32, "width": 48,
        "num_inference_steps": 3, "seed": seed, "image": digest(image)})
    return {**params, INPUT_BYTES: {"image": image}}


def test_an_edit_job_runs_every_step_checkpoints_its_image_latents_and_sees_the_image() -> None:
    # given two edit jobs alike but for their input image
    outputs = []
    for seed in (1, 2):
        params = edit_params(png_bytes(48, 32, seed))
        # when each runs chunk by chunk, preempted and moved between workers
        state, runner = run_preempted_job(params, random.Random(seed))
        # then it ran every step (no strength), its checkpoint carries the packed image latents
        # (one token per 2x2 latent cell, beside the noise's), and the image shaped its pixels
        assert runner.evaluations(params) == 3 and "strength" not in params
        assert state.tensors["cond.image_latents"].shape == state.tensors["latents"].shape
        outputs.append(runner.decode_pixels(params, state))
    assert not torch.equal(*outputs)
