"""How to call each family's own diffusers pipeline, uninterrupted: the reference every
exactness test compares Stepline's chunked runs against. A new family is one entry in CALLS;
a family with an img2img pipeline of its own one in IMAGE_CALLS too (an image-conditioned job
is compared with that), and one with an inpaint pipeline one in MASK_CALLS (a job with a mask).
A job that names :data:`INPUT_IMAGE` (an edit or image-to-video job's image) gets its bytes
from :func:`with_inputs`, as a worker hands them to its chunks."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import (
    ClassifierFreeGuidance,
    DiTPipeline,
    Flux2KleinPipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    HunyuanVideo15Pipeline,
    PixArtSigmaPipeline,
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    QwenImagePipeline,
    StableDiffusion3ControlNetPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)
from PIL import Image

from workers.diffusion.components import DiffusionComponents
from workers.diffusion.inputs import INPUT_BYTES, is_conditioned
from workers.diffusion.sd3_controlnet import CONTROL_SEED_OFFSET, load_controlnet


def _random_png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


INPUT_IMAGE = _random_png(40, 24, seed=5)
"""An edit or image-to-video job's input: random RGB (not flat), of another size than the job's."""
INPUT_IMAGE_DIGEST = "sha256:" + hashlib.sha256(INPUT_IMAGE).hexdigest()
CONTROL_IMAGE = _random_png(56, 40, seed=6)
"""A ControlNet job's control image: random RGB, of another size than the job's."""
CONTROL_IMAGE_DIGEST = "sha256:" + hashlib.sha256(CONTROL_IMAGE).hexdigest()


def with_inputs(p: Mapping[str, Any]) -> dict[str, Any]:
    """Validated params ``p`` with the bytes of :data:`INPUT_IMAGE` and
    :data:`CONTROL_IMAGE` where they name them."""
    held = {role: data for role, data, digest in (
        ("image", INPUT_IMAGE, INPUT_IMAGE_DIGEST),
        ("control_image", CONTROL_IMAGE, CONTROL_IMAGE_DIGEST)) if p.get(role) == digest}
    return {**p, INPUT_BYTES: held} if held else dict(p)


@dataclass(frozen=True, slots=True)
class Reference:
    """The pipeline's final latents (None where it hands out none: DiT) and its pixels."""

    latents: torch.Tensor | None
    pixels: torch.Tensor


Call = Callable[[DiffusionComponents, Mapping[str, Any], Any, dict[str, Any]], Reference]


class _Keep:
    """A ``callback_on_step_end`` that keeps the latents of the last step."""

    def __init__(self) -> None:
        self.latents: torch.Tensor | None = None

    def __call__(self, _pipe: Any, _i: int, _t: Any, kw: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
        self.latents = kw["latents"].clone()
        return {}


def _quiet(pipe: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _text(c: DiffusionComponents, p: Mapping[str, Any]) -> dict[str, Any]:
    return {"prompt": p["prompt"], "negative_prompt": p["negative_prompt"],
            "height": p["height"], "width": p["width"], "output_type": "pt",
            "max_sequence_length": c.recipe.text_max_length}


def _dit(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
         common: dict[str, Any]) -> Reference:
    pipe = _quiet(DiTPipeline(transformer=c.transformer, vae=c.vae, scheduler=scheduler))
    return Reference(None, pipe(class_labels=[p["class_label"]], output_type="pt",
                                **common).images)


def _pixart(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
            common: dict[str, Any]) -> Reference:
    pipe = _quiet(PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder,
                                      vae=c.vae, transformer=c.transformer, scheduler=scheduler))
    kept: dict[str, torch.Tensor] = {}
    pixels = pipe(use_resolution_binning=False, clean_caption=False, **_text(c, p), **common,
                  callback=lambda i, t, lat: kept.update(latents=lat.clone())).images
    return Reference(kept["latents"], pixels)


def _wan(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
         common: dict[str, Any]) -> Reference:
    experts: dict[str, Any] = {}
    if c.transformer_2 is not None:  # Wan 2.2: the low-noise expert, its boundary and guidance
        experts = {"transformer_2": c.transformer_2, "boundary_ratio": c.recipe.boundary_ratio}
        common = {**common, "guidance_scale_2": p["guidance_scale_2"]}
    pipe = _quiet(WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                              transformer=c.transformer, scheduler=scheduler, **experts))
    return _kept(pipe, "frames", num_frames=p["num_frames"], **_text(c, p), **common)


def _input_image(p: Mapping[str, Any]) -> Image.Image:
    """The job's input image as the pipeline takes it (an edit or image-to-video job's image
    conditions every step; it is not in ``common``)."""
    with Image.open(io.BytesIO(p[INPUT_BYTES]["image"])) as opened:
        return opened.convert("RGB")


