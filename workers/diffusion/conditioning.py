"""Image-conditioned diffusion jobs (image-to-image), family-independent.

A job that carries an input ``image`` (by content digest, ``sha256:<hex>``) starts from that
image instead of pure noise, SDEdit-style, with the strength rule of diffusers'
``StableDiffusionImg2ImgPipeline``:

- ``init = min(int(steps * strength), steps)``, ``t_start = max(steps - init, 0)``: the job
  runs the last ``init`` of its scheduler's ``steps`` timesteps (``t_start * order`` skipped),
  and the scheduler's ``begin_index`` is set to the first one it runs;
- the image is resized to the job's size (``VaeImageProcessor.preprocess``, to [-1, 1]),
  encoded by the VAE and sampled from its latent distribution with the job's generator, scaled
  by the VAE's ``scaling_factor``, then noised to the first timestep it runs with noise drawn
  next from the same generator (``scheduler.add_noise``; a flow-matching scheduler's
  ``scale_noise``).

A flow-matching family (:data:`FLOW_IMAGE_FAMILIES`: Flux, SD3) follows its own img2img
pipeline instead: ``t_start = int(max(steps - steps * strength, 0))``, the image latents
``(sample - shift_factor) * scaling_factor`` (:func:`shifted_image_latents`) noised by the
scheduler's ``scale_noise`` (:func:`noised_to_start`); the family lays them out
(``image_latents`` on the family: Flux packs them).

An edit model (:data:`EDIT_FAMILIES`: Flux Kontext) takes its image as conditioning instead:
the job requires one, runs every step from pure noise, and its family encodes the image with
the prompt (``workers.diffusion.flux_kontext``).

Nothing here knows a family by name: a family starts from images when it is in
:data:`IMAGE_FAMILIES`, and the runner calls the family's ``image_latents``, or where it has
none :func:`image_latents`, for a conditioned job's initial latents.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.inputs import (
    FLOW_IMAGE_FAMILIES,
    INPUT_BYTES,
    first_timestep,
    is_conditioned,
)
from workers.errors import ParamsError


def skipped(p: Mapping[str, Any], order: int, family: str) -> int:
    """Timesteps (model evaluations) of the scheduler a job of ``family`` skips:
    ``t_start * order`` for an image-conditioned job, 0 otherwise (an edit model's job too:
    its image conditions every step and is not noised, so it has no strength)."""
    if not is_conditioned(p):
        return 0
    return first_timestep(int(p["num_inference_steps"]), float(p["strength"]), family) * order


def start_at(scheduler: Any, p: Mapping[str, Any], family: str) -> None:
    """Set the job's scheduler to begin where the job does, as the img2img pipeline does."""
    if is_conditioned(p) and hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(skipped(p, int(scheduler.order), family))


def first_timestep_of(scheduler: Any, p: Mapping[str, Any], family: str) -> torch.Tensor:
    """The timestep the job's first step runs, as a one-element tensor (the pipeline's
    ``latent_timestep``)."""
    start: torch.Tensor = scheduler.timesteps[skipped(p, int(scheduler.order), family):][:1]
    return start


def input_bytes(p: Mapping[str, Any], role: str) -> bytes:
    """The bytes of input ``role`` the worker handed this chunk (:data:`INPUT_BYTES`)."""
    held = p.get(INPUT_BYTES) or {}
    data = held.get(role)
    if not isinstance(data, bytes):
        raise ParamsError(f"input {role} ({p.get(role)}) was not read for this chunk; the "
                          "worker reads it from the artifact store by its digest")
    return data


def image_pixels(c: DiffusionComponents, p: Mapping[str, Any], multiple: int | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The input image at the job's size as the VAE takes it: (1, 3, H, W) in [-1, 1], its
    size rounded down to a ``multiple`` of pixels (default: the VAE's scale factor), in
    ``dtype`` (default: the VAE's)."""
    with Image.open(io.BytesIO(input_bytes(p, "image"))) as opened:
        image = opened.convert("RGB")
    processor = VaeImageProcessor(vae_scale_factor=multiple or c.recipe.vae_scale_factor)
    pixels: torch.Tensor = processor.preprocess(image, height=int(p["height"]),
                                                width=int(p["width"]))
    return pixels.to(dtype=torch.float32).to(device=c.device, dtype=dtype or c.vae.dtype)


def shifted_image_latents(c: DiffusionComponents, p: Mapping[str, Any],
                          gen: torch.Generator | None, multiple: int, dtype: torch.dtype
                          ) -> torch.Tensor:
    """The input image's VAE latents as a flow-matching img2img pipeline takes them: sampled
    with the job's generator, ``(sample - shift_factor) * scaling_factor``; with no generator
    the distribution's mode (an edit pipeline's ``sample_mode="argmax"``)."""
    dist = c.vae.encode(image_pixels(c, p, multiple, dtype)).latent_dist
    sample = dist.sample(gen) if gen is not None else dist.mode()
    cfg = c.vae.config
    latents: torch.Tensor = (sample - cfg.shift_factor) * cfg.scaling_factor
    return torch.cat([latents], dim=0)


def noised_to_start(scheduler: Any, p: Mapping[str, Any], family: str, latents: torch.Tensor,
                    noise: torch.Tensor) -> torch.Tensor:
    """``latents`` noised to the job's first timestep by the scheduler's ``scale_noise``."""
    noised: torch.Tensor = scheduler.scale_noise(latents, first_timestep_of(scheduler, p, family),
                                                 noise)
    return noised


def image_latents(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                  gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """The initial latents of an image-conditioned job: the image's VAE latents noised to the
    first timestep the job runs (``StableDiffusionImg2ImgPipeline.prepare_latents``)."""
    encoded = c.vae.encode(image_pixels(c, p)).latent_dist.sample(gen)
    latents = (c.vae.config.scaling_factor * encoded).to(dtype)
    latents = torch.cat([latents], dim=0)
    noise = randn_tensor(latents.shape, generator=gen, device=c.device, dtype=dtype)
    t = first_timestep_of(scheduler, p, c.recipe.family)
    if hasattr(scheduler, "add_noise"):
        noised: torch.Tensor = scheduler.add_noise(latents, noise, t)
    else:
        noised = scheduler.scale_noise(latents, t, noise)
    return noised


def pipeline_layout(p: Mapping[str, Any], latents: torch.Tensor, family: str) -> torch.Tensor:
    """``latents`` of a job of ``family`` in the memory layout the img2img pipeline's own
    latents have at its decode.

    The VAE's latent sample comes out channels-last, and every step's arithmetic keeps that
    layout, so the pipeline decodes channels-last latents; a checkpoint stores them contiguous,
    and the VAE's convolutions round differently on the two layouts. An unconditioned job's
    latents start contiguous (``randn_tensor``) and are left as they are, as are those of a
    :data:`FLOW_IMAGE_FAMILIES` job: ``scale_noise`` computes ``sigma * noise + ...``, so its
    latents take the contiguous noise's layout (Flux's are packed, 3-D, anyway)."""
    if not is_conditioned(p) or latents.ndim != 4 or family in FLOW_IMAGE_FAMILIES:
        return latents
    return latents.contiguous(memory_format=torch.channels_last)
