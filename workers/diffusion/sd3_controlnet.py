"""ControlNet jobs of Stable Diffusion 3.5 (``StableDiffusion3ControlNetPipeline`` with one
``SD3ControlNetModel``): the control image's latents, made once in the encode chunk and carried
in the job's conditioning (so a checkpoint holds them and a resume elsewhere reads the same),
and each step's controlnet forward, whose block samples ride in the step's pass inputs (so a
step stopped between block groups resumes with them) and are added after each joint block, as
``SD3Transformer2DModel.forward`` adds ``block_controlnet_hidden_states``.

The pipeline samples the control image's VAE latents from the process-wide RNG (its
``latent_dist.sample()`` takes no generator), so no two workers would agree; here they are
sampled from a generator of their own, seeded with the job's seed plus
:data:`CONTROL_SEED_OFFSET` (the job's own generator, which draws its noise, is left where the
pipeline leaves it). A reference run seeds torch's RNG so before the call.

A ControlNet is a residency item of its own (``controlnet:<content>:<device>``), like a text
encoder: its bytes counted under the worker's budget, loaded when a job names it, evictable,
and shared by every recipe that declares the same one.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from typing import Any

import torch
from diffusers import SD3ControlNetModel
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from workers.diffusion.components import (
    PART_RESIDENT,
    DiffusionComponents,
    HeldPart,
    folder_digest,
)
from workers.diffusion.conditioning import input_bytes
from workers.diffusion.families import uses_cfg
from workers.diffusion.recipes import ControlNetSpec, DiffusionRecipe
from workers.errors import ModelConfigError, ParamsError
from workers.residency import process_residency

CONTROL_SEED_OFFSET = 0x5D3C
"""The control latents' generator seed, past the job's (its noise is drawn from the seed)."""
CONTROL_KEY = "control_latents"
"""The conditioning entry of a ControlNet job's encoded control image."""
SAMPLE_PREFIX = "controlnet."
"""Pass inputs (and block context) ``controlnet.<i>``: the controlnet's block samples."""


def has_controlnet(p: Mapping[str, Any]) -> bool:
    """The job names a ControlNet of its model."""
    return p.get("controlnet") is not None


def _spec(recipe: DiffusionRecipe, name: str) -> ControlNetSpec:
    spec = recipe.controlnets.get(name)
    if spec is None:
        raise ParamsError(
            f"model {recipe.name!r} has no controlnet {name!r}; it accepts "
            f"{', '.join(sorted(recipe.controlnets)) or 'none'}"
        )
    return spec


