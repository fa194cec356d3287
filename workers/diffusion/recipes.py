"""Typed diffusion recipes (kinds ``image`` and ``video``) parsed from the model registry.

Torch-free: the API validates job parameters against these without loading a model.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.diffusion.samplers import missing_package, refusal
from workers.errors import ModelConfigError
from workers.registry import ModelRegistry, RecipeFile, default_registry

DIFFUSION_KINDS = ("image", "video")
EXPERT_FAMILIES = frozenset({"wan22", "wan22_i2v"})
"""Families of two expert transformers switched at a ``boundary_ratio`` (Wan 2.2)."""


class ComponentSpec(BaseModel):
    """A diffusers or transformers class and the small config it is built with."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    class_name: str = Field(alias="class")
    """Class name exported by ``diffusers`` or ``transformers`` (e.g. ``DiTTransformer2DModel``)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Constructor / config kwargs."""


class TextEncoderSpec(ComponentSpec):
    """A text encoder: a transformers class, its config and, optionally, the seed of its random
    weights. Two recipes whose encoder has the same class, config, seed and tokenizer build
    bit-identical ones, which a worker holds once (``workers.diffusion.components``)."""

    seed: int | None = Field(default=None, ge=0)
    """Seed of its random weights; none: the recipe's ``seed`` + 2 + its slot (0, 1, 2 for
    ``text_encoder``, ``_2``, ``_3``). Give the seed another recipe's encoder is built from to
    share that encoder (Wan 2.2 reads its prompt with Wan 2.1's UMT5)."""


class TokenizerSpec(BaseModel):
    """A tokenizer built in-process (nothing is downloaded): one token per character."""

    model_config = ConfigDict(extra="forbid")

    alphabet: str = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-"
    """Characters with their own id; anything else maps to ``<unk>``."""
    chat_template: str | None = None
    """A Jinja chat template, for a pipeline that wraps its prompt with
    ``apply_chat_template`` (Z-Image's Qwen3); none: the tokenizer has no template."""