def _wan_i2v(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
             common: dict[str, Any]) -> Reference:
    """Wan 2.2 image-to-video. Its ``prompt_clean`` calls ftfy unguarded (diffusers 0.42.1),
    which is not installed; its prompt encoding is otherwise WanPipeline's line for line, so the
    prompt and negative embeddings come from ``WanPipeline.encode_prompt``."""
    text = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                       transformer=c.transformer, scheduler=scheduler)
    embeds, negative = text.encode_prompt(p["prompt"], p["negative_prompt"],
                                          float(p["guidance_scale"]) > 1.0,
                                          max_sequence_length=c.recipe.text_max_length)
    pipe = _quiet(WanImageToVideoPipeline(
        tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=scheduler,
        transformer=c.transformer, transformer_2=c.transformer_2,
        boundary_ratio=c.recipe.boundary_ratio))
    return _kept(pipe, "frames", image=_input_image(p), prompt_embeds=embeds,
                 negative_prompt_embeds=negative, height=p["height"], width=p["width"],
                 num_frames=p["num_frames"], output_type="pt",
                 guidance_scale_2=p["guidance_scale_2"], **common)


def _flux_pipe(cls: Any, c: DiffusionComponents, scheduler: Any) -> Any:
    """A Flux.1 pipeline of class ``cls`` (text-to-image, img2img, inpaint, Kontext: all take
    the same modules) on the recipe's modules."""
    return _quiet(cls(scheduler=scheduler, vae=c.vae, text_encoder=c.text_encoder,
                      tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
                      tokenizer_2=c.tokenizer_2, transformer=c.transformer))


def _flux_call(cls: Any) -> Call:
    """The reference call of the Flux.1 pipeline ``cls``: true CFG at the job's scale."""
    def call(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
             common: dict[str, Any]) -> Reference:
        return _kept(_flux_pipe(cls, c, scheduler), "images",
                     true_cfg_scale=p["true_cfg_scale"], **_text(c, p), **common)
    return call


def _sd3_call(cls: Any) -> Call:
    """The reference call of the SD 3.5 pipeline ``cls`` (text-to-image, img2img and inpaint
    take the same three encoders)."""
    def call(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
             common: dict[str, Any]) -> Reference:
        pipe = _quiet(cls(
            transformer=c.transformer, scheduler=scheduler, vae=c.vae,
            text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
            tokenizer_2=c.tokenizer_2, text_encoder_3=c.text_encoder_3,
            tokenizer_3=c.tokenizer_3))
        return _kept(pipe, "images", **_text(c, p), **common)
    return call


def _sd3_controlnet(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                    common: dict[str, Any]) -> Reference:
    """``StableDiffusion3ControlNetPipeline`` with the job's ControlNet (the worker's module),
    torch's RNG seeded as Stepline seeds the control latents' sample (the pipeline draws it
    from the process-wide RNG)."""
    pipe = _quiet(StableDiffusion3ControlNetPipeline(
        transformer=c.transformer, scheduler=scheduler, vae=c.vae,
        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2, text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3,
        controlnet=load_controlnet(c, str(p["controlnet"]))))
    with Image.open(io.BytesIO(p[INPUT_BYTES]["control_image"])) as opened:
        control = opened.convert("RGB")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(p["seed"]) + CONTROL_SEED_OFFSET)
        return _kept(pipe, "images", control_image=control,
                     controlnet_conditioning_scale=p["controlnet_conditioning_scale"],
                     control_guidance_start=p["control_guidance_start"],
                     control_guidance_end=p["control_guidance_end"], **_text(c, p), **common)


def _flux_kontext(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                  common: dict[str, Any]) -> Reference:
    """The edit pipeline on the image resized to the job's size (what Stepline encodes), with
    ``_auto_resize=False`` (its preferred resolutions are the full-size model's) and
    ``max_area`` the job's area (which keeps the job's size, not 1024²)."""
    pipe = _flux_pipe(FluxKontextPipeline, c, scheduler)
    common = {**common, "image": pipe.image_processor.resize(_input_image(p), p["height"],
                                                             p["width"])}
    return _kept(pipe, "images", true_cfg_scale=p["true_cfg_scale"], _auto_resize=False,
                 max_area=p["height"] * p["width"], **_text(c, p), **common)


def _qwen_call(cls: Any) -> Call:
    """The reference call of the Qwen-Image pipeline ``cls`` (text-to-image, img2img and
    inpaint take the same modules): true CFG at the job's scale."""
    def call(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
             common: dict[str, Any]) -> Reference:
        pipe = _quiet(cls(scheduler=scheduler, vae=c.vae, text_encoder=c.text_encoder,
                          tokenizer=c.tokenizer, transformer=c.transformer))
        return _kept(pipe, "images", true_cfg_scale=p["true_cfg_scale"], **_text(c, p), **common)
    return call


def _zimage(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
            common: dict[str, Any]) -> Reference:
    pipe = _quiet(ZImagePipeline(scheduler=scheduler, vae=c.vae, text_encoder=c.text_encoder,
                                 tokenizer=c.tokenizer, transformer=c.transformer))
    return _kept(pipe, "images", **_text(c, p), **common)


