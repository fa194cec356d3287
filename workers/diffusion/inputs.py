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
CONTROL_FIELDS = frozenset({"controlnet", "control_image", "controlnet_conditioning_scale",
                            "control_guidance_start", "control_guidance_end"})
"""A ControlNet job's parameters (:mod:`workers.diffusion.sd3_controlnet`); a job without a
ControlNet carries none of them."""
DEFAULT_STRENGTH = 0.8
"""``StableDiffusionImg2ImgPipeline``'s default strength."""


def accepted_inputs(family: str, conditioning: str, controlnets: bool = False) -> list[str]:
    """What a model of ``family`` takes: its condition (``text`` or ``class``), then ``image``
    and ``mask`` where it takes them, and ``control_image`` where its recipe declares
    ControlNets (``/v1/models`` lists these; see :func:`required_inputs`)."""
    inputs = [conditioning]
    if family in IMAGE_FAMILIES | EDIT_FAMILIES | FIRST_FRAME_FAMILIES:
        inputs.append("image")
    if family in MASK_FAMILIES:
        inputs.append("mask")
    if controlnets:
        inputs.append("control_image")
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


def check_control(p: Mapping[str, Any], model: str, accepted: Mapping[str, Any],
                  other_inputs: bool) -> dict[str, Any]:
    """A job's ControlNet parameters (:data:`CONTROL_FIELDS` of ``p``) with their defaults, on
    a model whose recipe declares the ControlNets ``accepted`` (by name); none for a job
    without one. Refused: a control image on a model without ControlNets, a name not
    ``accepted``, a ControlNet without its image or the other way round, an empty guidance
    window, and one beside an input image or a step cache (``other_inputs``: the ControlNet
    pipeline has neither)."""
    given = {key: value for key, value in p.items() if value is not None}
    if not given:
        return {}
    names = ", ".join(sorted(accepted))
    if not accepted:
        raise ParamsError(f"model {model!r} has no ControlNets, so it takes no "
                          f"{' or '.join(sorted(given))}; leave them out, or use a model whose "
                          "/v1/models card lists controlnets")
    name, image = given.get("controlnet"), given.get("control_image")
    if name is None or image is None:
        raise ParamsError(f"a ControlNet job names its controlnet (one of {names}) and its "
                          "control_image; pass both")
    if name not in accepted:
        raise ParamsError(f"model {model!r} has no controlnet {name!r}; use one of {names}")
    start = float(given.get("control_guidance_start", 0.0))
    end = float(given.get("control_guidance_end", 1.0))
    if start >= end:
        raise ParamsError(f"control_guidance_start={start:g} is not before "
                          f"control_guidance_end={end:g}; the ControlNet would act on no step")
    if other_inputs:
        raise ParamsError("a ControlNet job starts from noise: it takes no image, mask, "
                          "strength or step_cache (StableDiffusion3ControlNetPipeline has none)")
    return {"controlnet": name, "control_image": image, "control_guidance_start": start,
            "control_guidance_end": end, "controlnet_conditioning_scale":
            float(given.get("controlnet_conditioning_scale", 1.0))}
