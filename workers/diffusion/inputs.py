"""What an image or video job may take besides its condition, torch-free: the API checks
these (``validate_params``) and lists them (``/v1/models``) without loading a model. The
arithmetic that uses an input image is :mod:`workers.diffusion.conditioning`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.errors import ParamsError

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""How a job names an input: the SHA-256 of its bytes (the artifact store keeps it by that)."""

IMAGE_FAMILIES = frozenset({"pixart", "flux", "sd3", "qwen_image"})
"""Families whose jobs may start from an input image (image-to-image): PixArt (its VAE latents
denoised as they are, ``StableDiffusionImg2ImgPipeline``'s arithmetic) and the
:data:`FLOW_IMAGE_FAMILIES`. An edit model (:data:`EDIT_FAMILIES`) and an image-to-video model
(:data:`FIRST_FRAME_FAMILIES`) take an image too, as a condition rather than a start."""
EDIT_FAMILIES = frozenset({"flux_kontext"})
"""Edit models (``FluxKontextPipeline``): every job requires an input image, which conditions
each step (its latents beside the noise) rather than being noised; so no ``strength``."""
FLOW_IMAGE_FAMILIES = frozenset({"flux", "sd3", "qwen_image"})
"""Families with a flow-matching img2img pipeline of their own (``FluxImg2ImgPipeline``,
``StableDiffusion3Img2ImgPipeline``, ``QwenImageImg2ImgPipeline``): the image latents shifted by
the VAE's ``shift_factor`` (Qwen-Image's normalised by its ``latents_mean`` and ``latents_std``),
noised by the scheduler's ``scale_noise`` (so only :data:`NOISE_SCALING_SCHEDULERS` run it),
and the timesteps cut by ``int(steps - steps * strength)`` (the product not floored first)."""
NOISE_SCALING_SCHEDULERS = frozenset({"FlowMatchEulerDiscreteScheduler",
                                      "FlowMatchHeunDiscreteScheduler", "FlowMatchLCMScheduler"})
"""Scheduler classes with the ``scale_noise`` a flow-matching img2img pipeline calls."""
MASK_FAMILIES = frozenset({"flux", "sd3", "qwen_image"})
"""Families that inpaint with a ``mask`` of their input image, as their inpaint pipelines do
(``FluxInpaintPipeline``, ``StableDiffusion3InpaintPipeline``, ``QwenImageInpaintPipeline``; see
:mod:`workers.diffusion.inpainting`); a job with a mask on any other model is refused."""
FIRST_FRAME_FAMILIES = frozenset({"wan22_i2v"})
"""Video families whose every job takes an input image as its first frame (image-to-video,
``WanImageToVideoPipeline``): a condition beside the noise, not a start to noise, so no
``strength``."""
INPUT_BYTES = "input_bytes"
"""The parameter under which a worker hands a job's chunk the bytes of its inputs (role →
bytes), read from the artifact store by digest; never stored with the job."""
DEFAULT_STRENGTH = 0.8
"""``StableDiffusionImg2ImgPipeline``'s default strength."""


def accepted_inputs(family: str, conditioning: str) -> list[str]:
    """What a model of ``family`` takes: its condition (``text`` or ``class``), then ``image``
    and ``mask`` where it takes them (``/v1/models`` lists these; see :func:`required_inputs`)."""
    inputs = [conditioning]
    if family in IMAGE_FAMILIES | EDIT_FAMILIES | FIRST_FRAME_FAMILIES:
        inputs.append("image")
    if family in MASK_FAMILIES:
        inputs.append("mask")
    return inputs


def required_inputs(family: str, conditioning: str) -> list[str]:
    """Those of :func:`accepted_inputs` every job of a ``family`` model must carry: its
    condition, and the input image of an edit model or an image-to-video model
    (``/v1/models`` lists these as ``requires``)."""
    needs_image = family in EDIT_FAMILIES or family in FIRST_FRAME_FAMILIES
    return [conditioning, *(["image"] if needs_image else [])]


def is_conditioned(p: Mapping[str, Any]) -> bool:
    """The job starts from an input image (image-to-image: it carries the ``strength`` it runs
    at). An edit or image-to-video job's image is a condition beside pure noise (it has no
    strength): its job starts from noise, as a text-to-image or text-to-video job does."""
    return p.get("image") is not None and p.get("strength") is not None


def first_timestep(steps: int, strength: float, family: str) -> int:
    """``t_start`` of the family's img2img strength rule: the scheduler steps a job skips."""
    if family in FLOW_IMAGE_FAMILIES:
        return int(max(steps - min(steps * strength, steps), 0))
    init = min(int(steps * strength), steps)
    return max(steps - init, 0)


def check_strength(steps: int, strength: float, family: str) -> None:
    """A strength that leaves no step (``int(steps * strength) == 0``) is refused, naming the
    smallest that leaves one."""
    if first_timestep(steps, strength, family) >= steps:
        raise ParamsError(f"strength={strength:g} with num_inference_steps={steps} runs no step "
                          f"(int(steps * strength) is 0); use strength >= {1 / steps:g} or more "
                          "steps")


def check_image_sampler(family: str, scheduler: str, offered: Mapping[str, str]) -> None:
    """An image-to-image job of a :data:`FLOW_IMAGE_FAMILIES` model on a sampler without
    ``scale_noise`` is refused, naming the model's samplers that have it (``offered``: each
    sampler's scheduler class)."""
    if family not in FLOW_IMAGE_FAMILIES or offered[scheduler] in NOISE_SCALING_SCHEDULERS:
        return
    fitting = sorted(name for name, cls in offered.items() if cls in NOISE_SCALING_SCHEDULERS)
    raise ParamsError(f"scheduler {scheduler!r} ({offered[scheduler]}) has no scale_noise, which "
                      f"image-to-image on {family} noises the input image with; use one of "
                      f"{', '.join(fitting)}")