def _flux2_klein(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                 common: dict[str, Any]) -> Reference:
    """The pipeline's negative prompt is always "" (no argument takes one); a job's own is
    handed in as ``negative_prompt_embeds`` from the pipeline's own ``encode_prompt``."""
    pipe = _quiet(Flux2KleinPipeline(scheduler=scheduler, vae=c.vae, text_encoder=c.text_encoder,
                                     tokenizer=c.tokenizer, transformer=c.transformer))
    call = _text(c, p)
    negative = pipe.encode_prompt(call.pop("negative_prompt"), device=c.device,
                                  max_sequence_length=c.recipe.text_max_length)[0]
    return _kept(pipe, "images", negative_prompt_embeds=negative, **call, **common)


def _hunyuan_video15(c: DiffusionComponents, p: Mapping[str, Any], scheduler: Any,
                     common: dict[str, Any]) -> Reference:
    """The guidance scale is the pipeline's guider's; the pipeline takes no step callback, so
    only its frames are compared (bit for bit, as the other families' pixels)."""
    common = dict(common)
    guider = ClassifierFreeGuidance(guidance_scale=common.pop("guidance_scale"))
    pipe = _quiet(HunyuanVideo15Pipeline(
        text_encoder=c.text_encoder, tokenizer=c.tokenizer, transformer=c.transformer, vae=c.vae,
        scheduler=scheduler, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
        guider=guider))
    return Reference(None, pipe(prompt=p["prompt"], negative_prompt=p["negative_prompt"],
                                height=p["height"], width=p["width"],
                                num_frames=p["num_frames"], output_type="pt", **common).frames)


def _kept(pipe: Any, output: str, **call: Any) -> Reference:
    """``pipe(**call)`` keeping its last step's latents, with its ``output`` (images, frames)."""
    keep = _Keep()
    pixels = getattr(pipe(callback_on_step_end=keep, **call), output)
    assert keep.latents is not None
    return Reference(keep.latents, pixels)


CALLS: dict[str, Call] = {
    "dit": _dit,
    "pixart": _pixart,
    "wan": _wan,
    "wan22": _wan,  # WanPipeline with transformer_2 and boundary_ratio
    "wan22_i2v": _wan_i2v,  # WanImageToVideoPipeline, the same, no image encoder
    "flux": _flux_call(FluxPipeline),
    "flux_kontext": _flux_kontext,  # an edit model: every job has an image
    "sd3": _sd3_call(StableDiffusion3Pipeline),
    "qwen_image": _qwen_call(QwenImagePipeline),
    "zimage": _zimage,
    "flux2_klein": _flux2_klein,
    "hunyuan_video15": _hunyuan_video15,
}
"""Each family's pipeline ``__call__`` on the recipe's own modules."""
IMAGE_CALLS: dict[str, Call] = {
    "flux": _flux_call(FluxImg2ImgPipeline),
    "sd3": _sd3_call(StableDiffusion3Img2ImgPipeline),
    "qwen_image": _qwen_call(QwenImageImg2ImgPipeline),
}
"""Each family's img2img pipeline ``__call__``, for a job with an input image (PixArt has
none in the library: its img2img reference is assembled in ``test_diffusion_img2img``)."""
MASK_CALLS: dict[str, Call] = {
    "flux": _flux_call(FluxInpaintPipeline),
    "sd3": _sd3_call(StableDiffusion3InpaintPipeline),
    "qwen_image": _qwen_call(QwenImageInpaintPipeline),
}
"""Each family's inpaint pipeline ``__call__``, for a job with an input image and a mask (an
``L`` mask, handed to the pipeline as the job's bytes decode)."""
CONTROL_CALLS: dict[str, Call] = {
    "sd3": _sd3_controlnet,
}
"""Each family's ControlNet pipeline ``__call__``, for a job that names a ControlNet."""


def _as_built(scheduler: Any, _gen: torch.Generator) -> Any:
    return scheduler


def reference_run(c: DiffusionComponents, p: Mapping[str, Any],
                  prepare: Callable[[Any, torch.Generator], Any] = _as_built) -> Reference:
    """The library pipeline run in one go on job ``p`` (its img2img pipeline for a job with an
    input image), its generator seeded with the job's seed, on a fresh scheduler of the job's
    sampler (``prepare``: what the caller does to it first, given the generator)."""
    gen = torch.Generator().manual_seed(int(p["seed"]))
    scheduler = prepare(c.scheduler(str(p["scheduler"]), int(p["seed"])), gen)
    common = {"num_inference_steps": p["num_inference_steps"],
              "guidance_scale": p["guidance_scale"], "generator": gen}
    if p.get("controlnet") is not None:
        return CONTROL_CALLS[c.recipe.family](c, p, scheduler, common)
    if not is_conditioned(p):
        return CALLS[c.recipe.family](c, p, scheduler, common)
    with Image.open(io.BytesIO(p[INPUT_BYTES]["image"])) as opened:
        image = opened.convert("RGB")
    conditioned = {**common, "image": image, "strength": p["strength"]}
    if p.get("mask") is None:
        return IMAGE_CALLS[c.recipe.family](c, p, scheduler, conditioned)
    with Image.open(io.BytesIO(p[INPUT_BYTES]["mask"])) as opened:
        mask = opened.convert("L")
    return MASK_CALLS[c.recipe.family](c, p, scheduler, {**conditioned, "mask_image": mask})
