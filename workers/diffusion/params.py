"""Job parameters of image and video jobs, checked against the model recipe without torch.

:func:`validate_params` fills every default, so a runner and the cost model see one shape;
a :class:`ParamsError` says what was wrong and what to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.diffusion.adapters import (
    MAX_ADAPTERS_PER_JOB,
    AdapterChoice,
    AdapterRegistry,
    adapter_registry,
    check_adapters,
)
from workers.diffusion.cache_params import REFUSED_FAMILIES, StepCacheParams
from workers.diffusion.inputs import (
    CONTROL_FIELDS,
    DEFAULT_STRENGTH,
    DIGEST_PATTERN,
    EDIT_FAMILIES,
    FIRST_FRAME_FAMILIES,
    IMAGE_FAMILIES,
    MASK_FAMILIES,
    check_control,
    check_image_sampler,
    check_strength,
)
from workers.diffusion.labels import closest_names, imagenet_labels, resolve_class
from workers.diffusion.recipes import (
    DIFFUSION_KINDS,
    DiffusionRecipe,
    diffusion_recipe,
    diffusion_recipes,
)
from workers.diffusion.samplers import COMMON_SAMPLERS, sampler_refusal, step_limit
from workers.errors import ModelConfigError, ParamsError
from workers.registry import ModelRegistry

IMAGE_FORMATS = ("png", "webp")
VIDEO_FORMATS = ("mp4", "gif", "webp")
_CLASS_NAME_SETS = {"imagenet": "ImageNet"}
_TRUE_CFG_FAMILIES = ("flux", "flux_kontext", "qwen_image")
"""Families whose CFG is ``true_cfg_scale`` (a negative pass above 1): guidance-distilled ones
(Flux, Flux Kontext), whose ``guidance_scale`` is embedded, and Qwen-Image, which has no
``guidance_scale``."""


class DiffusionParams(BaseModel):
    """Parameters of one image or video job; ``None`` means the recipe's default."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """Recipe name (``configs/models``); default: the kind's default for the conditioning."""
    prompt: str | None = Field(default=None, max_length=2000)
    """Text prompt (text-conditioned models)."""
    negative_prompt: str = Field(default="", max_length=2000)
    """What to steer away from under classifier-free guidance."""
    class_label: int | None = Field(default=None, ge=0)
    """Class id (class-conditioned models such as DiT)."""
    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, gt=0)
    num_inference_steps: int | None = None
    guidance_scale: float | None = Field(default=None, ge=0, le=50)
    """CFG scale; 1 or less disables guidance."""
    guidance_scale_2: float | None = Field(default=None, ge=0, le=50)
    """CFG scale of the low-noise expert's steps (two-expert models such as Wan 2.2 only);
    default: ``guidance_scale``. Whether CFG runs is ``guidance_scale``'s alone."""
    true_cfg_scale: float | None = Field(default=None, ge=0, le=50)
    """True classifier-free guidance of a guidance-distilled model (Flux) or of Qwen-Image: above
    1 each step also runs the negative prompt; default 1 (off). ``guidance_scale`` there is the
    distilled guidance the transformer embeds (Qwen-Image has none: it is ignored)."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    scheduler: str | None = None
    output_format: str | None = None
    """png or webp for images; mp4, gif or webp for video."""
    adapters: list[AdapterChoice] = Field(default_factory=list, max_length=MAX_ADAPTERS_PER_JOB)
    """LoRA adapters of the model (``GET /v1/adapters``) applied in this order, each at its
    scale; none: the base model."""
    step_cache: StepCacheParams | None = None
    """A step cache (``{"kind": "first_block", "threshold": 0.05}``): faster steps whose output
    differs from the uncached run's; none: every block of every step runs."""
    image: str | None = Field(default=None, pattern=DIGEST_PATTERN)
    """Input image to start from (image-to-image), or the first frame of an image-to-video
    model's video (which needs one), by the digest the artifact store keeps it under
    (``sha256:<hex>``; the API turns an uploaded or base64 image into it)."""
    mask: str | None = Field(default=None, pattern=DIGEST_PATTERN)
    """Inpainting mask of ``image`` (same size, one channel), by digest."""
    strength: float | None = Field(default=None, gt=0, le=1)
    """How far from the image the job may go: the share of its steps it runs (img2img's
    rule); default 0.8. Only with ``image``."""
    controlnet: str | None = Field(default=None, min_length=1, max_length=128)
    """A ControlNet the model's recipe declares (``/v1/models`` lists them); with
    ``control_image``."""
    control_image: str | None = Field(default=None, pattern=DIGEST_PATTERN)
    """The ControlNet's control image (PNG, JPEG or WebP; resized to the job's size), by
    digest."""
    controlnet_conditioning_scale: float | None = Field(default=None, ge=0, le=10)
    """Multiplies the ControlNet's residuals; default 1.0 (the pipeline's)."""
    control_guidance_start: float | None = Field(default=None, ge=0, lt=1)
    """The share of the steps before the ControlNet acts; default 0."""
    control_guidance_end: float | None = Field(default=None, gt=0, le=1)
    """The share of the steps after which it stops; default 1 (every step)."""


