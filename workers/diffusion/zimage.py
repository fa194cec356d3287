"""Z-Image (``ZImagePipeline``): Qwen3 prompt embeddings of variable length (the chat-templated
prompt's second-to-last hidden states, padding dropped), CFG above a guidance scale of 0 as
``pos + g·(pos − neg)`` on the negated velocity, flow matching from sigmas linspace(1, 1/N, N)
(shifted by ``mu`` where the scheduler shifts dynamically), and a single-stream transformer that
takes lists of per-image tensors, replayed blockwise over its main layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from workers.diffusion import flow
from workers.diffusion.blockwise import Tensors
from workers.diffusion.components import DiffusionComponents, library_pipeline
from workers.diffusion.families import _text_rows, latent_noise

_PATCH = "2-1"
"""The transformer's patch and frame-patch size as ``ZImagePipeline`` calls it (its defaults)."""


def zimage_cfg(p: Mapping[str, Any]) -> bool:
    """``ZImagePipeline.do_classifier_free_guidance``: a negative pass above a scale of 0."""
    return float(p["guidance_scale"]) > 0.0


def _embeds(c: DiffusionComponents, texts: list[str]) -> list[torch.Tensor]:
    """The pipeline's ``encode_prompt`` of ``texts`` in one text-encoder call (~0.3 ms to build)."""
    pipe = library_pipeline(ZImagePipeline, c)
    return list(pipe.encode_prompt(prompt=list(texts), device=c.device,
                                   do_classifier_free_guidance=False,
                                   max_sequence_length=c.recipe.text_max_length)[0])


def _padded(c: DiffusionComponents, embeds: Sequence[torch.Tensor]) -> Tensors:
    """Variable-length embeddings as one tensor, zero-padded to ``text_max_length``, and their
    lengths: rows that batch and checkpoint like every other input."""
    length = c.recipe.text_max_length
    rows = [torch.cat([e, e.new_zeros(length - len(e), e.shape[1])]) for e in embeds]
    return {"cap_feats": torch.stack(rows), "cap_lens": torch.tensor([len(e) for e in embeds])}


class ZImageFamily(flow.FlowMatchFamily):
    """``ZImagePipeline``: flow matching's timesteps (its own sigmas) and VAE input; the
    scheduler step, VAE decode and postprocess are PixArt's."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        embeds = _embeds(c, [str(p["prompt"])])  # the pipeline encodes each side on its own
        if zimage_cfg(p):
            embeds += _embeds(c, [str(p["negative_prompt"])])
        return _padded(c, embeds)

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps, zimage_cfg)
        embeds = _embeds(c, list(rows))
        return [_padded(c, [embeds[rows[str(p["prompt"])]]] + (
            [embeds[rows[str(p["negative_prompt"])]]] if zimage_cfg(p) else [])) for p in ps]

    def sigmas(self, scheduler: Any, steps: int) -> Any:
        """``get_default_z_image_sigmas``: linspace(1, 1/N, N) in float32, in flow mode too."""
        return get_default_z_image_sigmas(steps)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        return latent_noise(c, p, gen, torch.float32)

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        x, timestep = latents.to(c.transformer_dtype), (1000 - t.expand(latents.shape[0])) / 1000
        if zimage_cfg(p):  # one forward of [positive, negative], as the pipeline batches them
            x, timestep = x.repeat(2, 1, 1, 1), timestep.repeat(2)
        return [{"hidden_states": x.unsqueeze(2), "timestep": timestep, **cond}], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        rows = [row.float() for row in outputs[0]]
        if zimage_cfg(p):  # [positive, negative]; the scale multiplies their difference
            rows = [rows[0] + float(p["guidance_scale"]) * (rows[0] - rows[1])]
        return -torch.stack(rows, dim=0).squeeze(2)  # the pipeline steps the negated velocity

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        return flow.unshifted(c, latents.to(c.vae.dtype))


def model_inputs(inputs: Tensors) -> dict[str, Any]:
    """Pass inputs as ``ZImageTransformer2DModel.forward`` takes them: lists of per-image
    latents (C, 1, H, W) and of captions without their padding."""
    caps = [feats[:n] for feats, n in zip(inputs["cap_feats"], inputs["cap_lens"].tolist(),
                                          strict=True)]
    return {"x": list(inputs["hidden_states"].unbind(dim=0)), "t": inputs["timestep"],
            "cap_feats": caps}


def _refined(model: Any, feats: list[torch.Tensor], pos: list[torch.Tensor],
             pad: list[torch.Tensor], stream: str, refiners: Any, *adaln: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One stream (``x``: the image, ``cap``: the caption) embedded, padded to the batch and
    through its refiner layers (the image's modulated by ``adaln``), as ``forward`` does it."""
    lens = [len(f) for f in feats]
    embed = model.all_x_embedder[_PATCH] if stream == "x" else model.cap_embedder
    out = embed(torch.cat(feats, dim=0))
    out, freqs, mask, _, _ = model._prepare_sequence(
        list(out.split(lens, dim=0)), pos, pad, getattr(model, f"{stream}_pad_token"), None,
        feats[0].device)
    for layer in refiners:
        out = layer(out, mask, freqs, *adaln)
    return out, freqs, lens


class ZImageBlockwise:
    """``ZImageTransformer2DModel.forward`` (basic mode): the prologue patchifies and embeds,
    runs the noise and context refiners and joins [image, caption] into one sequence; the blocks
    are its main ``layers``; ``ctx`` keeps the RoPE frequencies as real pairs (a checkpoint holds
    no complex tensors) and no mask where every row has the same length, as the model does."""

    def num_blocks(self, model: Any) -> int:
        return len(model.layers)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        kw = model_inputs(inputs)
        adaln = model.t_embedder(kw["t"] * model.t_scale).type_as(kw["x"][0])
        x, cap, size, x_pos, cap_pos, x_pad, cap_pad = model.patchify_and_embed(
            kw["x"], kw["cap_feats"], 2, 1)
        x, x_freqs, x_lens = _refined(model, x, x_pos, x_pad, "x", model.noise_refiner, adaln)
        cap, cap_freqs, cap_lens = _refined(model, cap, cap_pos, cap_pad, "cap",
                                            model.context_refiner)
        hidden, freqs, mask, _ = model._build_unified_sequence(
            x, x_freqs, x_lens, None, cap, cap_freqs, cap_lens, None, None, None, None, None,
            False, x.device)
        ctx = {"adaln": adaln, "freqs": torch.view_as_real(freqs), "size": torch.tensor(size)}
        return hidden, ctx if mask is None else {**ctx, "mask": mask}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        out: torch.Tensor = model.layers[index](
            hidden, ctx.get("mask"), torch.view_as_complex(ctx["freqs"]), ctx["adaln"], None,
            None, None)
        return out

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        hidden = model.all_final_layer[_PATCH](hidden, c=ctx["adaln"])
        size = [tuple(row) for row in ctx["size"].tolist()]
        return torch.stack(model.unpatchify(list(hidden.unbind(dim=0)), size, 2, 1, None))