def controlnet_identity(recipe: DiffusionRecipe, name: str) -> str:
    """What ControlNet ``name`` of ``recipe`` is, by content: its config and seed, or the digest
    of its weights folder. Equal identities build bit-identical modules: held once."""
    spec = _spec(recipe, name)
    body: dict[str, Any] = {"class": spec.class_name}
    if spec.weights is None:
        body.update(config=spec.config, seed=spec.seed)
    else:
        body.update(weights=folder_digest(recipe.source_dir / spec.weights))
    text = json.dumps(body, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def controlnet_key(recipe: DiffusionRecipe, name: str, device: str) -> str:
    """The residency key of ControlNet ``name`` of ``recipe`` on ``device``."""
    return f"controlnet:{controlnet_identity(recipe, name)}:{device}"


def _seeded(spec: ControlNetSpec) -> Any:
    """A random-weight ControlNet. Its output projections and input embedding start at zero
    (``zero_module``, as training starts them), which would make it change nothing: those are
    drawn too, from the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model: Any = SD3ControlNetModel(**spec.config)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for param in model.parameters():
                if not param.any():
                    param.normal_(0.0, 0.5)
    return model


def build_controlnet(recipe: DiffusionRecipe, name: str, device: str = "cpu") -> HeldPart:
    """ControlNet ``name`` of ``recipe`` on ``device``: seeded, or read from its folder."""
    spec = _spec(recipe, name)
    if spec.weights is None:
        model = _seeded(spec)
    else:
        folder = recipe.source_dir / spec.weights
        if not (folder / "config.json").is_file():
            raise ModelConfigError(
                f"controlnet {name!r} of model {recipe.name!r}: {folder} is "
                "not a saved SD3ControlNetModel (no config.json); write it "
                "with save_pretrained"
            )
        model = SD3ControlNetModel.from_pretrained(folder)  # type: ignore[no-untyped-call]
        with torch.no_grad():  # own storage: a file's tensors may sit unaligned (components)
            for param in model.parameters():
                param.data = param.data.clone()
    if not model.config.use_pos_embed:
        raise ModelConfigError(
            f"controlnet {name!r}: one without its own pos_embed (SD3.5 Large's) is not served"
        )
    dev = torch.device(device)
    return HeldPart(model.to(dev).eval().requires_grad_(False), None, dev)


def load_controlnet(c: DiffusionComponents, name: str) -> Any:
    """The job's ControlNet on ``c``'s device, held by the process's residency (built on first
    use and after an eviction; pinned for the caller's ``in_use`` bracket)."""
    device = str(c.device)
    held: HeldPart = process_residency().acquire(
        controlnet_key(c.recipe, name, device),
        lambda: build_controlnet(c.recipe, name, device),
        PART_RESIDENT,
    )
    return held.module


def control_latents(c: DiffusionComponents, p: Mapping[str, Any]) -> torch.Tensor:
    """The pipeline's ``prepare_image`` (resized to the job's size, in [-1, 1], doubled under
    CFG) and its VAE encode, sampled, shifted (unless the controlnet zeroes its pooled
    projections, as InstantX's do: then unshifted) and scaled."""
    controlnet = load_controlnet(c, str(p["controlnet"]))
    with Image.open(io.BytesIO(input_bytes(p, "control_image"))) as opened:
        image = opened.convert("RGB")
    processor = VaeImageProcessor(vae_scale_factor=c.recipe.vae_scale_factor)
    pixels = processor.preprocess(image, height=int(p["height"]), width=int(p["width"]))
    pixels = pixels.repeat_interleave(1, dim=0).to(device=c.device, dtype=c.transformer_dtype)
    if uses_cfg(p):
        pixels = torch.cat([pixels] * 2)
    gen = torch.Generator().manual_seed(int(p["seed"]) + CONTROL_SEED_OFFSET)
    sample = c.vae.encode(pixels).latent_dist.sample(gen)
    shift = 0 if controlnet.config.force_zeros_for_pooled_projection else c.vae.config.shift_factor
    latents: torch.Tensor = (sample - shift) * c.vae.config.scaling_factor
    return latents


def control_keep(p: Mapping[str, Any], step: int, total: int) -> float:
    """``controlnet_keep[step]`` of a ``total``-evaluation run: 0 outside the job's
    ``control_guidance_start``/``end`` window, else 1."""
    start, end = float(p["control_guidance_start"]), float(p["control_guidance_end"])
    return 1.0 - float(step / total < start or (step + 1) / total > end)


def control_samples(
    c: DiffusionComponents,
    p: Mapping[str, Any],
    scheduler: Any,
    inputs: Mapping[str, torch.Tensor],
    cond: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The controlnet's block samples of this step (``controlnet.<i>``), called as the
    pipeline calls it on the step's transformer inputs ``inputs``."""
    controlnet = load_controlnet(c, str(p["controlnet"]))
    step = 0 if scheduler.step_index is None else int(scheduler.step_index)
    scale = float(p["controlnet_conditioning_scale"]) * control_keep(
        p, step, len(scheduler.timesteps)
    )
    pooled = inputs["pooled_projections"]
    if controlnet.config.force_zeros_for_pooled_projection:
        pooled = torch.zeros_like(pooled)
    text = (
        inputs["encoder_hidden_states"]
        if controlnet.config.joint_attention_dim is not None
        else None
    )
    samples = controlnet(
        hidden_states=inputs["hidden_states"],
        timestep=inputs["timestep"],
        encoder_hidden_states=text,
        pooled_projections=pooled,
        joint_attention_kwargs=None,
        controlnet_cond=cond[CONTROL_KEY],
        conditioning_scale=scale,
        return_dict=False,
    )[0]
    return {f"{SAMPLE_PREFIX}{i}": sample for i, sample in enumerate(samples)}


def add_control(
    model: Any, index: int, hidden: torch.Tensor, ctx: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Block ``index``'s output with its controlnet residual, as the transformer adds it (none
    after a ``context_pre_only`` block, nor in a job without a ControlNet)."""
    count = sum(1 for key in ctx if key.startswith(SAMPLE_PREFIX))
    if not count or model.transformer_blocks[index].context_pre_only is not False:
        return hidden
    interval = len(model.transformer_blocks) / count
    added: torch.Tensor = hidden + ctx[f"{SAMPLE_PREFIX}{int(index / interval)}"]
    return added
