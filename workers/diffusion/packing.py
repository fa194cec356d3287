"""Qwen-Image's view of the 2x2 packing in ``flow.py``: its causal VAE's latents carry a frame
axis, (1, 1, C, H, W), which ``QwenImagePipeline._pack_latents`` (the same function as Flux's)
folds away; and its inpaint pipeline's ``prepare_mask_latents``, which encodes the masked image
before it packs the mask."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.diffusion import flow
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.flow import PACK, packed_hw
from workers.diffusion.flow import packed_channels as latent_channels
from workers.diffusion.inpainting import encode_masked_image, mask_condition

__all__ = ["PACK", "latent_channels", "pack", "packed_hw", "packed_mask"]


def pack(x: torch.Tensor) -> torch.Tensor:
    """``_pack_latents`` of one job's (1, C, H, W) or one-frame (1, 1, C, H, W) tensor."""
    return flow.pack(x.reshape(1, *x.shape[-3:]))


def packed_mask(c: DiffusionComponents, p: Mapping[str, Any], pixels: torch.Tensor,
                gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``prepare_mask_latents``: the masked ``pixels`` (the input image, float32, as the
    family's VAE takes it) encoded with the job's generator, then the mask packed as Flux's."""
    condition = mask_condition(p, c.recipe.vae_scale_factor * PACK)
    encode_masked_image(c, pixels, condition, gen, dtype)
    return flow.packed_mask(c, p, condition, dtype)
