"""The arithmetic of each pipeline family, step by step: DiTPipeline, PixArt-Sigma, WanPipeline.

Each method mirrors one stretch of the pipeline's ``__call__`` (prompt encoding, noise init,
CFG batching, guidance, scheduler step, VAE decode) with the same operations in the same order,
so a chunked job is bit-identical to the library's uninterrupted pipeline.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from workers.diffusion.components import DiffusionComponents

Tensors = dict[str, torch.Tensor]


class PipelineFamily(Protocol):
    """What the runner needs from one pipeline family."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        """Conditioning tensors (prompt or class embeddings, negative ones under CFG)."""
        ...

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        """What :meth:`encode` returns for each job, from one text-encoder call over all."""
        ...

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        """Prepare the scheduler's timesteps exactly as the pipeline does."""
        ...

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        """The initial noise (the state the denoising loop carries)."""
        ...

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        """Transformer inputs of each forward pass of this step, and the sample to step from."""
        ...

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        """Guidance and learned-sigma split: the model output handed to the scheduler."""
        ...

    def step(self, scheduler: Any, output: torch.Tensor, t: torch.Tensor, sample: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
        """One scheduler step: the next latents."""
        ...

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        """A job's final latents as its VAE decode takes them (CFG copies dropped, scaled)."""
        ...

    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        """The VAE decode of :meth:`vae_input` rows, of one job or several jobs concatenated."""
        ...

    def pixels(self, c: DiffusionComponents, p: Mapping[str, Any], decoded: torch.Tensor
               ) -> torch.Tensor:
        """A job's rows of :meth:`vae_decode` as pixels in [0, 1]: (B, C, H, W) for images,
        (B, F, C, H, W) for video."""
        ...


@runtime_checkable
class ExpertFamily(Protocol):
    """A family whose steps run on one of several transformers, chosen by the step's timestep
    (Wan 2.2's high- and low-noise experts): the runner asks it which, and hands ``combine`` the
    step's parameters."""

    def expert(self, recipe: Any, scheduler: Any, t: torch.Tensor) -> str:
        """The component (``transformer``, ``transformer_2``) that runs the step at ``t``."""
        ...

    def step_params(self, recipe: Any, p: Mapping[str, Any], scheduler: Any, t: torch.Tensor
                    ) -> Mapping[str, Any]:
        """``p`` as the step at ``t`` reads it in :meth:`PipelineFamily.combine`."""
        ...


@runtime_checkable
class SizedScheduleFamily(Protocol):
    """A family whose timesteps depend on the job's image size (Flux's dynamic shift ``mu``,
    from its latent tokens): the runner sets them per job size, not once per recipe."""

    def set_job_timesteps(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                          steps: int) -> None:
        """:meth:`PipelineFamily.set_timesteps` for a job of ``p``'s height and width."""
        ...


@runtime_checkable
class ImageFamily(Protocol):
    """A family whose img2img pipeline makes the initial latents of an image-conditioned job
    its own way (Flux and SD3: shifted VAE latents, ``scale_noise``; Flux packs them); the
    runner asks it instead of :func:`workers.diffusion.conditioning.image_latents`."""

    def image_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                      gen: torch.Generator) -> torch.Tensor:
        """The input image's latents noised to the job's first timestep (its scheduler's
        ``begin_index`` already set there)."""
        ...


@runtime_checkable
class MaskFamily(Protocol):
    """A family with an inpaint pipeline (Flux, SD3): an inpainting job's initial latents, and
    what its every step blends with (:mod:`workers.diffusion.inpainting`)."""

    def inpaint_latents(self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                        gen: torch.Generator) -> tuple[torch.Tensor, Tensors]:
        """The initial latents (as :meth:`ImageFamily.image_latents` makes them) and the blend
        inputs: clean image latents, initial noise and mask, laid out as the latents."""
        ...


def decode_job(family: PipelineFamily, c: DiffusionComponents, p: Mapping[str, Any],
               latents: torch.Tensor) -> torch.Tensor:
    """One job's pixels from its final latents, as the pipeline decodes them."""
    return family.pixels(c, p, family.vae_decode(c, family.vae_input(c, p, latents)))


def uses_cfg(p: Mapping[str, Any]) -> bool:
    """Classifier-free guidance is on above a scale of 1, as in every diffusers pipeline."""
    return float(p["guidance_scale"]) > 1.0


def _text_rows(ps: Sequence[Mapping[str, Any]],
               cfg: Callable[[Mapping[str, Any]], bool] = uses_cfg) -> dict[str, int]:
    """Every distinct prompt and (under CFG, as ``cfg`` tells) negative prompt of ``ps``: its row
    in one text-encoder batch. Jobs often share a negative prompt; it is encoded once."""
    texts = [str(p["prompt"]) for p in ps] + [str(p["negative_prompt"]) for p in ps if cfg(p)]
    return {text: row for row, text in enumerate(dict.fromkeys(texts))}


