"""Flux.1 (``FluxPipeline``): CLIP pooled and T5 prompt embeddings, latents packed in 2x2
patches, the distilled guidance scale as a transformer input, flow matching shifted by ``mu``
(which grows with the image's tokens), and true CFG as a second pass above ``true_cfg_scale`` 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from workers.diffusion.conditioning import image_pixels, noised_to_start, shifted_image_latents
from workers.diffusion.families import PixArtFamily, Tensors
from workers.diffusion.inpainting import Inpaint, encode_masked_image, mask_condition

_PACK = 2
"""Latent cells per packed token, each way (FluxPipeline's ``_pack_latents``)."""


def true_cfg(p: Mapping[str, Any]) -> bool:
    """FluxPipeline's ``do_true_cfg``: a negative pass above a ``true_cfg_scale`` of 1."""
    return float(p.get("true_cfg_scale", 1.0)) > 1.0


def _packed_hw(c: DiffusionComponents, p: Mapping[str, Any]) -> tuple[int, int]:
    """The latent grid as ``prepare_latents`` rounds it (even, for the 2x2 packing)."""
    cell = c.recipe.vae_scale_factor * _PACK
    return _PACK * (int(p["height"]) // cell), _PACK * (int(p["width"]) // cell)


def shift_mu(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any) -> float:
    """``calculate_shift`` of the job's packed image tokens under the scheduler's config (or the
    pipeline's defaults): the dynamic shift ``mu`` of FluxPipeline and QwenImagePipeline alike."""
    h, w = _packed_hw(c, p)
    keys = (("base_image_seq_len", 256), ("max_image_seq_len", 4096), ("base_shift", 0.5),
            ("max_shift", 1.15))
    mu: float = calculate_shift((h // _PACK) * (w // _PACK),
                                *(scheduler.config.get(k, v) for k, v in keys))
    return mu


class FluxFamily(PixArtFamily):
    """``FluxPipeline``; the scheduler step, VAE decode and postprocess are PixArt's."""

    sigmas_in_flow_mode = False
    """Whether the pipeline hands its sigmas to a scheduler in flow mode (``use_flow_sigmas``):
    FluxPipeline leaves them out, QwenImagePipeline passes them."""

    def _embed_both(self, c: DiffusionComponents, texts: list[str]) -> Tensors:
        assert c.tokenizer is not None and c.tokenizer_2 is not None
        assert c.text_encoder is not None and c.text_encoder_2 is not None
        clip = c.tokenizer(texts, padding="max_length", max_length=c.tokenizer.model_max_length,
                           truncation=True, return_tensors="pt")
        pooled = c.text_encoder(clip.input_ids.to(c.device), output_hidden_states=False
                                ).pooler_output.to(dtype=c.text_encoder.dtype, device=c.device)
        t5 = c.tokenizer_2(texts, padding="max_length", max_length=c.recipe.text_max_length,
                           truncation=True, return_tensors="pt")
        embeds = c.text_encoder_2(t5.input_ids.to(c.device), output_hidden_states=False)[0]
        embeds = embeds.to(dtype=c.text_encoder_2.dtype, device=c.device)
        ids = torch.zeros(embeds.shape[1], 3).to(device=c.device, dtype=c.text_encoder.dtype)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
                "text_ids": ids[None].expand(len(texts), -1, -1)}

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        return self.encode_many(c, [p])[0]

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        texts = [str(p["prompt"]) for p in ps] + [str(p["negative_prompt"]) for p in ps
                                                  if true_cfg(p)]
        rows = {text: row for row, text in enumerate(dict.fromkeys(texts))}
        embeds = self._embed_both(c, list(rows))
        conds = []
        for p in ps:
            cond = {k: v[[rows[str(p["prompt"])]]] for k, v in embeds.items()}
            if true_cfg(p):
                row = rows[str(p["negative_prompt"])]
                cond.update({f"negative_{k}": v[[row]] for k, v in embeds.items()})
            conds.append(cond)
        return conds

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        size = {"height": c.recipe.default_height, "width": c.recipe.default_width}
        self.set_job_timesteps(c, size, scheduler, steps)

    def set_job_timesteps(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                          steps: int) -> None:
        """The pipeline's sigmas and ``mu`` for the job's image size (its packed tokens)."""
        flow_mode = scheduler.config.get("use_flow_sigmas") and not self.sigmas_in_flow_mode
        sigmas = None if flow_mode else np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(scheduler, steps, c.device, sigmas=sigmas,  # type: ignore[arg-type]
                           mu=self.mu(c, p, scheduler, steps))
        scheduler.set_begin_index(0)

    def mu(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, steps: int
           ) -> float:
        """The dynamic shift of the job's timesteps: :func:`shift_mu` (Flux.2 reads it off
        the step count too)."""
        return shift_mu(c, p, scheduler)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        h, w = _packed_hw(c, p)
        channels = c.transformer.config.in_channels // (_PACK * _PACK)
        assert c.text_encoder_2 is not None  # the prompt embeddings' dtype
        noise = randn_tensor((1, channels, h, w), generator=gen, device=c.device,
                             dtype=c.text_encoder_2.dtype)
        packed: torch.Tensor = FluxPipeline._pack_latents(  # type: ignore[no-untyped-call]
            noise, 1, channels, h, w)
        return packed

    def image_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> torch.Tensor:
        """``FluxImg2ImgPipeline.prepare_latents``: the image (sized to the packing's multiple)
        encoded and shifted, noised by ``scale_noise`` with noise drawn next, then packed."""
        return self._noised_parts(c, p, scheduler, gen)[0]

    def _noised_parts(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed noised latents, image latents and noise of ``prepare_latents`` (the
        img2img and inpaint pipelines' alike)."""
        assert c.text_encoder_2 is not None  # the prompt embeddings' dtype
        dtype = c.text_encoder_2.dtype
        image = shifted_image_latents(c, p, gen, c.recipe.vae_scale_factor * _PACK, dtype)
        h, w = _packed_hw(c, p)
        channels = c.transformer.config.in_channels // (_PACK * _PACK)
        noise = randn_tensor((1, channels, h, w), generator=gen, device=c.device, dtype=dtype)
        noised = noised_to_start(scheduler, p, c.recipe.family, image, noise)
        pack = FluxPipeline._pack_latents
        return (pack(noised, 1, channels, h, w), pack(image, 1, channels, h, w),  # type: ignore[no-untyped-call]
                pack(noise, 1, channels, h, w))  # type: ignore[no-untyped-call]

    def inpaint_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                        gen: torch.Generator) -> tuple[torch.Tensor, Inpaint]:
        """``FluxInpaintPipeline``'s ``prepare_latents`` then ``prepare_mask_latents``: the
        mask (at the packing's multiple) resized to the latent grid, its channels repeated and
        packed; the masked image encoded with the generator."""
        latents, image, noise = self._noised_parts(c, p, scheduler, gen)
        assert c.text_encoder_2 is not None
        dtype, multiple = c.text_encoder_2.dtype, c.recipe.vae_scale_factor * _PACK
        condition = mask_condition(p, multiple)
        encode_masked_image(c, image_pixels(c, p, multiple, torch.float32), condition, gen, dtype)
        h, w = _packed_hw(c, p)
        channels = c.transformer.config.in_channels // (_PACK * _PACK)
        mask = torch.nn.functional.interpolate(condition, size=(h, w)).to(c.device, dtype)
        packed: torch.Tensor = FluxPipeline._pack_latents(  # type: ignore[no-untyped-call]
            mask.repeat(1, channels, 1, 1), 1, channels, h, w)
        return latents, {"image_latents": image, "noise": noise, "mask": packed}

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        h, w = _packed_hw(c, p)
        img_ids = FluxPipeline._prepare_latent_image_ids(  # type: ignore[no-untyped-call]
            1, h // _PACK, w // _PACK, c.device, cond["prompt_embeds"].dtype)
        shared = {"hidden_states": latents, "img_ids": img_ids[None],
                  "timestep": t.expand(latents.shape[0]).to(latents.dtype) / 1000}
        if c.transformer.config.guidance_embeds:
            shared["guidance"] = torch.full([1], float(p["guidance_scale"]), device=c.device,
                                            dtype=torch.float32).expand(latents.shape[0])
        prefixes = ["", "negative_"] if true_cfg(p) else [""]
        return [{**shared, "encoder_hidden_states": cond[f"{n}prompt_embeds"],
                 "pooled_projections": cond[f"{n}pooled_prompt_embeds"],
                 "txt_ids": cond[f"{n}text_ids"]} for n in prefixes], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        if not true_cfg(p):
            return outputs[0]
        noise, negative = outputs
        return negative + float(p["true_cfg_scale"]) * (noise - negative)

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        latents = FluxPipeline._unpack_latents(  # type: ignore[no-untyped-call]
            latents, p["height"], p["width"], c.recipe.vae_scale_factor)
        cfg = c.vae.config
        scaled: torch.Tensor = ((latents / cfg.scaling_factor) + cfg.shift_factor).to(c.device)
        return scaled


class FluxBlockwise:
    """``FluxTransformer2DModel.forward``: double-stream blocks, then single-stream ones. Between
    blocks the text and image streams travel as one tensor, text first (what a single block
    concatenates them into), cut apart by the text length kept in ``ctx``."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks) + len(model.single_transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        hidden = model.x_embedder(inputs["hidden_states"])
        timestep = inputs["timestep"].to(hidden.dtype) * 1000
        pooled = inputs["pooled_projections"]
        guidance = inputs.get("guidance")
        temb = model.time_text_embed(timestep, pooled) if guidance is None else \
            model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)
        text = model.context_embedder(inputs["encoder_hidden_states"])
        cos, sin = model.pos_embed(torch.cat((inputs["txt_ids"][0], inputs["img_ids"][0]), dim=0))
        return torch.cat([text, hidden], dim=1), {
            "temb": temb, "rope_cos": cos, "rope_sin": sin,
            "text_len": torch.tensor([text.shape[1]])}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        n, double = int(ctx["text_len"][0]), len(model.transformer_blocks)
        module = model.transformer_blocks[index] if index < double else \
            model.single_transformer_blocks[index - double]
        text, image = module(hidden_states=hidden[:, n:].contiguous(),
                             encoder_hidden_states=hidden[:, :n].contiguous(), temb=ctx["temb"],
                             image_rotary_emb=(ctx["rope_cos"], ctx["rope_sin"]),
                             joint_attention_kwargs=None)
        return torch.cat([text, image], dim=1)

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        image = hidden[:, int(ctx["text_len"][0]):].contiguous()
        out: torch.Tensor = model.proj_out(model.norm_out(image, ctx["temb"]))
        return out