class ControlNetSpec(BaseModel):
    """A ControlNet a recipe accepts (``SD3ControlNetModel``): its small config and seed, or a
    local ``save_pretrained`` folder (``weights``, relative to the recipe). A worker holds it
    as a residency item of its own, keyed by its content (:mod:`workers.diffusion.controlnet`).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    class_name: Literal["SD3ControlNetModel"] = Field(default="SD3ControlNetModel", alias="class")
    config: dict[str, Any] = Field(default_factory=dict)
    """Constructor kwargs of its seeded random build (ignored with ``weights``)."""
    seed: int = Field(default=0, ge=0)
    """Seed of its random weights."""
    weights: str | None = None
    """A local folder written by ``SD3ControlNetModel.save_pretrained`` to load instead."""
    description: str = ""


CONTROLNET_FAMILIES = frozenset({"sd3"})
"""Families whose recipes may declare ControlNets (``StableDiffusion3ControlNetPipeline``)."""


class CostUnits(BaseModel):
    """Relative cost of each chunk, a denoising step being about 1."""

    model_config = ConfigDict(extra="forbid")

    encode: float = Field(default=0.1, gt=0)
    """Prompt or class embedding plus noise init."""
    denoise: float = Field(default=1.0, gt=0)
    """One denoising step (all CFG passes)."""
    decode: float = Field(default=0.5, gt=0)
    """VAE decode and artifact encoding."""


class DiffusionRecipe(BaseModel):
    """Everything needed to build a tiny (or local) DiT pipeline and to check job parameters."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["image", "video"]
    family: Literal["dit", "pixart", "wan", "wan22", "wan22_i2v", "sd3", "flux", "flux_kontext",
                    "qwen_image", "zimage",
                    "flux2_klein",
                    "hunyuan_video15"]
    """Which pipeline's arithmetic the runner reproduces (DiTPipeline, PixArt, WanPipeline;
    ``wan22``: WanPipeline with two expert transformers; ``wan22_i2v``: Wan 2.2's
    WanImageToVideoPipeline, two experts and no image encoder; ``sd3``: StableDiffusion3Pipeline;
    ``flux``: FluxPipeline; ``flux_kontext``: FluxKontextPipeline; ``qwen_image``:
    QwenImagePipeline; ``zimage``: ZImagePipeline;
    ``flux2_klein``: Flux2KleinPipeline;
    ``hunyuan_video15``: HunyuanVideo15Pipeline)."""
    description: str = ""
    default: bool = False
    """The default recipe of its kind for its conditioning (class label or prompt)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the random initial weights, so every worker builds identical ones."""
    weights: str | None = None
    """A local ``save_pretrained`` pipeline folder to load instead (relative to the recipe)."""
    vae_scale_factor: int = Field(ge=1)
    """Pixels per latent cell, spatially."""
    temporal_scale_factor: int = Field(default=1, ge=1)
    """Frames per latent frame after the first (video: num_frames = k * factor + 1)."""
    patch_size: int = Field(ge=1)
    """Latent cells per transformer patch, spatially."""
    default_height: int = Field(gt=0)
    default_width: int = Field(gt=0)
    min_size_px: int = Field(gt=0)
    max_size_px: int = Field(gt=0)
    square_only: bool = False
    """DiT unpatchifies square grids only."""
    default_frames: int = Field(default=1, ge=1)
    max_frames: int = Field(default=1, ge=1)
    text_max_length: int = Field(default=16, ge=1)
    """Tokens per prompt (padded): the pipelines' ``max_sequence_length``."""
    default_steps: int = Field(default=4, ge=1)
    max_steps: int = Field(default=200, ge=1)
    default_guidance_scale: float = Field(default=4.0, ge=0)
    default_scheduler: str
    schedulers: dict[str, ComponentSpec]
    """Sampler name -> scheduler class and config (beyond diffusers' defaults); each one must run
    exactly for the family (:func:`workers.diffusion.samplers.refusal`)."""
    transformer: ComponentSpec
    transformer_2: ComponentSpec | None = None
    """Wan 2.2's low-noise expert (diffusers' ``transformer_2``), beside the high-noise
    ``transformer``; steps below ``boundary_ratio`` × num_train_timesteps run it."""
    boundary_ratio: float | None = Field(default=None, gt=0, lt=1)
    """WanPipeline's ``boundary_ratio``: where a two-expert recipe switches transformers."""
    vae: ComponentSpec
    text_encoder: TextEncoderSpec | None = None
    tokenizer: TokenizerSpec | None = None
    text_encoder_2: TextEncoderSpec | None = None
    """A second text encoder (Stable Diffusion 3's second CLIP; Flux's T5 beside its CLIP),
    with ``tokenizer_2``."""
    tokenizer_2: TokenizerSpec | None = None
    text_encoder_3: TextEncoderSpec | None = None
    """A third text encoder (Stable Diffusion 3's T5), with ``tokenizer_3``."""
    tokenizer_3: TokenizerSpec | None = None
    class_names: Literal["imagenet"] | None = None
    """The names of a class-conditioned recipe's labels, so a prompt may name its class:
    ``imagenet`` (the 1000 ImageNet classes, workers/diffusion/labels.py); none: ids only."""
    unavailable_schedulers: dict[str, str] = Field(default_factory=dict)
    """Samplers of the recipe this machine cannot build (a missing optional package), with the
    reason; set by the loader, which leaves them out of ``schedulers``."""
    controlnets: dict[str, ControlNetSpec] = Field(default_factory=dict)
    """ControlNets a job of the recipe may name (``params.controlnet``), by name."""
    cost_units: CostUnits = Field(default_factory=CostUnits)
    source_dir: Path = Path(".")
    """Folder of the recipe file, for a relative ``weights`` path (set by the loader)."""

    @property
    def conditioning(self) -> Literal["class", "text"]:
        return "class" if self.family == "dit" else "text"

    @property
    def two_experts(self) -> bool:
        """Its steps switch between two transformers (Wan 2.2's high- and low-noise experts)."""
        return self.transformer_2 is not None

    @property
    def num_classes(self) -> int:
        return int(self.transformer.config.get("num_embeds_ada_norm", 1000))

    @property
    def size_multiple_px(self) -> int:
        return self.vae_scale_factor * self.patch_size

    @property
    def native_size_px(self) -> int:
        """The one size DiTPipeline makes: the transformer's sample_size in pixels."""
        return int(self.transformer.config.get("sample_size", 0)) * self.vae_scale_factor

    @property
    def weights_dir(self) -> Path | None:
        return None if self.weights is None else self.source_dir / self.weights


