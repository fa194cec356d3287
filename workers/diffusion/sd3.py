"""Stable Diffusion 3 / 3.5: ``StableDiffusion3Pipeline``'s arithmetic (prompts through its own
``encode_prompt``: two CLIPs and a T5) and its MMDiT's joint blocks, replayed blockwise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.utils.torch_utils import randn_tensor

from workers.diffusion.blockwise import Tensors
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.conditioning import image_pixels, noised_to_start, shifted_image_latents
from workers.diffusion.families import PixArtFamily, _latent_hw, _text_rows, uses_cfg
from workers.diffusion.inpainting import Inpaint, encode_masked_image, is_masked, mask_condition
from workers.diffusion.sd3_controlnet import (
    CONTROL_KEY,
    SAMPLE_PREFIX,
    add_control,
    control_latents,
    control_samples,
    has_controlnet,
)


def _encode_prompt(c: DiffusionComponents, prompts: list[str], negatives: list[str] | None
                   ) -> tuple[Any, ...]:
    """The pipeline's ``encode_prompt`` on ``c``'s encoders (a pipeline costs ~0.3 ms)."""
    pipe: Any = StableDiffusion3Pipeline(  # type: ignore[no-untyped-call]
        transformer=c.transformer, scheduler=None, vae=c.vae, text_encoder=c.text_encoder,
        tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
        text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3)
    return tuple(pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, device=c.device,
        do_classifier_free_guidance=negatives is not None, negative_prompt=negatives,
        max_sequence_length=c.recipe.text_max_length))


def _with_control(c: DiffusionComponents, p: Mapping[str, Any], cond: Tensors) -> Tensors:
    """A ControlNet job's conditioning carries its encoded control image too."""
    return {**cond, CONTROL_KEY: control_latents(c, p)} if has_controlnet(p) else cond


class SD3Family(PixArtFamily):
    """PixArt's timesteps, guidance (no learned sigma), scheduler step (no flow sampler takes
    ``eta``), VAE decode and pixels; its own prompts, unscaled noise and input, VAE shift."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        cfg = uses_cfg(p)
        embeds, neg, pooled, neg_pooled = _encode_prompt(
            c, [str(p["prompt"])], [str(p["negative_prompt"])] if cfg else None)
        if cfg:
            embeds, pooled = torch.cat([neg, embeds], dim=0), torch.cat([neg_pooled, pooled], 0)
        return _with_control(c, p, {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled})

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps)
        embeds, _, pooled, _ = _encode_prompt(c, list(rows), None)
        own = [[rows[str(p["negative_prompt"])], rows[str(p["prompt"])]] if uses_cfg(p)
               else [rows[str(p["prompt"])]] for p in ps]  # as encode() orders them
        return [_with_control(c, p, {"prompt_embeds": embeds[r], "pooled_prompt_embeds": pooled[r]})
                for p, r in zip(ps, own, strict=True)]

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        assert c.text_encoder is not None  # the recipe check: sd3 has both CLIPs
        shape = (1, c.transformer.config.in_channels, *_latent_hw(c, p))
        return randn_tensor(shape, generator=gen, device=c.device,  # type: ignore[no-any-return]
                            dtype=c.text_encoder.dtype)

    def image_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> torch.Tensor:
        """``StableDiffusion3Img2ImgPipeline.prepare_latents``: the image encoded and shifted,
        noised by ``scale_noise`` with noise of its shape drawn next."""
        assert c.text_encoder is not None  # the prompt embeddings' dtype
        dtype = c.text_encoder.dtype
        image = shifted_image_latents(c, p, gen, c.recipe.vae_scale_factor, dtype)
        noise = randn_tensor(image.shape, generator=gen, device=c.device, dtype=dtype)
        return noised_to_start(scheduler, p, c.recipe.family, image, noise).to(dtype)

    def inpaint_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                        gen: torch.Generator) -> tuple[torch.Tensor, Inpaint]:
        """``StableDiffusion3InpaintPipeline``'s ``prepare_latents`` (the image latents
        ``repeat``-ed, so contiguous; pure noise at strength 1) then ``prepare_mask_latents``
        (the mask resized to the latent grid, one channel; the masked image encoded)."""
        assert c.text_encoder is not None  # the prompt embeddings' dtype
        dtype, multiple = c.text_encoder.dtype, c.recipe.vae_scale_factor
        image = shifted_image_latents(c, p, gen, multiple, dtype).repeat(1, 1, 1, 1)
        noise = randn_tensor(image.shape, generator=gen, device=c.device, dtype=dtype)
        latents = noise if float(p["strength"]) == 1.0 else \
            noised_to_start(scheduler, p, c.recipe.family, image, noise)
        condition = mask_condition(p, multiple)
        encode_masked_image(c, image_pixels(c, p, multiple, torch.float32), condition, gen, dtype)
        mask = torch.nn.functional.interpolate(condition, size=_latent_hw(c, p))
        return latents, {"image_latents": image, "noise": noise,
                         "mask": mask.to(device=c.device, dtype=dtype)}

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        x = torch.cat([latents] * 2) if uses_cfg(p) else latents
        inputs = {"hidden_states": x, "timestep": t.expand(x.shape[0]),
                  "encoder_hidden_states": cond["prompt_embeds"],
                  "pooled_projections": cond["pooled_prompt_embeds"]}
        if has_controlnet(p):  # StableDiffusion3ControlNetPipeline: the controlnet first
            inputs.update(control_samples(c, p, scheduler, inputs, cond))
        return [inputs], latents

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        """The latents unscaled and unshifted; an inpainting job's only unscaled, as
        ``StableDiffusion3InpaintPipeline`` decodes them (its decode leaves the VAE's
        ``shift_factor`` out, though it shifted the image latents by it)."""
        if is_masked(p):
            unscaled: torch.Tensor = latents / c.vae.config.scaling_factor
            return unscaled
        shifted: torch.Tensor = (latents / c.vae.config.scaling_factor) + c.vae.config.shift_factor
        return shifted


class SD3Blockwise:
    """``SD3Transformer2DModel.forward``: each joint block updates the image stream (``hidden``)
    and the text stream, which rides in ``ctx`` (so a checkpoint inside a step holds it); the
    last block (``context_pre_only``) returns no text stream. A ControlNet job's block samples
    ride in ``ctx`` too, each added after its blocks (:func:`add_control`)."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        x = inputs["hidden_states"]
        hidden = model.pos_embed(x).contiguous()
        temb = model.time_text_embed(inputs["timestep"], inputs["pooled_projections"])
        control = {k: v for k, v in inputs.items() if k.startswith(SAMPLE_PREFIX)}
        return hidden, {"temb": temb, "grid": torch.tensor(x.shape[-2:], dtype=torch.int64),
                        "encoder_hidden_states": model.context_embedder(
                            inputs["encoder_hidden_states"]), **control}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        text, out = model.transformer_blocks[index](
            hidden_states=hidden, encoder_hidden_states=ctx["encoder_hidden_states"],
            temb=ctx["temb"], joint_attention_kwargs=None)
        if text is not None:
            ctx["encoder_hidden_states"] = text
        return add_control(model, index, out, ctx)

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        hidden = model.proj_out(model.norm_out(hidden, ctx["temb"]))
        p, c = model.config.patch_size, model.out_channels
        height, width = (int(v) // p for v in ctx["grid"])
        hidden = hidden.reshape(shape=(hidden.shape[0], height, width, p, p, c))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(hidden.shape[0], c, height * p, width * p))
