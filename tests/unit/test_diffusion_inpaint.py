"""An inpainting job (an input image and a mask), chunked, preempted and migrated, equals its
family's own inpaint pipeline (``FluxInpaintPipeline``, ``StableDiffusion3InpaintPipeline``,
called in ``diffusion_reference``) run in one go, bit for bit.

Generic over the models of :data:`MASK_FAMILIES` in the exactness suite's ``JOBS`` and every
sampler of theirs that image-to-image takes (those with ``scale_noise``). A sampler whose step
draws noise is compared only with itself uninterrupted: the pipeline hands its step no
generator, so it draws from the process-wide RNG.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.unit.diffusion_reference import reference_run
from tests.unit.test_diffusion_batching import _batched_until_done, _relative_error, _run_alone
from tests.unit.test_diffusion_exactness import JOBS, run_preempted_job, run_uninterrupted_job
from tests.unit.test_diffusion_img2img import digest, png_bytes
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.inputs import INPUT_BYTES, MASK_FAMILIES, NOISE_SCALING_SCHEDULERS
from workers.diffusion.recipes import diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.state import INPAINT_STATE_VERSION

pytestmark = pytest.mark.timeout(300)

STEPS = 6
STRENGTH = 0.7


DRAWING_SCHEDULERS = frozenset({"FlowMatchLCMScheduler"})
"""Noise-scaling schedulers whose step draws noise as configured here (an LCM step re-noises
its prediction; Euler and Heun draw only with stochastic sampling or ``s_churn``, off)."""


CASES = [(model, name, spec.class_name in DRAWING_SCHEDULERS)
         for model in JOBS if diffusion_recipe(model).family in MASK_FAMILIES
         for name, spec in sorted(diffusion_recipe(model).schedulers.items())
         if spec.class_name in NOISE_SCALING_SCHEDULERS]
"""Each mask family model × each sampler it inpaints with, and whether that sampler's step
draws noise."""


def mask_bytes(width: int, height: int, mode: str = "L") -> bytes:
    """A mask repainting a rectangle (white) and keeping the rest (black); with ``mode`` RGBA
    the same mask by its alpha, OpenAI's way (transparent: repainted)."""
    keep = np.zeros((height, width), dtype=np.uint8)
    keep[height // 4: 3 * height // 4, width // 3: width] = 255
    out = io.BytesIO()
    if mode == "RGBA":
        rgba = np.full((height, width, 4), 200, dtype=np.uint8)
        rgba[..., 3] = 255 - keep
        Image.fromarray(rgba, mode="RGBA").save(out, format="PNG")
    else:
        Image.fromarray(keep, mode="L").save(out, format="PNG")
    return out.getvalue()


def inpaint_params(model: str, scheduler: str, image: bytes, mask: bytes | None,
                   seed: int = 11) -> dict[str, Any]:
    _, extra, _ = JOBS[model]
    raw = {**extra, "model": model, "num_inference_steps": STEPS, "scheduler": scheduler,
           "seed": seed, "image": digest(image), "strength": STRENGTH}
    held = {"image": image}
    if mask is not None:
        raw["mask"], held["mask"] = digest(mask), mask
    return {**validate_params("image", raw), INPUT_BYTES: held}


@pytest.mark.parametrize(("model", "scheduler", "draws"), CASES)
def test_an_uninterrupted_inpaint_job_equals_the_librarys_inpaint_pipeline(
        model: str, scheduler: str, draws: bool) -> None:
    if draws:
        pytest.skip(f"{scheduler}'s step draws noise the pipeline takes from the global RNG")
    # given an inpainting job: an input image of another size than the job's, and its mask
    image, mask = png_bytes(40, 24), mask_bytes(40, 24)
    params = inpaint_params(model, scheduler, image, mask)
    # when it runs in one go
    state, runner = run_uninterrupted_job(params)
    pixels = runner.decode_pixels(params, state)
    # then its latents and pixels equal the library's inpaint pipeline's, bit for bit
    ref = reference_run(runner.components(params), params)
    assert torch.equal(state.tensors["latents"], ref.latents)
    assert torch.equal(pixels, ref.pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


@pytest.mark.parametrize(("model", "scheduler", "draws"), CASES)
def test_a_preempted_migrated_inpaint_job_equals_it_uninterrupted(
        model: str, scheduler: str, draws: bool) -> None:
    # given an inpainting job
    image, mask = png_bytes(40, 24), mask_bytes(40, 24)
    params = inpaint_params(model, scheduler, image, mask)
    # when it runs chunk by chunk through checkpoint bytes, preempted inside a step, crashed
    # once and moved between workers, and again in one go
    state, runner = run_preempted_job(params, random.Random(model + scheduler), crash_chunk=2)
    whole, _ = run_uninterrupted_job(params)
    # then every checkpoint carried the blend inputs, and both runs end bit-identical
    assert state.meta["version"] == INPAINT_STATE_VERSION
    assert torch.equal(state.tensors["latents"], whole.tensors["latents"])
    assert torch.equal(runner.decode_pixels(params, state), runner.decode_pixels(params, whole))


def test_the_mask_changes_the_output_and_an_alpha_mask_is_its_inverse() -> None:
    # given img2img, an L mask and the same mask by its alpha channel, on one image and seed
    model, scheduler = CASES[0][:2]
    image = png_bytes(40, 24)
    outputs = []
    for mask in (None, mask_bytes(40, 24), mask_bytes(40, 24, "RGBA")):
        params = inpaint_params(model, scheduler, image, mask)
        # when each runs to the end
        state, runner = run_uninterrupted_job(params)
        outputs.append(runner.decode_pixels(params, state))
    # then the mask changed the output, and the alpha mask (transparent: repaint) equals the L one
    assert not torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[1], outputs[2])


def test_a_checkpoint_of_an_inpaint_job_holds_its_blend_inputs_by_name() -> None:
    # given an inpainting job's encode chunk
    model, scheduler = CASES[0][:2]
    params = inpaint_params(model, scheduler, png_bytes(40, 24), mask_bytes(40, 24))
    state = get_runner("image").run_chunk(params, 0, None, lambda: False).state
    # when its checkpoint goes through bytes (the no-pickle codec)
    decoded = Checkpoint.decode(state.encode())
    # then it names the image latents and the noise (of the latents' shape) and the mask (of
    # zeros and ones)
    assert decoded.meta["inpaint_keys"] == ["image_latents", "mask", "noise"]
    for key in ("image_latents", "noise"):
        assert decoded.tensors[f"inpaint.{key}"].shape == decoded.tensors["latents"].shape
    assert decoded.tensors["inpaint.mask"].unique().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("model", sorted({model for model, _, _ in CASES}))
def test_two_inpaint_jobs_batched_stay_close_to_their_alone_runs(model: str) -> None:
    # given two inpainting jobs of one model and shape, other seeds and masks
    scheduler = next(s for m, s, draws in CASES if m == model and not draws)
    runner = DiffusionRunner("image")
    image = png_bytes(40, 24)
    params = [inpaint_params(model, scheduler, image, mask_bytes(40, 24), seed=5),
              inpaint_params(model, scheduler, png_bytes(40, 24, 9), mask_bytes(40, 24), seed=6)]
    encoded = [_run_alone(runner, p, None, 0, 1) for p in params]
    assert all(s is not None for s in encoded)
    # when their denoise chunks run batched, and separately alone
    batched, results = _batched_until_done(runner, [(p, 1) for p in params],
                                           [s for s in encoded if s is not None])
    alone = [_run_alone(runner, p, s, 1, runner.evaluations(p) + 1)
             for p, s in zip(params, encoded, strict=True)]
    # then they shared forwards, and each ends within float32 noise of its alone run
    assert {r.metrics["batch_size"] for r in results} == {2}
    for b, a in zip(batched, alone, strict=True):
        assert a is not None and b.meta["next_chunk"] == a.meta["next_chunk"]
        assert _relative_error(b, a) < 1e-4