def parse_recipe(recipe: RecipeFile) -> DiffusionRecipe:
    """Validate one registry entry as a diffusion recipe."""
    data = {**recipe.spec, "name": recipe.name, "source_dir": recipe.path.parent}
    try:
        parsed = DiffusionRecipe.model_validate(data)
    except ValidationError as exc:
        raise ModelConfigError(f"model recipe {recipe.path} is invalid: {exc}") from exc
    if parsed.default_scheduler not in parsed.schedulers:
        raise ModelConfigError(
            f"model recipe {recipe.path}: default_scheduler {parsed.default_scheduler!r} "
            f"is not one of its schedulers ({', '.join(parsed.schedulers)})"
        )
    for name, spec in parsed.schedulers.items():
        reason = refusal(parsed.family, spec.class_name, spec.config)
        if reason is not None:
            raise ModelConfigError(f"model recipe {recipe.path}: scheduler {name!r} is refused: "
                                   f"{reason}")
    _check_dit_sizes(parsed, recipe.path)
    _check_experts(parsed, recipe.path)
    _check_text_parts(parsed, recipe.path)
    if parsed.controlnets and parsed.family not in CONTROLNET_FAMILIES:
        raise ModelConfigError(f"model recipe {recipe.path}: family {parsed.family!r} takes no "
                               "controlnets; only the families "
                               f"{', '.join(sorted(CONTROLNET_FAMILIES))} do")
    return _without_unbuildable(parsed, recipe.path)


def _without_unbuildable(r: DiffusionRecipe, path: Path) -> DiffusionRecipe:
    """Set aside the samplers whose optional package is missing, keeping the reason."""
    missing = {name: reason for name, spec in r.schedulers.items()
               if (reason := missing_package(spec.class_name)) is not None}
    if r.default_scheduler in missing:
        raise ModelConfigError(f"model recipe {path}: default scheduler "
                               f"{r.default_scheduler!r}: {missing[r.default_scheduler]}")
    offered = {name: spec for name, spec in r.schedulers.items() if name not in missing}
    return r.model_copy(update={"schedulers": offered, "unavailable_schedulers": missing})


def _check_dit_sizes(r: DiffusionRecipe, path: Path) -> None:
    """DiTPipeline draws latents of the transformer's sample_size only: one square size."""
    sizes = {r.min_size_px, r.max_size_px, r.default_height, r.default_width}
    if r.family == "dit" and sizes != {r.native_size_px}:
        raise ModelConfigError(
            f"model recipe {path}: a DiT makes {r.native_size_px} px images only (transformer "
            f"sample_size x vae_scale_factor); set every size to {r.native_size_px}"
        )


def _check_experts(r: DiffusionRecipe, path: Path) -> None:
    """A ``wan22`` or ``wan22_i2v`` recipe has both experts and their boundary; no other recipe
    has either."""
    two = r.transformer_2 is not None and r.boundary_ratio is not None
    half = (r.transformer_2 is None) != (r.boundary_ratio is None)
    if two != (r.family in EXPERT_FAMILIES) or half:
        raise ModelConfigError(
            f"model recipe {path}: family {r.family!r} with transformer_2 "
            f"{'set' if r.transformer_2 else 'unset'} and boundary_ratio {r.boundary_ratio}; "
            "families wan22 and wan22_i2v take both, every other family neither")


def _check_text_parts(r: DiffusionRecipe, path: Path) -> None:
    """Each text encoder comes with its tokenizer; ``sd3`` needs both CLIPs (its T5 may be
    left out: the pipeline then conditions on zeros in its place)."""
    for suffix in ("", "_2", "_3"):
        encoder, tokenizer = getattr(r, f"text_encoder{suffix}"), getattr(r, f"tokenizer{suffix}")
        if (encoder is None) != (tokenizer is None):
            raise ModelConfigError(f"model recipe {path}: text_encoder{suffix} and "
                                   f"tokenizer{suffix} go together; give both or neither")
    if r.family == "sd3" and (r.text_encoder is None or r.text_encoder_2 is None):
        raise ModelConfigError(f"model recipe {path}: family sd3 needs text_encoder and "
                               "text_encoder_2 (its two CLIP encoders)")


_PARSED: weakref.WeakKeyDictionary[ModelRegistry, dict[str, DiffusionRecipe]] = (
    weakref.WeakKeyDictionary())
"""Parsed recipes per registry, dropped with it: keyed by the object, never by ``id()``, which a
later registry may reuse once this one is collected."""


def diffusion_recipe(name: str, registry: ModelRegistry | None = None) -> DiffusionRecipe:
    """The parsed recipe called ``name`` (cached per registry)."""
    reg = registry or default_registry()
    parsed = _PARSED.setdefault(reg, {})
    if name not in parsed:
        entry = reg.get(name)
        if entry.kind not in DIFFUSION_KINDS:
            raise ModelConfigError(f"model {name!r} is a {entry.kind} model, not image or video")
        parsed[name] = parse_recipe(entry)
    return parsed[name]


def diffusion_recipes(kind: str, registry: ModelRegistry | None = None) -> list[DiffusionRecipe]:
    """Every recipe of one kind, by name."""
    reg = registry or default_registry()
    return [diffusion_recipe(name, reg) for name in sorted(reg.names(kind))]
