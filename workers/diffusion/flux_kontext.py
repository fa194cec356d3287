"""Flux.1 Kontext (``FluxKontextPipeline``): an edit model. The input image's VAE latents (the
distribution's mode, shifted and scaled, packed like the noise) ride behind the noise tokens in
every forward, with their own image ids (the first id component 1, not 0); the transformer's
output is cut back to the noise tokens. Everything else is Flux's.

The image is resized to the job's size first, so a job of one size has one sequence length
(and batches with its like): the pipeline called with ``_auto_resize=False`` (its preferred
resolutions are the full-size model's) and ``max_area=height * width`` (which keeps the job's
size), on the image so resized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import FluxKontextPipeline

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import shifted_image_latents
from workers.diffusion.families import Tensors
from workers.diffusion.flow import PACK as _PACK
from workers.diffusion.flow import packed_hw as _packed_hw
from workers.diffusion.flux import FluxFamily


def _image_latents(c: DiffusionComponents, p: Mapping[str, Any]) -> torch.Tensor:
    """``prepare_latents``' packed image latents: its VAE encoding's mode (no draw from the
    generator), at the dtype of the prompt embeddings."""
    assert c.text_encoder_2 is not None  # the prompt embeddings' dtype
    latents = shifted_image_latents(c, p, None, c.recipe.vae_scale_factor * _PACK,
                                    c.text_encoder_2.dtype)
    _, channels, h, w = latents.shape
    packed: torch.Tensor = FluxKontextPipeline._pack_latents(
        latents, 1, channels, h, w)
    return packed


class FluxKontextFamily(FluxFamily):
    """Flux with the image latents in the conditioning (so a checkpoint carries them and a
    resume elsewhere reads the same), concatenated to each pass's noise tokens; its sigmas
    handed to a scheduler even in flow mode (the pipeline has no ``use_flow_sigmas`` case)."""

    sigmas_in_flow_mode = True

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        conds = super().encode_many(c, ps)
        return [{**cond, "image_latents": _image_latents(c, p)}
                for cond, p in zip(conds, ps, strict=True)]

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        inputs, sample = super().passes(c, p, scheduler, latents, t, cond)
        h, w = _packed_hw(c, p)
        image_ids = FluxKontextPipeline._prepare_latent_image_ids(
            1, h // _PACK, w // _PACK, c.device, cond["prompt_embeds"].dtype)
        image_ids[..., 0] = 1
        hidden = torch.cat([latents, cond["image_latents"]], dim=1)
        for x in inputs:
            x["hidden_states"] = hidden
            x["img_ids"] = torch.cat([x["img_ids"][0], image_ids], dim=0)[None]
        return inputs, sample

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        h, w = _packed_hw(c, p)
        tokens = (h // _PACK) * (w // _PACK)
        return super().combine(c, p, [x[:, :tokens] for x in outputs])
