"""Flux.1 (``FluxPipeline``): CLIP pooled and T5 prompt embeddings, latents packed in 2x2
patches, the distilled guidance scale as a transformer input, flow matching shifted by ``mu``
(which grows with the image's tokens), and true CFG as a second pass above ``true_cfg_scale`` 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import FluxPipeline

from workers.diffusion import flow
from workers.diffusion.components import DiffusionComponents, library_pipeline
from workers.diffusion.conditioning import shifted_image_latents
from workers.diffusion.families import Tensors, _text_rows, cfg_prefixes, job_rows, two_pass_cfg
from workers.diffusion.inpainting import Inpaint, masked_condition

_PACK, true_cfg = flow.PACK, flow.true_cfg
"""Flow matching's packing and true CFG (``flow.py``), by the names this module uses."""


def _dtype(c: DiffusionComponents) -> torch.dtype:
    """The prompt embeddings' dtype (T5's), which the pipeline draws its latents at."""
    assert c.text_encoder_2 is not None
    return c.text_encoder_2.dtype  # type: ignore[no-any-return]


class FluxFamily(flow.FlowMatchFamily):
    """``FluxPipeline``: flow matching's timesteps and packing; its own prompts and passes."""

    def _embed_both(self, c: DiffusionComponents, texts: list[str]) -> Tensors:
        """``encode_prompt`` of ``texts`` in one call of each text encoder: T5's embeddings, the
        CLIP pooled ones and the text ids (zeros), one row per text."""
        embeds, pooled, ids = library_pipeline(FluxPipeline, c).encode_prompt(
            texts, None, device=c.device, max_sequence_length=c.recipe.text_max_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
                "text_ids": ids[None].expand(len(texts), -1, -1)}

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        return self.encode_many(c, [p])[0]

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps, true_cfg)
        return job_rows(self._embed_both(c, list(rows)), rows, ps, true_cfg)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        return flow.pack(flow.packed_noise(c, p, gen, _dtype(c)))

    def image_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> torch.Tensor:
        """``FluxImg2ImgPipeline.prepare_latents``: the image (sized to the packing's multiple)
        encoded and shifted, noised by ``scale_noise`` with noise drawn next, then packed."""
        return self._noised_parts(c, p, scheduler, gen)[0]

    def _noised_parts(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed noised latents, image latents and noise of ``prepare_latents`` (the
        img2img and inpaint pipelines' alike)."""
        image = shifted_image_latents(c, p, gen, c.recipe.vae_scale_factor * _PACK, _dtype(c))
        return flow.packed_noised(c, p, scheduler, gen, image, _dtype(c))

    def inpaint_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                        gen: torch.Generator) -> tuple[torch.Tensor, Inpaint]:
        """``FluxInpaintPipeline``'s ``prepare_latents`` then ``prepare_mask_latents`` (the mask
        at the packing's multiple of pixels)."""
        latents, image, noise = self._noised_parts(c, p, scheduler, gen)
        condition = masked_condition(c, p, c.recipe.vae_scale_factor * _PACK, gen, _dtype(c))
        return latents, {"image_latents": image, "noise": noise,
                         "mask": flow.packed_mask(c, p, condition, _dtype(c))}

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        shared = {"hidden_states": latents,
                  "img_ids": flow.packed_image_ids(c, p, cond["prompt_embeds"].dtype)[None],
                  "timestep": t.expand(latents.shape[0]).to(latents.dtype) / 1000}
        if c.transformer.config.guidance_embeds:
            shared["guidance"] = torch.full([1], float(p["guidance_scale"]), device=c.device,
                                            dtype=torch.float32).expand(latents.shape[0])
        return [{**shared, "encoder_hidden_states": cond[f"{n}prompt_embeds"],
                 "pooled_projections": cond[f"{n}pooled_prompt_embeds"],
                 "txt_ids": cond[f"{n}text_ids"]} for n in cfg_prefixes(true_cfg(p))], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        return two_pass_cfg(outputs, float(p.get("true_cfg_scale", 1.0)))

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        return flow.unshifted(c, flow.unpack(c, p, latents)).to(c.device)


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