def _describe(exc: ValidationError) -> str:
    parts = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return "invalid diffusion parameters: " + "; ".join(parts)


def _pick_model(kind: str, p: DiffusionParams, registry: ModelRegistry | None) -> DiffusionRecipe:
    if kind not in DIFFUSION_KINDS:
        raise ParamsError(f"kind {kind!r} is not a diffusion kind; use image or video")
    try:
        if p.model is not None:
            recipe = diffusion_recipe(p.model, registry)
        else:
            return _default_model(kind, p, registry)
    except ModelConfigError as exc:
        raise ParamsError(str(exc)) from exc
    if recipe.kind != kind:
        raise ParamsError(f"model {recipe.name!r} makes {recipe.kind}s; submit kind={recipe.kind}")
    return recipe


def _default_model(
    kind: str, p: DiffusionParams, registry: ModelRegistry | None
) -> DiffusionRecipe:
    wanted = "class" if p.class_label is not None and p.prompt is None else "text"
    first_frame = kind == "video" and p.image is not None  # image-to-video: a model that needs one
    candidates = [r for r in diffusion_recipes(kind, registry) if r.conditioning == wanted
                  and (r.family in FIRST_FRAME_FAMILIES) == first_frame]
    if not candidates:
        raise ParamsError(f"no {kind} model takes a {wanted} condition; pass model= explicitly")
    return sorted(candidates, key=lambda r: (not r.default, r.name))[0]


