"""Qwen-Image (``QwenImagePipeline``): each prompt alone through Qwen2.5-VL in the pipeline's
chat template, latents packed in 2x2 patches as Flux packs them, flow matching shifted by Flux's
``mu``, and true CFG (``true_cfg_scale`` above 1) rescaled to the conditional prediction's norm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import QwenImagePipeline
from diffusers.utils.torch_utils import randn_tensor

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import image_pixels, noised_to_start
from workers.diffusion.families import Tensors, WanFamily
from workers.diffusion.flow import true_cfg
from workers.diffusion.flux import FluxFamily
from workers.diffusion.inpainting import Inpaint
from workers.diffusion.packing import PACK, latent_channels, pack, packed_hw, packed_mask

_WAN = WanFamily()  # its VAE input (latents_std and latents_mean undone) is Qwen-Image's


def _prefixes(p: Mapping[str, Any]) -> list[str]:
    """The job's texts by key prefix: the prompt, and under true CFG the negative prompt."""
    return ["", "negative_"] if true_cfg(p) else [""]


def _embed(c: DiffusionComponents, text: str) -> torch.Tensor:
    """The pipeline's ``encode_prompt`` of one text (a pipeline costs well under a millisecond).
    One text has no padding, so its mask is all ones, which the pipeline drops (None)."""
    pipe: Any = QwenImagePipeline(  # type: ignore[no-untyped-call]
        scheduler=None, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
        transformer=c.transformer)
    embeds, mask = pipe.encode_prompt(text, device=c.device,
                                      max_sequence_length=c.recipe.text_max_length)
    assert mask is None
    return embeds  # type: ignore[no-any-return]


def _dtype(c: DiffusionComponents) -> torch.dtype:
    """The prompt embeddings' dtype, which the pipeline's latents take."""
    assert c.text_encoder is not None
    dtype: torch.dtype = c.text_encoder.dtype
    return dtype


class QwenImageFamily(FluxFamily):
    """Flux's timesteps (its sigmas passed even in flow mode), encode, scheduler step and pixels;
    its own prompt embeddings (each text encoded alone, as the pipeline encodes prompt and
    negative prompt apart), latents, passes, guidance and VAE decode."""

    sigmas_in_flow_mode = True

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        texts = {str(p[f"{n}prompt"]) for p in ps for n in _prefixes(p)}
        embeds = {text: _embed(c, text) for text in sorted(texts)}
        return [{f"{n}prompt_embeds": embeds[str(p[f"{n}prompt"])] for n in _prefixes(p)}
                for p in ps]

    def _noise(self, c: DiffusionComponents, p: Mapping[str, Any], gen: torch.Generator
               ) -> torch.Tensor:
        """The job's noise as ``prepare_latents`` draws it: one frame, (1, 1, C, H, W)."""
        noise: torch.Tensor = randn_tensor((1, 1, latent_channels(c), *packed_hw(c, p)),
                                           generator=gen, device=c.device, dtype=_dtype(c))
        return noise

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        return pack(self._noise(c, p, gen))

    def _noised_parts(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``QwenImageImg2ImgPipeline.prepare_latents`` (the inpaint pipeline's alike): the
        image (at the packing's multiple, as one frame) encoded with the job's generator and
        normalised by the VAE's ``latents_mean`` and ``latents_std``, noised by ``scale_noise``
        with noise drawn next; the noised latents, image latents and noise, packed."""
        pixels = image_pixels(c, p, c.recipe.vae_scale_factor * PACK, _dtype(c))[:, :, None]
        sample = c.vae.encode(pixels).latent_dist.sample(gen)
        mean, std = (torch.tensor(getattr(c.vae.config, k)).view(1, -1, 1, 1, 1).to(
            sample.device, sample.dtype) for k in ("latents_mean", "latents_std"))
        image = ((sample - mean) * (1.0 / std)).transpose(1, 2)
        noise = self._noise(c, p, gen)
        noised = noised_to_start(scheduler, p, c.recipe.family, image, noise)
        return pack(noised), pack(image), pack(noise)

    def inpaint_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                        gen: torch.Generator) -> tuple[torch.Tensor, Inpaint]:
        """``QwenImageInpaintPipeline``: its img2img latents, and Flux's packed mask of the
        masked image encoded as one frame."""
        latents, image, noise = self._noised_parts(c, p, scheduler, gen)
        pixels = image_pixels(c, p, c.recipe.vae_scale_factor * PACK, torch.float32)[:, :, None]
        mask = packed_mask(c, p, pixels, gen, _dtype(c))
        return latents, {"image_latents": image, "noise": noise, "mask": mask}

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        """``img_shapes`` (frames, rows, columns of tokens) as one tensor row per latent row."""
        shape = torch.tensor([[1, *(n // PACK for n in packed_hw(c, p))]])
        shared = {"hidden_states": latents, "img_shapes": shape.expand(latents.shape[0], -1),
                  "timestep": t.expand(latents.shape[0]).to(latents.dtype) / 1000}
        return [{**shared, "encoder_hidden_states": cond[f"{n}prompt_embeds"]}
                for n in _prefixes(p)], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        """Flux's true CFG, rescaled to the conditional prediction's norm."""
        combined = super().combine(c, p, outputs)
        if not true_cfg(p):
            return combined
        cond_norm, norm = (torch.norm(x, dim=-1, keepdim=True) for x in (outputs[0], combined))
        rescaled: torch.Tensor = combined * (cond_norm / norm)
        return rescaled

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        unpacked: torch.Tensor = QwenImagePipeline._unpack_latents(
            latents, p["height"], p["width"], c.recipe.vae_scale_factor)
        return _WAN.vae_input(c, p, unpacked)

    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        image: torch.Tensor = c.vae.decode(z, return_dict=False)[0][:, :, 0]
        return image


class QwenImageBlockwise:
    """``QwenImageTransformer2DModel.forward`` (no ``zero_cond_t``, no extra timestep
    condition): each dual-stream block updates the image stream (``hidden``) and the text
    stream, which rides in ``ctx``; the rotary tables ride there as real views."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        hidden = model.img_in(inputs["hidden_states"])
        timestep = inputs["timestep"].to(hidden.dtype)
        text = model.txt_in(model.txt_norm(inputs["encoder_hidden_states"]))
        temb = model.time_text_embed(timestep, hidden, None)
        shapes = [[tuple(int(v) for v in inputs["img_shapes"][0])]]
        image_rope, text_rope = model.pos_embed(shapes, max_txt_seq_len=text.shape[1],
                                                device=hidden.device)
        return hidden, {"temb": temb, "encoder_hidden_states": text,
                        "image_rope": torch.view_as_real(image_rope),
                        "text_rope": torch.view_as_real(text_rope)}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        rope = (torch.view_as_complex(ctx["image_rope"]), torch.view_as_complex(ctx["text_rope"]))
        ctx["encoder_hidden_states"], out = model.transformer_blocks[index](
            hidden_states=hidden, encoder_hidden_states=ctx["encoder_hidden_states"],
            encoder_hidden_states_mask=None, temb=ctx["temb"], image_rotary_emb=rope,
            joint_attention_kwargs=None, modulate_index=None)
        return out  # type: ignore[no-any-return]

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        out: torch.Tensor = model.proj_out(model.norm_out(hidden, ctx["temb"]))
        return out
