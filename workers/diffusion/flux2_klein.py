"""Flux.2 [klein] (``Flux2KleinPipeline``): Qwen3 prompt embeddings (three hidden-state layers
side by side, padded to the full length), latents patchified 2x2 into channels and flattened to
tokens with 4-D (t, h, w, l) position ids, no guidance embedding, CFG above a guidance scale of 1
as a second pass, and Flux's sigmas shifted by an empirical ``mu`` of the image tokens and steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from diffusers import Flux2KleinPipeline as Klein
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from diffusers.utils.torch_utils import randn_tensor

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.families import Tensors, _text_rows, uses_cfg
from workers.diffusion.flow import PACK as _PACK
from workers.diffusion.flow import packed_hw as _packed_hw
from workers.diffusion.flux import FluxBlockwise, FluxFamily


def _prefixes(p: Mapping[str, Any]) -> list[str]:
    """The job's texts by key prefix: the prompt, and under CFG the negative prompt."""
    return ["", "negative_"] if uses_cfg(p) else [""]


def _embeds(c: DiffusionComponents, texts: list[str]) -> torch.Tensor:
    """The pipeline's ``_get_qwen3_prompt_embeds`` of ``texts`` in one text-encoder call."""
    return Klein._get_qwen3_prompt_embeds(  # type: ignore[no-any-return]
        c.text_encoder, c.tokenizer, texts, device=c.device,
        max_sequence_length=c.recipe.text_max_length)


def _cond(c: DiffusionComponents, p: Mapping[str, Any], embed: Callable[[str], torch.Tensor]
          ) -> Tensors:
    """Each text's embeddings (``embed``) and the text position ids ``encode_prompt`` adds."""
    cond: Tensors = {}
    for n in _prefixes(p):
        embeds = embed(str(p[f"{n}prompt"]))
        ids: torch.Tensor = Klein._prepare_text_ids(embeds).to(c.device)
        cond |= {f"{n}prompt_embeds": embeds, f"{n}text_ids": ids}
    return cond


def _latent_ids(c: DiffusionComponents, p: Mapping[str, Any]) -> torch.Tensor:
    """``prepare_latents``' position ids of the job's (H/2, W/2) token grid: (1, tokens, 4)."""
    h, w = _packed_hw(c, p)
    ids: torch.Tensor = Klein._prepare_latent_ids(torch.empty(1, 0, h // _PACK, w // _PACK))
    return ids.to(c.device)


class Flux2KleinFamily(FluxFamily):
    """Flux's timestep arithmetic (numpy sigmas, dropped in flow mode) under Flux.2's ``mu``,
    PixArt's scheduler step, decode and pixels; its own text, latents, passes and VAE input."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        return _cond(c, p, lambda text: _embeds(c, [text]))  # the pipeline encodes each alone

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps)
        embeds = _embeds(c, list(rows))
        return [_cond(c, p, lambda text: embeds[[rows[text]]]) for p in ps]

    def mu(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, steps: int
           ) -> float:
        return compute_empirical_mu(image_seq_len=len(_latent_ids(c, p)[0]), num_steps=steps)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        h, w = _packed_hw(c, p)
        assert c.text_encoder is not None  # the prompt embeddings' dtype
        noise = randn_tensor((1, c.transformer.config.in_channels, h // _PACK, w // _PACK),
                             generator=gen, device=c.device, dtype=c.text_encoder.dtype)
        return Klein._pack_latents(noise)  # type: ignore[no-any-return]

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        rows = latents.shape[0]
        shared = {"hidden_states": latents.to(c.transformer_dtype),
                  "img_ids": _latent_ids(c, p).expand(rows, -1, -1),
                  "timestep": t.expand(rows).to(latents.dtype) / 1000}
        return [{**shared, "encoder_hidden_states": cond[f"{n}prompt_embeds"],
                 "txt_ids": cond[f"{n}text_ids"].expand(rows, -1, -1)} for n in _prefixes(p)
                ], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        if not uses_cfg(p):
            return outputs[0]
        noise, negative = outputs
        return negative + float(p["guidance_scale"]) * (noise - negative)

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        """Tokens scattered back to their grid, the VAE's batch norm undone, 2x2 unpatchified."""
        h, w = _packed_hw(c, p)
        grid = Klein._unpack_latents_with_ids(latents, _latent_ids(c, p), h // _PACK, w // _PACK)
        bn, eps = c.vae.bn, c.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(grid.device, grid.dtype)
        return Klein._unpatchify_latents(grid * std + mean)  # type: ignore[no-any-return]


class Flux2KleinBlockwise(FluxBlockwise):
    """``Flux2Transformer2DModel.forward`` cut as Flux's: text first in one tensor, the
    timestep's three modulations (double-stream image and text, single-stream) in ``ctx``."""

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        hidden = inputs["hidden_states"]
        temb = model.time_guidance_embed(inputs["timestep"].to(hidden.dtype) * 1000, None)
        text = model.context_embedder(inputs["encoder_hidden_states"])
        image, txt = (model.pos_embed(inputs[k][0]) for k in ("img_ids", "txt_ids"))
        return torch.cat([text, model.x_embedder(hidden)], dim=1), {
            "temb": temb, "img_mod": model.double_stream_modulation_img(temb),
            "txt_mod": model.double_stream_modulation_txt(temb),
            "single_mod": model.single_stream_modulation(temb),
            "rope_cos": torch.cat([txt[0], image[0]]), "rope_sin": torch.cat([txt[1], image[1]]),
            "text_len": torch.tensor([text.shape[1]])}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        n, double = int(ctx["text_len"][0]), len(model.transformer_blocks)
        rope = (ctx["rope_cos"], ctx["rope_sin"])
        if index >= double:
            return model.single_transformer_blocks[index - double](  # type: ignore[no-any-return]
                hidden_states=hidden, encoder_hidden_states=None, temb_mod=ctx["single_mod"],
                image_rotary_emb=rope, joint_attention_kwargs=None)
        text, image = model.transformer_blocks[index](
            hidden_states=hidden[:, n:].contiguous(),
            encoder_hidden_states=hidden[:, :n].contiguous(), temb_mod_img=ctx["img_mod"],
            temb_mod_txt=ctx["txt_mod"], image_rotary_emb=rope, joint_attention_kwargs=None)
        return torch.cat([text, image], dim=1)