def _nearest_multiples(value: int, multiple: int, low: int, high: int) -> str:
    below = max(low, value // multiple * multiple)
    above = min(high, below + multiple)
    return f"{below} or {above}" if below != above else f"{below}"


def _check_size(name: str, value: int, r: DiffusionRecipe) -> None:
    if r.min_size_px == r.max_size_px and value != r.min_size_px:
        raise ParamsError(
            f"{name}={value} does not fit model {r.name!r}: it makes {r.min_size_px} px images "
            f"only (the transformer's native size); use {r.min_size_px}"
        )
    m = r.size_multiple_px
    if value % m or not r.min_size_px <= value <= r.max_size_px:
        hint = _nearest_multiples(min(max(value, r.min_size_px), r.max_size_px), m,
                                  r.min_size_px, r.max_size_px)
        raise ParamsError(
            f"{name}={value} does not fit model {r.name!r} (multiples of {m} px from "
            f"{r.min_size_px} to {r.max_size_px}); use {hint}"
        )


def _check_frames(frames: int, r: DiffusionRecipe) -> None:
    if r.kind == "image":
        if frames != 1:
            raise ParamsError(f"model {r.name!r} makes images; use num_frames=1 or kind=video")
        return
    f = r.temporal_scale_factor
    if (frames - 1) % f or frames > r.max_frames:
        k = min((frames - 1) // f, (r.max_frames - 1) // f)
        above = (k + 1) * f + 1
        hint = f"{k * f + 1} or {above}" if above <= r.max_frames else f"{k * f + 1}"
        raise ParamsError(
            f"num_frames={frames} does not fit model {r.name!r} (a multiple of {f} plus 1, at most "
            f"{r.max_frames}); use {hint}"
        )


def _check_condition(p: DiffusionParams, r: DiffusionRecipe) -> DiffusionParams:
    """``p`` with its condition checked; on a class-conditioned recipe with class names, a
    prompt that names a class becomes that class's label."""
    if r.conditioning == "class":
        if p.prompt is not None and p.class_label is None:
            p = p.model_copy(update={"class_label": _class_of_prompt(p.prompt, r),
                                     "prompt": None})
        if p.class_label is None or p.prompt is not None:
            raise ParamsError(
                f"model {r.name!r} is class-conditioned; pass class_label, not prompt")
        if p.class_label >= r.num_classes:
            raise ParamsError(f"class_label must be below {r.num_classes} for model {r.name!r}")
    elif p.prompt is None or p.class_label is not None:
        raise ParamsError(f"model {r.name!r} is text-conditioned; pass prompt, not class_label")
    return p


def _class_of_prompt(prompt: str, r: DiffusionRecipe) -> int:
    """The class id ``prompt`` names on ``r``; a :class:`ParamsError` with the closest names
    when it names none (or ``r`` names no classes)."""
    if r.class_names is None:
        raise ParamsError(f"model {r.name!r} is class-conditioned and names no classes; pass "
                          "class_label (an id), not prompt")
    labels = imagenet_labels()
    found = resolve_class(prompt, labels)
    if found is not None:
        return found
    close = closest_names(prompt, labels)
    hint = f"closest: {', '.join(repr(n) for n in close)}" if close else "no class is close"
    raise ParamsError(f"model {r.name!r} is class-conditioned: the prompt must name one of its "
                      f"{_CLASS_NAME_SETS[r.class_names]} classes, and {prompt[:80]!r} names "
                      f"none ({hint}); or pass class_label")


def _check_steps_and_scheduler(steps: int, scheduler: str, r: DiffusionRecipe) -> None:
    if not 1 <= steps <= r.max_steps:
        raise ParamsError(
            f"num_inference_steps={steps} is out of range; use 1 to {r.max_steps} "
            f"(default {r.default_steps})"
        )
    spec = r.schedulers.get(scheduler)
    if spec is None:
        raise ParamsError(_scheduler_refusal(scheduler, r))
    limit = step_limit(spec.class_name, spec.config)
    if limit is not None and steps > limit:
        raise ParamsError(
            f"num_inference_steps={steps} is more than scheduler {scheduler!r} takes "
            f"({spec.class_name} samples at most its original_inference_steps); use 1 to {limit}"
        )


def _scheduler_refusal(scheduler: str, r: DiffusionRecipe) -> str:
    offered = ", ".join(sorted(r.schedulers))
    reason = r.unavailable_schedulers.get(scheduler) or sampler_refusal(r.family, scheduler)
    if reason is not None:
        return (f"scheduler {scheduler!r} is refused for model {r.name!r}: {reason}; use one of "
                f"{offered}")
    known = "is not offered" if scheduler in COMMON_SAMPLERS else "is unknown"
    return f"scheduler {scheduler!r} {known} for model {r.name!r}; use one of {offered}"


def _check_format(fmt: str, r: DiffusionRecipe) -> None:
    formats = IMAGE_FORMATS if r.kind == "image" else VIDEO_FORMATS
    if fmt not in formats:
        raise ParamsError(
            f"output_format {fmt!r} is not offered for {r.kind}s; use {', '.join(formats)}")


def validate_params(
    kind: str, params: Mapping[str, Any], registry: ModelRegistry | None = None,
    adapters: AdapterRegistry | None = None,
) -> dict[str, Any]:
    """Normalise ``params`` for ``kind``: every default filled; raises :class:`ParamsError`.
    ``adapters`` is the registry the job's adapters must be in (default: ``configs/adapters``);
    a job without adapters carries no ``adapters`` key, as before adapters existed (nor one
    without a step cache a ``step_cache`` key)."""
    try:
        p = DiffusionParams.model_validate(dict(params))
    except ValidationError as exc:
        raise ParamsError(_describe(exc)) from exc
    r = _pick_model(kind, p, registry)
    p = _check_condition(p, r)
    height, width = p.height or r.default_height, p.width or r.default_width
    _check_size("height", height, r)
    _check_size("width", width, r)
    if r.square_only and height != width:
        raise ParamsError(f"model {r.name!r} makes square images only; use height=width={height}")
    frames = p.num_frames or r.default_frames
    _check_frames(frames, r)
    steps = r.default_steps if p.num_inference_steps is None else p.num_inference_steps
    scheduler = p.scheduler or r.default_scheduler
    _check_steps_and_scheduler(steps, scheduler, r)
    fmt = p.output_format or ("png" if r.kind == "image" else "mp4")
    _check_format(fmt, r)
    if p.step_cache is not None and r.family in REFUSED_FAMILIES:
        raise ParamsError(f"model {r.name!r} takes no step_cache: {REFUSED_FAMILIES[r.family]}")
    guidance = r.default_guidance_scale if p.guidance_scale is None else p.guidance_scale
    chosen = check_adapters(p.adapters, r.name, adapters or adapter_registry())
    inputs = _check_inputs(p, r, steps, scheduler)
    control = check_control(p.model_dump(include=set(CONTROL_FIELDS)), r.name, r.controlnets,
                            bool(inputs) or p.step_cache is not None)
    normal = p.model_copy(update={
        "model": r.name, "height": height, "width": width, "num_frames": frames,
        "num_inference_steps": steps, "scheduler": scheduler, "output_format": fmt,
        "guidance_scale": float(guidance), **_second_guidance(p, r, float(guidance)),
        **_true_cfg(p, r), **inputs, **control,
    }).model_dump(exclude={"adapters"} | (set() if r.two_experts else {"guidance_scale_2"})
                  | (set() if p.step_cache else {"step_cache"})
                  | (set() if r.family in _TRUE_CFG_FAMILIES else {"true_cfg_scale"})
                  | ({"image", "mask", "strength"} - set(inputs))
                  | (CONTROL_FIELDS - set(control)))
    return {**normal, "adapters": chosen} if chosen else normal


def _second_guidance(p: DiffusionParams, r: DiffusionRecipe, guidance: float) -> dict[str, float]:
    """``guidance_scale_2`` of a two-expert model (default ``guidance``, as WanPipeline sets
    it); refused on any other model, as the pipeline refuses it without a ``boundary_ratio``."""
    if not r.two_experts:
        if p.guidance_scale_2 is not None:
            raise ParamsError(f"guidance_scale_2 is for two-expert models (Wan 2.2); model "
                              f"{r.name!r} has one transformer: use guidance_scale")
        return {}
    return {"guidance_scale_2": guidance if p.guidance_scale_2 is None
            else float(p.guidance_scale_2)}


def _true_cfg(p: DiffusionParams, r: DiffusionRecipe) -> dict[str, float]:
    """``true_cfg_scale`` of a guidance-distilled model or Qwen-Image (default 1.0: off);
    refused on any other model, whose ``guidance_scale`` is already classifier-free."""
    if r.family not in _TRUE_CFG_FAMILIES:
        if p.true_cfg_scale is not None:
            raise ParamsError(f"true_cfg_scale is for guidance-distilled models (Flux) and "
                              f"Qwen-Image; model {r.name!r} runs classifier-free guidance: "
                              "use guidance_scale")
        return {}
    return {"true_cfg_scale": 1.0 if p.true_cfg_scale is None else float(p.true_cfg_scale)}


def _check_inputs(p: DiffusionParams, r: DiffusionRecipe, steps: int, scheduler: str
                  ) -> dict[str, Any]:
    """The job's input image, mask and strength, each refused on a model that takes none; a
    job without an image carries none of them, as before inputs existed. An edit model and an
    image-to-video model require the image and take neither mask nor strength."""
    if r.family in EDIT_FAMILIES:
        return _check_edit_inputs(p, r)
    if r.family in FIRST_FRAME_FAMILIES:
        return _check_first_frame(p, r)
    if p.image is None:
        if p.mask is not None or p.strength is not None:
            raise ParamsError("mask and strength condition an input image; pass image too")
        return {}
    if r.family not in IMAGE_FAMILIES:
        raise ParamsError(f"model {r.name!r} takes no input image (family {r.family}); models "
                          f"of the families {', '.join(sorted(IMAGE_FAMILIES))} do "
                          f"(image-to-image), and of {', '.join(sorted(FIRST_FRAME_FAMILIES))} "
                          "(image-to-video)")
    if p.mask is not None and r.family not in MASK_FAMILIES:
        raise ParamsError(f"model {r.name!r} takes no mask (it does image-to-image, not "
                          "inpainting); leave mask out, or use a model of the families "
                          f"{', '.join(sorted(MASK_FAMILIES))}")
    strength = DEFAULT_STRENGTH if p.strength is None else float(p.strength)
    check_strength(steps, strength, r.family)
    check_image_sampler(r.family, scheduler, {n: s.class_name for n, s in r.schedulers.items()})
    kept = {"image": p.image, "strength": strength}
    return kept if p.mask is None else {**kept, "mask": p.mask}


def _check_edit_inputs(p: DiffusionParams, r: DiffusionRecipe) -> dict[str, Any]:
    """An edit model's job: its image required (the model edits it), no mask, no strength."""
    if p.image is None:
        raise ParamsError(f"model {r.name!r} is an edit model: it edits an input image and "
                          "makes nothing without one; pass image (images.edit, or an uploaded "
                          "image's digest)")
    if p.mask is not None or p.strength is not None:
        raise ParamsError(f"model {r.name!r} is an edit model: its image conditions every step "
                          "whole, so it takes no mask and no strength; leave them out")
    return {"image": p.image}


def _check_first_frame(p: DiffusionParams, r: DiffusionRecipe) -> dict[str, Any]:
    """An image-to-video job's first frame: required; no mask, no strength (the image is a
    condition of every step, not a start that the steps noise)."""
    if p.image is None:
        raise ParamsError(f"model {r.name!r} makes video from an input image (image-to-video): "
                          "pass image, its first frame (PNG, JPEG or WebP; CLI --image)")
    if p.mask is not None or p.strength is not None:
        raise ParamsError(f"model {r.name!r} takes its image as the video's first frame: it "
                          "takes no mask and no strength (those are image-to-image's); leave "
                          "them out")
    return {"image": p.image}
