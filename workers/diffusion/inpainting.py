"""Inpainting (a job with an input ``image`` and a ``mask``), family-independent.

A :data:`~workers.diffusion.inputs.MASK_FAMILIES` job follows its family's inpaint pipeline
(``FluxInpaintPipeline``, ``StableDiffusion3InpaintPipeline``): it starts as the img2img job
of its image and strength does, and after every scheduler step keeps the unmasked region on the
image itself, noised to the next timestep by ``scale_noise`` with the job's initial noise::

    latents = (1 - mask) * scale_noise(image_latents, next_t, noise) + mask * latents

(the last step blends the clean ``image_latents``). So the image latents, the initial noise and
the mask latents (:class:`Inpaint`) are part of the job's state: a job resumed on another
worker blends with the very tensors the first one made, and a checkpoint carries them.

The mask is white (1) where the job repaints, as diffusers' is; a mask given by its alpha
channel (OpenAI's convention: transparent where the image is edited) is inverted first. The
pipeline resizes it to the job's size and binarizes it (``VaeImageProcessor`` with
``do_binarize``), and also VAE-encodes the masked image with the job's generator (its latents
feed only a fill model's input, but the draw advances the generator): both are done here alike.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image, ImageOps

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import image_pixels, input_bytes

Inpaint = dict[str, torch.Tensor]
"""An inpainting job's blend inputs, laid out as its latents are (Flux: packed): the clean image
latents (``image_latents``), the job's initial noise (``noise``) and the mask (``mask``)."""
INPAINT_KEYS = ("image_latents", "noise", "mask")


def is_masked(p: Mapping[str, Any]) -> bool:
    """The job inpaints: it carries a mask of its input image."""
    return p.get("mask") is not None


def mask_image(data: bytes) -> Image.Image:
    """The mask as a one-channel image, white where the job repaints: an ``L`` or ``1`` mask as
    it is, one with an alpha channel (``LA``, ``RGBA``) its alpha inverted (transparent is
    repainted)."""
    with Image.open(io.BytesIO(data)) as opened:
        opened.load()
        if "A" in opened.getbands():
            return ImageOps.invert(opened.getchannel("A"))
        return opened.convert("L")


def mask_condition(p: Mapping[str, Any], multiple: int) -> torch.Tensor:
    """The pipeline's ``mask_condition``: the mask at the job's size (rounded down to a
    ``multiple`` of pixels), (1, 1, H, W) of 0 and 1, float32."""
    processor = VaeImageProcessor(vae_scale_factor=multiple, do_normalize=False,
                                  do_binarize=True, do_convert_grayscale=True)
    mask: torch.Tensor = processor.preprocess(mask_image(input_bytes(p, "mask")),
                                              height=int(p["height"]), width=int(p["width"]))
    return mask


def encode_masked_image(c: DiffusionComponents, image: torch.Tensor, mask: torch.Tensor,
                        gen: torch.Generator, dtype: torch.dtype) -> None:
    """``prepare_mask_latents``' encode of the masked image (``image`` float32 in [-1, 1]): its
    latents serve only a fill transformer, which no mask family here has, but its sample draws
    from the job's generator, so the generator leaves the encode chunk where the pipeline's
    does."""
    masked = (image * (mask < 0.5)).to(device=c.device, dtype=dtype)
    c.vae.encode(masked).latent_dist.sample(gen)


def masked_condition(c: DiffusionComponents, p: Mapping[str, Any], multiple: int,
                     gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``prepare_mask_latents``' first half in every inpaint pipeline: the :func:`mask_condition`
    at a ``multiple`` of pixels, and the masked image encoded with the job's generator."""
    condition = mask_condition(p, multiple)
    encode_masked_image(c, image_pixels(c, p, multiple, torch.float32), condition, gen, dtype)
    return condition


def blend(scheduler: Any, inpaint: Inpaint, latents: torch.Tensor,
          next_t: torch.Tensor | None) -> torch.Tensor:
    """The inpaint pipeline's blend after a scheduler step: the unmasked region the image noised
    to ``next_t`` (None after the last step: the clean image), the masked one ``latents``."""
    proper = inpaint["image_latents"]
    if next_t is not None:
        proper = scheduler.scale_noise(proper, torch.tensor([next_t]), inpaint["noise"])
    mask = inpaint["mask"]
    blended: torch.Tensor = (1 - mask) * proper + mask * latents
    return blended
