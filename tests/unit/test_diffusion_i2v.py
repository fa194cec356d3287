"""Wan 2.2 image-to-video: the first frame is required and validated by name, its condition is
made once by the encode chunk and carried by the checkpoint, so no later chunk needs the image.

Bit-exactness against ``WanImageToVideoPipeline`` (uninterrupted, and preempted inside the first
low-noise step with the last high-noise one crashed) is in ``test_diffusion_exactness.py``, every
sampler in ``test_diffusion_samplers.py``, the ``save_pretrained`` round trip in
``test_diffusion_registry.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.diffusion_reference import (
    INPUT_IMAGE_DIGEST,
    reference_run,
    with_inputs,
)
from tests.unit.test_diffusion_img2img import digest, png_bytes
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.components import clear_component_cache
from workers.diffusion.inputs import INPUT_BYTES, accepted_inputs, required_inputs
from workers.diffusion.wan22_i2v import CONDITION
from workers.errors import ParamsError
from workers.warm import warm_jobs

pytestmark = pytest.mark.timeout(180)

MODEL = "wan22-i2v-tiny"
JOB = {"model": MODEL, "prompt": "a kite over dunes", "negative_prompt": "static",
       "num_frames": 5, "height": 16, "width": 32, "num_inference_steps": 4, "seed": 9,
       "guidance_scale_2": 2.0}


def _params(image: str = INPUT_IMAGE_DIGEST, **extra: Any) -> dict[str, Any]:
    return with_inputs(validate_params("video", {**JOB, "image": image, **extra}))


def test_the_first_frames_condition_is_made_by_the_encode_chunk_and_kept_in_the_checkpoint(
) -> None:
    # given an image-to-video job whose encode chunk ran with the image's bytes
    params = _params()
    runner = get_runner("video", block_groups=2)
    state = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    # then its checkpoint holds the condition: mask (1 on the first frame's 4 channels) and
    # image latents, at the noise's latent grid, beside noise of the VAE's z_dim channels
    condition, noise = state.tensors[f"cond.{CONDITION}"], state.tensors["latents"]
    assert condition.shape == (1, 4 + 16, 2, 2, 4) and noise.shape == (1, 16, 2, 2, 4)
    assert torch.equal(condition[:, :4, 0], torch.ones(1, 4, 2, 4))
    assert not condition[:, :4, 1:].any()
    # when every later chunk runs on a fresh worker that was handed no input bytes
    without = {k: v for k, v in params.items() if k != INPUT_BYTES}
    for index in range(1, runner.evaluations(params) + 1):
        clear_component_cache()
        runner = get_runner("video", block_groups=2)
        result = runner.run_chunk(without, index, state, lambda: False)
        state = Checkpoint.decode(result.state.encode())
    # then the video is the library pipeline's, bit for bit: the condition came from the state
    pixels = runner.decode_pixels(without, state)
    ref = reference_run(runner.components(params), params)
    assert torch.equal(state.tensors["latents"], ref.latents)
    assert torch.equal(pixels, ref.pixels) and pixels.std() > 0


def test_another_first_frame_gives_another_condition() -> None:
    # given two jobs alike but for their first frame
    runner = get_runner("video")
    other = png_bytes(40, 24, seed=8)
    jobs = [_params(), {**_params(digest(other)), INPUT_BYTES: {"image": other}}]
    # when their encode chunks run, then their image latents differ and their masks do not
    conds = [runner.run_chunk(p, 0, None, lambda: False).state.tensors[f"cond.{CONDITION}"]
             for p in jobs]
    assert torch.equal(conds[0][:, :4], conds[1][:, :4])
    assert not torch.equal(conds[0][:, 4:], conds[1][:, 4:])


@pytest.mark.parametrize(("raw", "problem"), [
    ({"model": MODEL, "prompt": "x"}, "makes video from an input image.*pass image"),
    ({"model": MODEL, "prompt": "x", "image": INPUT_IMAGE_DIGEST, "strength": 0.5},
     "first frame: it takes no mask and no strength"),
    ({"model": MODEL, "prompt": "x", "image": INPUT_IMAGE_DIGEST, "mask": INPUT_IMAGE_DIGEST},
     "takes no mask and no strength"),
    ({"model": "wan22-tiny", "prompt": "x", "image": INPUT_IMAGE_DIGEST},
     "takes no input image .*wan22_i2v \\(image-to-video\\)"),
    ({"model": MODEL, "prompt": "x", "image": "a.png"}, "image: String should match"),
])
def test_an_image_to_video_job_is_refused_naming_what_is_wrong(raw: dict[str, Any],
                                                               problem: str) -> None:
    # given a video job whose image is missing, misused or sent to a text-to-video model
    # when it is validated, then the refusal says what is wrong
    with pytest.raises(ParamsError, match=problem):
        validate_params("video", raw)


def test_a_video_job_with_an_image_and_no_model_goes_to_the_image_to_video_model() -> None:
    # given video jobs without a model, with and without an image
    with_image = validate_params("video", {"prompt": "x", "image": INPUT_IMAGE_DIGEST})
    plain = validate_params("video", {"prompt": "x"})
    # then the one with an image runs on the model that takes a first frame, and it keeps the
    # image (no strength: it is not image-to-image); the other on the default text-to-video one
    assert with_image["model"] == MODEL and with_image["image"] == INPUT_IMAGE_DIGEST
    assert "strength" not in with_image
    assert plain["model"] == "wan-tiny" and "image" not in plain


def test_models_list_the_first_frame_as_accepted_and_required_and_warm_up_sends_one() -> None:
    # when the inputs of each family are listed (GET /v1/models), then image-to-video accepts
    # and requires an image; image-to-image accepts it only; text-to-video takes none
    assert accepted_inputs("wan22_i2v", "text") == required_inputs("wan22_i2v", "text") \
        == ["text", "image"]
    assert accepted_inputs("pixart", "text") == ["text", "image"]
    assert required_inputs("pixart", "text") == accepted_inputs("wan22", "text") == ["text"]
    # and the worker's warm-up job of the model carries a first frame and its bytes
    warm = {job.recipe: job for job in warm_jobs()}[MODEL]
    assert warm.params["image"] == digest(warm.inputs["image"])
    assert warm.chunk_params[INPUT_BYTES] == warm.inputs
