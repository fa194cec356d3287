"""Flow matching as the Flux line of diffusers pipelines sets it up, shared by the families that
follow it (Flux.1 and Kontext, Flux.2 [klein], Qwen-Image, Z-Image).

Their timesteps are ``retrieve_timesteps`` of sigmas ``linspace(1, 1/N, N)`` shifted by ``mu``,
which grows with the image's tokens (``calculate_shift``, the same copy in each pipeline); their
VAE input undoes the latents' ``scaling_factor`` and ``shift_factor``. FluxPipeline, its img2img
and inpaint pipelines, Kontext and Qwen-Image pack the latents in 2x2 patches (``_pack_latents``,
a copy of one function in each): the noise, the noised image, the image latents and the mask
alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import (
    FluxPipeline,
    calculate_shift,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import noised_to_start
from workers.diffusion.families import PixArtFamily

PACK = 2
"""Latent cells per packed token, each way (FluxPipeline's ``_pack_latents``)."""


def true_cfg(p: Mapping[str, Any]) -> bool:
    """FluxPipeline's and QwenImagePipeline's ``do_true_cfg``: a negative pass above a
    ``true_cfg_scale`` of 1."""
    return float(p.get("true_cfg_scale", 1.0)) > 1.0


def packed_hw(c: DiffusionComponents, p: Mapping[str, Any]) -> tuple[int, int]:
    """The latent grid as ``prepare_latents`` rounds it (even, for the 2x2 packing)."""
    cell = c.recipe.vae_scale_factor * PACK
    return PACK * (int(p["height"]) // cell), PACK * (int(p["width"]) // cell)


def packed_channels(c: DiffusionComponents) -> int:
    """The latents' channels before packing: the transformer's input is four of them per token."""
    return int(c.transformer.config.in_channels) // (PACK * PACK)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``_pack_latents`` of (B, C, H, W) latents: (B, H/2 · W/2, 4C) tokens."""
    batch, channels, h, w = latents.shape
    packed: torch.Tensor = FluxPipeline._pack_latents(  # type: ignore[no-untyped-call]
        latents, batch, channels, h, w)
    return packed


def unpack(c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor) -> torch.Tensor:
    """``_unpack_latents``: packed tokens back to the job's (B, C, H, W) latent grid."""
    unpacked: torch.Tensor = FluxPipeline._unpack_latents(  # type: ignore[no-untyped-call]
        latents, p["height"], p["width"], c.recipe.vae_scale_factor)
    return unpacked


def packed_image_ids(c: DiffusionComponents, p: Mapping[str, Any], dtype: torch.dtype
                     ) -> torch.Tensor:
    """``_prepare_latent_image_ids`` of the job's token grid: (tokens, 3) positions."""
    h, w = packed_hw(c, p)
    ids: torch.Tensor = FluxPipeline._prepare_latent_image_ids(  # type: ignore[no-untyped-call]
        1, h // PACK, w // PACK, c.device, dtype)
    return ids


def packed_noise(c: DiffusionComponents, p: Mapping[str, Any], gen: torch.Generator,
                 dtype: torch.dtype) -> torch.Tensor:
    """``prepare_latents``' noise, drawn on the unpacked (1, C, H, W) grid."""
    shape = (1, packed_channels(c), *packed_hw(c, p))
    noise: torch.Tensor = randn_tensor(shape, generator=gen, device=c.device, dtype=dtype)
    return noise


def packed_noised(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                  gen: torch.Generator, image: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An img2img or inpaint pipeline's ``prepare_latents`` after its image encode: noise drawn
    next, the image latents noised by ``scale_noise`` to the job's first timestep; the noised
    latents, image latents and noise, each packed."""
    noise = packed_noise(c, p, gen, dtype)
    noised = noised_to_start(scheduler, p, c.recipe.family, image, noise)
    return pack(noised), pack(image), pack(noise)


def packed_mask(c: DiffusionComponents, p: Mapping[str, Any], condition: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``prepare_mask_latents``' mask: the pixel mask resized to the latent grid, repeated over
    the latent channels and packed like the latents it blends."""
    mask = torch.nn.functional.interpolate(condition, size=packed_hw(c, p)).to(c.device, dtype)
    return pack(mask.repeat(1, packed_channels(c), 1, 1))


def shift_mu(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any) -> float:
    """``calculate_shift`` of the job's packed image tokens under the scheduler's config (or the
    pipeline's defaults): the dynamic shift ``mu`` of FluxPipeline, QwenImagePipeline and
    ZImagePipeline alike."""
    h, w = packed_hw(c, p)
    keys = (("base_image_seq_len", 256), ("max_image_seq_len", 4096), ("base_shift", 0.5),
            ("max_shift", 1.15))
    mu: float = calculate_shift((h // PACK) * (w // PACK),
                                *(scheduler.config.get(k, v) for k, v in keys))
    return mu


def unshifted(c: DiffusionComponents, latents: torch.Tensor) -> torch.Tensor:
    """The latents as the VAE decodes them: ``scaling_factor`` and ``shift_factor`` undone."""
    cfg = c.vae.config
    out: torch.Tensor = (latents / cfg.scaling_factor) + cfg.shift_factor
    return out


class FlowMatchFamily(PixArtFamily):
    """PixArt's scheduler step, VAE decode and postprocess under a flow-matching pipeline's
    timesteps: sigmas and ``mu`` for the job's image size (so the runner sets them per size)."""

    sigmas_in_flow_mode = False
    """Whether the pipeline hands its sigmas to a scheduler in flow mode (``use_flow_sigmas``):
    FluxPipeline leaves them out, QwenImagePipeline passes them."""

    def sigmas(self, scheduler: Any, steps: int) -> Any:
        """The sigmas the pipeline hands ``retrieve_timesteps`` (None: the scheduler's own)."""
        flow_mode = scheduler.config.get("use_flow_sigmas") and not self.sigmas_in_flow_mode
        return None if flow_mode else np.linspace(1.0, 1 / steps, steps)

    def mu(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, steps: int
           ) -> float:
        """The dynamic shift of the job's timesteps: :func:`shift_mu` (Flux.2 reads it off
        the step count too)."""
        return shift_mu(c, p, scheduler)

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        size = {"height": c.recipe.default_height, "width": c.recipe.default_width}
        self.set_job_timesteps(c, size, scheduler, steps)

    def set_job_timesteps(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                          steps: int) -> None:
        """The pipeline's sigmas and ``mu`` for the job's image size (its packed tokens)."""
        retrieve_timesteps(scheduler, steps, c.device, sigmas=self.sigmas(scheduler, steps),
                           mu=self.mu(c, p, scheduler, steps))
        scheduler.set_begin_index(0)
