"""Latents packed in 2x2 patches, as ``FluxPipeline`` and ``QwenImagePipeline`` pack them (their
``_pack_latents`` are one function), and what their inpaint pipelines' ``prepare_mask_latents``
do on that layout alike. Qwen-Image's family takes these; Flux.1's module still holds its own
copies (``_PACK``, ``_packed_hw`` and the same mask arithmetic in ``inpaint_latents``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers import FluxPipeline

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.inpainting import encode_masked_image, mask_condition

PACK = 2
"""Latent cells per packed token, each way."""


def packed_hw(c: DiffusionComponents, p: Mapping[str, Any]) -> tuple[int, int]:
    """The latent grid as ``prepare_latents`` rounds it (even, for the 2x2 packing)."""
    cell = c.recipe.vae_scale_factor * PACK
    return PACK * (int(p["height"]) // cell), PACK * (int(p["width"]) // cell)


def latent_channels(c: DiffusionComponents) -> int:
    """Channels of the unpacked latents: the transformer's input over a patch's cells."""
    return int(c.transformer.config.in_channels) // (PACK * PACK)


def pack(x: torch.Tensor) -> torch.Tensor:
    """``_pack_latents`` of one job's (1, C, H, W) or one-frame (1, 1, C, H, W) tensor."""
    packed: torch.Tensor = FluxPipeline._pack_latents(x, 1, *x.shape[-3:])
    return packed


def packed_mask(c: DiffusionComponents, p: Mapping[str, Any], pixels: torch.Tensor,
                gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``prepare_mask_latents``: the masked ``pixels`` (the input image, float32, as the
    family's VAE takes it) encoded with the job's generator, and the mask (at the packing's
    multiple) resized to the latent grid, its channels repeated, packed."""
    condition = mask_condition(p, c.recipe.vae_scale_factor * PACK)
    encode_masked_image(c, pixels, condition, gen, dtype)
    mask = torch.nn.functional.interpolate(condition, size=packed_hw(c, p)).to(c.device, dtype)
    return pack(mask.repeat(1, latent_channels(c), 1, 1))
