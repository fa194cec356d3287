"""Wan 2.2 (A14B): ``WanPipeline`` with two expert transformers switched at a boundary timestep.

Everything but the expert and its guidance is Wan 2.1's arithmetic (:class:`WanFamily`): the
same prompt encoding, noise, passes, scheduler step and decode. The pipeline picks the model of
each step from its timestep alone (``t >= boundary_ratio * num_train_timesteps``: the
high-noise ``transformer``), so a step resumed from a checkpoint, anywhere, picks the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.families import WanFamily, uses_cfg
from workers.diffusion.recipes import DiffusionRecipe

HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"
"""The two experts by their diffusers component names."""


def boundary_timestep(recipe: DiffusionRecipe, scheduler: Any) -> float:
    """``boundary_ratio * num_train_timesteps``, as the pipeline computes it."""
    assert recipe.boundary_ratio is not None
    trained: int = scheduler.config.num_train_timesteps
    return recipe.boundary_ratio * trained


class Wan22Family(WanFamily):
    """``WanPipeline(transformer=..., transformer_2=..., boundary_ratio=...)``: a step at or above
    the boundary runs ``transformer`` under ``guidance_scale``, a step below ``transformer_2``
    under ``guidance_scale_2``. Whether CFG runs at all is ``guidance_scale > 1`` for every step
    (the pipeline's ``do_classifier_free_guidance``), whatever ``guidance_scale_2`` is."""

    def expert(self, recipe: Any, scheduler: Any, t: torch.Tensor) -> str:
        return HIGH_NOISE if bool(t >= boundary_timestep(recipe, scheduler)) else LOW_NOISE

    def step_params(self, recipe: Any, p: Mapping[str, Any], scheduler: Any, t: torch.Tensor
                    ) -> Mapping[str, Any]:
        low = self.expert(recipe, scheduler, t) == LOW_NOISE
        return {**p, "step_guidance_scale": p["guidance_scale_2" if low else "guidance_scale"]}

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        if not uses_cfg(p):
            return outputs[0]
        noise, uncond = outputs
        return uncond + float(p["step_guidance_scale"]) * (noise - uncond)
