"""Wan 2.2 (A14B) image-to-video: ``WanImageToVideoPipeline`` with two experts, no image encoder.

Wan 2.2's arithmetic (:class:`Wan22Family`: experts switched at the boundary, their guidance)
with the pipeline's first-frame condition: the input image, followed by ``num_frames - 1`` black
frames, VAE-encoded (the latent distribution's mode: no draw from the job's generator), then
normalised by the VAE's ``latents_mean`` and ``latents_std``, behind a mask that is 1 on the
first frame's latent cells (``prepare_latents``, ``expand_timesteps`` False). Every forward
takes the noise and that condition concatenated along channels, so the transformer's
``in_channels`` is ``z_dim`` (noise) + ``temporal_scale_factor`` (mask) + ``z_dim``.

The condition is made once, by the encode chunk (the one chunk a worker reads the input's
bytes for), and travels in the job's conditioning tensors: through every checkpoint, so a job
preempted, migrated or crashed anywhere resumes on the very same tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import image_pixels
from workers.diffusion.families import Tensors, _latent_hw
from workers.diffusion.wan22 import Wan22Family

CONDITION = "condition"
"""The first-frame condition (mask channels, then image latents) among the job's cond tensors."""


def first_frame_condition(c: DiffusionComponents, p: Mapping[str, Any]) -> torch.Tensor:
    """``prepare_latents``' condition for one video: mask and normalised first-frame latents."""
    frames, scale = int(p["num_frames"]), c.recipe.temporal_scale_factor
    image = image_pixels(c, p, dtype=torch.float32).unsqueeze(2)
    video = torch.cat([image, image.new_zeros(1, 3, frames - 1, *image.shape[3:])], dim=2)
    encoded = c.vae.encode(video.to(c.device, dtype=c.vae.dtype)).latent_dist.mode()
    cfg = c.vae.config
    latents = encoded.repeat(1, 1, 1, 1, 1).to(c.device, dtype=torch.float32)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(c.device, torch.float32)
    std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(c.device,
                                                                           torch.float32)
    latents = (latents - mean) * std
    h, w = _latent_hw(c, p)
    mask = torch.ones(1, 1, frames, h, w)
    mask[:, :, list(range(1, frames))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=scale)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2).view(1, -1, scale, h, w)
    return torch.concat([mask.transpose(1, 2).to(latents.device), latents], dim=1)


class Wan22ImageToVideoFamily(Wan22Family):
    """``WanImageToVideoPipeline(transformer=..., transformer_2=..., boundary_ratio=...)``
    without an image encoder: Wan 2.2's steps on the noise with the first-frame condition."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        return {**super().encode(c, p), CONDITION: first_frame_condition(c, p)}

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        return [{**cond, CONDITION: first_frame_condition(c, p)}
                for cond, p in zip(super().encode_many(c, ps), ps, strict=True)]

    def noise_channels(self, c: DiffusionComponents) -> int:
        """The VAE's latent channels: the noise alone, not the condition beside it."""
        return int(c.vae.config.z_dim)

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        conditioned = torch.cat([latents, cond[CONDITION]], dim=1)
        inputs, _ = super().passes(c, p, scheduler, conditioned, t, cond)
        return inputs, latents