def cfg_prefixes(cfg: bool) -> list[str]:
    """A two-pass CFG job's texts by key prefix: the prompt, and under CFG the negative one."""
    return ["", "negative_"] if cfg else [""]


def job_rows(embeds: Tensors, rows: Mapping[str, int], ps: Sequence[Mapping[str, Any]],
             cfg: Callable[[Mapping[str, Any]], bool] = uses_cfg) -> list[Tensors]:
    """Each job's rows of one text-encoder batch (``rows``: :func:`_text_rows`), laid out for two
    passes: its prompt's row of every tensor, and under CFG its negative prompt's under the same
    keys prefixed ``negative_``."""
    return [{f"{n}{key}": tensor[[rows[str(p[f"{n}prompt"])]]] for n in cfg_prefixes(cfg(p))
             for key, tensor in embeds.items()} for p in ps]


def two_pass_cfg(outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """CFG over a conditional and a negative pass, ``negative + scale · (cond − negative)`` (one
    pass, without CFG, as it is): FluxPipeline's true CFG, WanPipeline's and Flux.2's CFG."""
    if len(outputs) == 1:
        return outputs[0]
    noise, negative = outputs
    return negative + scale * (noise - negative)


def latent_noise(c: DiffusionComponents, p: Mapping[str, Any], gen: torch.Generator,
                 dtype: torch.dtype) -> torch.Tensor:
    """``prepare_latents``' noise of an unpacked image pipeline: (1, C, H/f, W/f) of the
    transformer's input channels at the VAE's scale factor ``f``."""
    shape = (1, c.transformer.config.in_channels, *_latent_hw(c, p))
    noise: torch.Tensor = randn_tensor(shape, generator=gen, device=c.device, dtype=dtype)
    return noise


def _latent_hw(c: DiffusionComponents, p: Mapping[str, Any]) -> tuple[int, int]:
    f = c.recipe.vae_scale_factor
    return int(p["height"]) // f, int(p["width"]) // f


def _batched_timestep(t: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    return t[None].to(device).expand(batch) if t.ndim == 0 else t.expand(batch)


def _split_learned_sigma(c: DiffusionComponents, noise: torch.Tensor) -> torch.Tensor:
    channels = c.transformer.config.in_channels
    if c.transformer.config.out_channels // 2 == channels:
        return noise.chunk(2, dim=1)[0]
    return noise


class DiTFamily:
    """``DiTPipeline``: class labels, null class 1000, CFG on a doubled latent batch."""

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        labels = torch.tensor([int(p["class_label"])], device=c.device).reshape(-1)
        if uses_cfg(p):
            labels = torch.cat([labels, torch.tensor([1000], device=c.device)], 0)
        return {"class_labels": labels}

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        return [self.encode(c, p) for p in ps]  # a label lookup: nothing worth batching

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        scheduler.set_timesteps(steps)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        h, w = _latent_hw(c, p)
        shape = (1, c.transformer.config.in_channels, h, w)
        latents = randn_tensor(shape, generator=gen, device=c.device, dtype=c.transformer_dtype)
        return torch.cat([latents] * 2) if uses_cfg(p) else latents

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        if uses_cfg(p):
            half = latents[: len(latents) // 2]
            latents = torch.cat([half, half], dim=0)
        x = scheduler.scale_model_input(latents, t)
        timestep = _batched_timestep(t, x.shape[0], x.device)
        return [{"hidden_states": x, "timestep": timestep,
                 "class_labels": cond["class_labels"]}], x

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        noise, channels = outputs[0], c.transformer.config.in_channels
        if uses_cfg(p):
            eps, rest = noise[:, :channels], noise[:, channels:]
            cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
            half_eps = uncond_eps + float(p["guidance_scale"]) * (cond_eps - uncond_eps)
            eps = torch.cat([half_eps, half_eps], dim=0)
            noise = torch.cat([eps, rest], dim=1)
        if c.transformer.config.out_channels // 2 == channels:
            return torch.split(noise, channels, dim=1)[0]
        return noise

    def step(self, scheduler: Any, output: torch.Tensor, t: torch.Tensor, sample: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
        prev: torch.Tensor = scheduler.step(output, t, sample, **_generator(scheduler, gen)
                                            ).prev_sample
        return prev

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        if uses_cfg(p):  # the CFG batch carries two identical halves
            latents = latents.chunk(2, dim=0)[0]
        scaled: torch.Tensor = 1 / c.vae.config.scaling_factor * latents
        return scaled

    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        samples: torch.Tensor = c.vae.decode(z).sample
        return samples

    def pixels(self, c: DiffusionComponents, p: Mapping[str, Any], decoded: torch.Tensor
               ) -> torch.Tensor:
        return (decoded / 2 + 0.5).clamp(0, 1)


@functools.cache
def _step_parameters(step: Callable[..., Any]) -> frozenset[str]:
    """What a scheduler class's ``step`` accepts (read once per class: inspect is slow)."""
    return frozenset(inspect.signature(step).parameters)


def _generator(scheduler: Any, gen: torch.Generator) -> dict[str, Any]:
    """The job's generator for a scheduler that draws noise. DiTPipeline and WanPipeline leave it
    out, so their stochastic samplers draw from the process-wide RNG and no two workers agree;
    here every draw is the job's, as PixArtSigmaPipeline does."""
    return {"generator": gen} if "generator" in _step_parameters(type(scheduler).step) else {}


def _step_kwargs(scheduler: Any, gen: torch.Generator) -> dict[str, Any]:
    """PixArtSigmaPipeline's ``prepare_extra_step_kwargs`` with its default ``eta`` of 0."""
    eta: dict[str, Any] = {"eta": 0.0} if "eta" in _step_parameters(type(scheduler).step) else {}
    return eta | _generator(scheduler, gen)


class PixArtFamily:
    """``PixArtSigmaPipeline``: T5 prompt embeddings with masks, CFG as [negative, positive]."""

    def _embed(self, c: DiffusionComponents, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        assert c.tokenizer is not None and c.text_encoder is not None
        tokens = c.tokenizer(
            [t.lower().strip() for t in texts], padding="max_length",
            max_length=c.recipe.text_max_length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        )
        mask = tokens.attention_mask.to(c.device)
        embeds = c.text_encoder(tokens.input_ids.to(c.device), attention_mask=mask)[0]
        return embeds.to(dtype=c.text_encoder.dtype, device=c.device), mask

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        embeds, mask = self._embed(c, [str(p["prompt"])])
        if uses_cfg(p):
            neg, neg_mask = self._embed(c, [str(p["negative_prompt"])])
            embeds, mask = torch.cat([neg, embeds], dim=0), torch.cat([neg_mask, mask], dim=0)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps)
        embeds, mask = self._embed(c, list(rows))
        conds = []
        for p in ps:  # rows as encode() concatenates them: [negative, positive] under CFG
            own = [rows[str(p["negative_prompt"])]] if uses_cfg(p) else []
            own.append(rows[str(p["prompt"])])
            conds.append({"prompt_embeds": embeds[own], "prompt_attention_mask": mask[own]})
        return conds

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        scheduler.set_timesteps(steps, device=c.device)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        h, w = _latent_hw(c, p)
        shape = (1, c.transformer.config.in_channels, h, w)
        dtype = c.text_encoder.dtype if c.text_encoder is not None else c.transformer_dtype
        latents: torch.Tensor = randn_tensor(shape, generator=gen, device=c.device, dtype=dtype)
        scaled: torch.Tensor = latents * scheduler.init_noise_sigma
        return scaled

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        x = torch.cat([latents] * 2) if uses_cfg(p) else latents
        x = scheduler.scale_model_input(x, t)
        return [{
            "hidden_states": x, "timestep": _batched_timestep(t, x.shape[0], x.device),
            "encoder_hidden_states": cond["prompt_embeds"],
            "encoder_attention_mask": cond["prompt_attention_mask"],
        }], latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        noise = outputs[0]
        if uses_cfg(p):
            uncond, text = noise.chunk(2)
            noise = uncond + float(p["guidance_scale"]) * (text - uncond)
        return _split_learned_sigma(c, noise)

    def step(self, scheduler: Any, output: torch.Tensor, t: torch.Tensor, sample: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
        prev: torch.Tensor = scheduler.step(
            output, t, sample, **_step_kwargs(scheduler, gen), return_dict=False)[0]
        return prev

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        scaled: torch.Tensor = latents.to(c.vae.dtype) / c.vae.config.scaling_factor
        return scaled

    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        image: torch.Tensor = c.vae.decode(z, return_dict=False)[0]
        return image

    def pixels(self, c: DiffusionComponents, p: Mapping[str, Any], decoded: torch.Tensor
               ) -> torch.Tensor:
        processor = VaeImageProcessor(vae_scale_factor=c.recipe.vae_scale_factor)
        out: torch.Tensor = processor.postprocess(decoded, output_type="pt")
        return out


class WanFamily:
    """``WanPipeline`` (2.1): UMT5 embeddings trimmed and zero-padded, CFG as two passes."""

    def _embed(self, c: DiffusionComponents, texts: list[str]) -> torch.Tensor:
        assert c.tokenizer is not None and c.text_encoder is not None
        length = c.recipe.text_max_length
        cleaned: list[str] = [prompt_clean(t) for t in texts]  # type: ignore[no-untyped-call]
        tokens = c.tokenizer(
            cleaned, padding="max_length", max_length=length, truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        seq_lens = tokens.attention_mask.gt(0).sum(dim=1).long()
        states = c.text_encoder(tokens.input_ids.to(c.device),
                                tokens.attention_mask.to(c.device)).last_hidden_state
        states = states.to(dtype=c.text_encoder.dtype, device=c.device)
        trimmed = [u[:v] for u, v in zip(states, seq_lens, strict=True)]
        padded = [torch.cat([u, u.new_zeros(length - u.size(0), u.size(1))]) for u in trimmed]
        return torch.stack(padded, dim=0).to(c.transformer_dtype)

    def encode(self, c: DiffusionComponents, p: Mapping[str, Any]) -> Tensors:
        cond = {"prompt_embeds": self._embed(c, [str(p["prompt"])])}
        if uses_cfg(p):
            cond["negative_prompt_embeds"] = self._embed(c, [str(p["negative_prompt"]) or ""])
        return cond

    def encode_many(self, c: DiffusionComponents, ps: Sequence[Mapping[str, Any]]
                    ) -> list[Tensors]:
        rows = _text_rows(ps)
        embeds = self._embed(c, list(rows))
        conds = []
        for p in ps:
            cond = {"prompt_embeds": embeds[[rows[str(p["prompt"])]]]}
            if uses_cfg(p):
                cond["negative_prompt_embeds"] = embeds[[rows[str(p["negative_prompt"])]]]
            conds.append(cond)
        return conds

    def set_timesteps(self, c: DiffusionComponents, scheduler: Any, steps: int) -> None:
        scheduler.set_timesteps(steps, device=c.device)
        scheduler.set_begin_index(0)

    def init_latents(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, gen: torch.Generator
    ) -> torch.Tensor:
        h, w = _latent_hw(c, p)
        frames = (int(p["num_frames"]) - 1) // c.recipe.temporal_scale_factor + 1
        shape = (1, self.noise_channels(c), frames, h, w)
        noise: torch.Tensor = randn_tensor(shape, generator=gen, device=c.device,
                                           dtype=torch.float32)
        return noise

    def noise_channels(self, c: DiffusionComponents) -> int:
        """Channels of the noise (``prepare_latents``' ``num_channels_latents``): the
        transformer's input, all of it noise in text-to-video."""
        return int(c.transformer.config.in_channels)

    def passes(
        self, c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any, latents: torch.Tensor,
        t: torch.Tensor, cond: Tensors,
    ) -> tuple[list[Tensors], torch.Tensor]:
        x = latents.to(c.transformer_dtype)
        timestep = t.expand(latents.shape[0])
        names = ["prompt_embeds", "negative_prompt_embeds"] if uses_cfg(p) else ["prompt_embeds"]
        inputs = [{"hidden_states": x, "timestep": timestep, "encoder_hidden_states": cond[n]}
                  for n in names]
        return inputs, latents

    def combine(self, c: DiffusionComponents, p: Mapping[str, Any], outputs: list[torch.Tensor]
                ) -> torch.Tensor:
        if not uses_cfg(p):
            return outputs[0]
        noise, uncond = outputs
        return uncond + float(p["guidance_scale"]) * (noise - uncond)

    def step(self, scheduler: Any, output: torch.Tensor, t: torch.Tensor, sample: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
        prev: torch.Tensor = scheduler.step(output, t, sample, **_generator(scheduler, gen),
                                            return_dict=False)[0]
        return prev

    def vae_input(self, c: DiffusionComponents, p: Mapping[str, Any], latents: torch.Tensor
                  ) -> torch.Tensor:
        cfg = c.vae.config
        latents = latents.to(c.device, dtype=c.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device,
                                                                            latents.dtype)
        std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device,
                                                                                latents.dtype)
        return latents / std + mean

    def vae_decode(self, c: DiffusionComponents, z: torch.Tensor) -> torch.Tensor:
        video: torch.Tensor = c.vae.decode(z, return_dict=False)[0]
        return video

    def pixels(self, c: DiffusionComponents, p: Mapping[str, Any], decoded: torch.Tensor
               ) -> torch.Tensor:
        processor = VideoProcessor(vae_scale_factor=c.recipe.vae_scale_factor)
        out: torch.Tensor = processor.postprocess_video(decoded, output_type="pt")
        return out
