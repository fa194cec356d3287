"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``): Qwen2.5-VL and ByT5 prompt embeddings with
their masks, noise concatenated with a zero image condition and mask, zero image embeddings
(text-to-video), CFG by the pipeline's ``ClassifierFreeGuidance`` (on unless its scale is 1),
sigmas ``linspace(1, 0, N + 1)[:-1]``; the rest is Wan's arithmetic (:class:`WanFamily`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline as Hy

from workers.diffusion.blockwise import WanBlockwise
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.families import Tensors, WanFamily, _text_rows, cfg_prefixes, job_rows

_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
_ARGS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
         "encoder_attention_mask_2")
"""The transformer's argument for each of ``_KEYS``."""
_IMAGE_TOKENS = 729  # the pipeline's vision_num_semantic_tokens: its zero image embeddings


def _cfg(p: Mapping[str, Any]) -> bool:
    """``ClassifierFreeGuidance`` runs the negative pass unless its scale is close to 1."""
    return not math.isclose(float(p["guidance_scale"]), 1.0)


def _embeds(c: DiffusionComponents, texts: list[str]) -> list[torch.Tensor]:
    """``encode_prompt``'s four tensors of ``texts`` (the pipeline's lengths, 1000 and 256)."""
    mllm = Hy._get_mllm_prompt_embeds(c.text_encoder, c.tokenizer, texts, c.device)
    byt5 = Hy._get_byt5_prompt_embeds(c.tokenizer_2, c.text_encoder_2, texts, c.device)
    return [t.to(dtype=c.transformer_dtype, device=c.device) for t in (*mllm, *byt5)]


class HunyuanVideo15Family(WanFamily):
    """Wan's noise, scheduler step and decode loop; its own text, timesteps, passes, VAE input."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        return {f"{n}{k}": e for n in cfg_prefixes(_cfg(p))  # the pipeline encodes each text alone
                for k, e in zip(_KEYS, _embeds(c, [str(p[f"{n}prompt"])]), strict=True)}

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps, _cfg)
        embeds = _embeds(c, list(rows))
        return job_rows(dict(zip(_KEYS, embeds, strict=True)), rows, ps, _cfg)

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=c.device)

    def noise_channels(self, c: DiffusionComponents) -> int:
        return int(c.transformer.config.out_channels)  # the VAE's latent channels

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        x = latents.to(c.transformer_dtype)
        b, _, f, h, w = x.shape
        x = torch.cat([x, torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)
        shared = {"hidden_states": x, "timestep": t.expand(b).to(x.dtype), "image_embeds":
                  x.new_zeros(b, _IMAGE_TOKENS, c.transformer.config.image_embed_dim)}
        return [{**shared, **{arg: cond[n + k] for arg, k in zip(_ARGS, _KEYS, strict=True)}}
                for n in cfg_prefixes(_cfg(p))], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        if not _cfg(p):
            return outputs[0]
        cond, uncond = outputs
        return uncond + float(p["guidance_scale"]) * (cond - uncond)

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        scaled: torch.Tensor = latents.to(c.device, dtype=c.vae.dtype) / c.vae.config.scaling_factor
        return scaled


    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        """One video at a time: the VAE's causal attention mask is built for a batch of one (a
        batched decode fails to broadcast in ``AutoencoderKLHunyuanVideo15``), as the pipeline,
        one video per prompt, decodes."""
        decode = super().vae_decode
        return torch.cat([decode(c, z[i:i + 1]) for i in range(len(z))])

def _joint(streams: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's per-row reorder of (image, ByT5, Qwen) tokens and masks: the valid ones
    first, then the invalid ones (the text ones zeroed)."""
    rows, masks = [], []
    for row in zip(*(zip(s, m.bool(), strict=True) for s, m in streams), strict=True):
        zeroed = [s[~m] if i == 0 else torch.zeros_like(s[~m]) for i, (s, m) in enumerate(row)]
        rows.append(torch.cat([s[m] for s, m in row] + zeroed))
        masks.append(torch.cat([m[m] for _, m in row] + [m[~m] for _, m in row]))
    return torch.stack(rows), torch.stack(masks)


class HunyuanVideo15Blockwise(WanBlockwise):
    """``HunyuanVideo15Transformer3DModel.forward``: video then text tokens in one tensor (each
    dual-stream block takes them apart), Wan's unpatchify after an AdaLN-continuous norm."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        x, t, mask, image = (inputs[k] for k in (
            "hidden_states", "timestep", "encoder_attention_mask", "image_embeds"))
        kind, t2v = model.cond_type_embed, bool(torch.all(image == 0))
        text = model.context_embedder(inputs["encoder_hidden_states"], t, mask)
        glyph = model.context_embedder_2(inputs["encoder_hidden_states_2"])
        image = model.image_embedder(image) * 0.0 if t2v else model.image_embedder(image)
        seen = torch.full(image.shape[:2], float(not t2v), dtype=mask.dtype, device=mask.device)
        streams = [(s + kind(torch.full_like(s[:, :, 0], i, dtype=torch.long)), m) for i, (s, m)
                   in enumerate([(text, mask), (glyph, inputs["encoder_attention_mask_2"]),
                                 (image, seen)])]
        enc, joint_mask = _joint(streams[::-1])
        (cos, sin), p_t, p = model.rope(x), model.config.patch_size_t, model.config.patch_size
        return torch.cat([model.x_embedder(x), enc], dim=1), {
            "temb": model.time_embed(t), "mask": joint_mask, "rope_cos": cos, "rope_sin": sin,
            "text_len": torch.tensor([enc.shape[1]]),
            "grid": torch.tensor([x.shape[0], x.shape[2] // p_t, x.shape[3] // p, x.shape[4] // p])}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        n = int(ctx["text_len"][0])
        video, text = model.transformer_blocks[index](
            hidden[:, :-n], hidden[:, -n:], ctx["temb"], ctx["mask"],
            (ctx["rope_cos"], ctx["rope_sin"]))
        return torch.cat([video, text], dim=1)

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        hidden = model.proj_out(model.norm_out(hidden[:, :-int(ctx["text_len"][0])], ctx["temb"]))
        b, f, h, w = (int(v) for v in ctx["grid"])
        p_t, p = model.config.patch_size_t, model.config.patch_size
        hidden = hidden.reshape(b, f, h, w, -1, p_t, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)
