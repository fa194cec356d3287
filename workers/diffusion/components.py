"""Build a recipe's modules: seeded random weights, or a local folder; the process's model
residency (``workers.residency``) holds them under its memory budget.

Seeded construction means every worker process builds bit-identical weights, so a job can move
between workers; nothing is ever downloaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import diffusers
import torch
import transformers
from diffusers import ModelMixin, SchedulerMixin
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from workers.diffusion.recipes import ComponentSpec, DiffusionRecipe, TokenizerSpec
from workers.diffusion.samplers import seeded_key
from workers.errors import ModelConfigError
from workers.residency import Resident, module_tensors, process_residency

_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
_TEXT_PARTS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"),
               ("text_encoder_3", "tokenizer_3"))
"""Each text encoder with its tokenizer, by their diffusers component names (Stable Diffusion 3
has all three); text encoder ``i`` is built from ``seed + 2 + i``."""
_MODULES = ("transformer", "vae", "transformer_2", *(encoder for encoder, _ in _TEXT_PARTS))
"""The parts that are torch modules: moved, measured and put in eval mode together."""
_NO_TEXT: dict[str, Any] = {name: None for pair in _TEXT_PARTS for name in pair}


@dataclass(frozen=True, slots=True)
class DiffusionComponents:
    """The modules of one recipe, in eval mode, without gradients."""

    recipe: DiffusionRecipe
    transformer: Any  # a diffusers transformer model (ModelMixin)
    vae: Any  # a diffusers autoencoder (ModelMixin)
    text_encoder: Any | None  # a transformers encoder (PreTrainedModel)
    tokenizer: PreTrainedTokenizerFast | None
    device: torch.device
    transformer_dtype: torch.dtype = torch.float32
    """The transformer's dtype, read once at load: diffusers' ``ModelMixin.dtype`` walks the
    module's parameters on every call (~0.5 ms for a small model — a step's worth of
    overhead if read per step)."""
    transformer_2: Any | None = None
    """Wan 2.2's low-noise expert transformer (None: a one-transformer recipe)."""
    text_encoder_2: Any | None = None
    """A second text encoder (Stable Diffusion 3's second CLIP), with ``tokenizer_2``."""
    tokenizer_2: PreTrainedTokenizerFast | None = None
    text_encoder_3: Any | None = None
    """A third text encoder (Stable Diffusion 3's T5), with ``tokenizer_3``."""
    tokenizer_3: PreTrainedTokenizerFast | None = None

    def scheduler(self, name: str, seed: int = 0) -> Any:
        """A fresh scheduler of this recipe for a job of ``seed`` (state is per job)."""
        return build_scheduler(self.recipe, name, seed)


def build_scheduler(recipe: DiffusionRecipe, name: str, seed: int = 0) -> Any:
    """Sampler ``name`` of ``recipe``, untouched; a class that seeds its own noise source from its
    config (DPM++ SDE's Brownian tree) gets the job's ``seed`` there."""
    spec = recipe.schedulers[name]
    cls = resolve_class(spec.class_name, SchedulerMixin)
    config = dict(spec.config)
    key = seeded_key(spec.class_name)
    if key is not None:
        config[key] = seed
    return cls(**config)


_TIMED: dict[tuple[str, str, str, int], Any] = {}


def timed_scheduler(recipe: DiffusionRecipe, name: str, steps: int) -> Any:
    """Sampler ``name`` with its timesteps set for ``steps`` steps on the CPU, built once per
    process and shared (read it, never step it): what a job's timesteps are, without its models."""
    key = (recipe.name, str(recipe.source_dir), name, steps)
    if key not in _TIMED:
        scheduler = build_scheduler(recipe, name)
        # a dynamic shift (Flux's mu, from the image size) moves the timesteps, not their count
        shift = {"mu": 0.0} if scheduler.config.get("use_dynamic_shifting") else {}
        scheduler.set_timesteps(steps, **shift)
        _TIMED[key] = scheduler
    return _TIMED[key]


def model_evaluations(recipe: DiffusionRecipe, name: str, steps: int) -> int:
    """Model evaluations of a ``steps``-step run: ``len(timesteps)``, one per denoising loop
    iteration (2·steps − 1 for second-order samplers such as Heun, steps + 1 for PNDM)."""
    return len(timed_scheduler(recipe, name, steps).timesteps)


def resolve_class(name: str, base: type) -> Any:
    """A class exported by diffusers or transformers that subclasses ``base``; nothing else."""
    for module in (diffusers, transformers):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, base):
            return cls
    raise ModelConfigError(f"{name!r} is not a {base.__name__} class of diffusers or transformers")


def build_tokenizer(spec: TokenizerSpec, max_length: int) -> PreTrainedTokenizerFast:
    """A character tokenizer with T5's special tokens (pad 0, eos 1, unk 2) and the spec's chat
    template, built locally."""
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    vocab.update({ch: i + len(vocab) for i, ch in enumerate(dict.fromkeys(spec.alphabet))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_length, chat_template=spec.chat_template,
    )


def _seeded(seed: int, spec: ComponentSpec, base: type) -> Any:
    cls: Any = resolve_class(spec.class_name, base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if issubclass(cls, PreTrainedModel):
            return cls(cls.config_class(**spec.config))
        return cls(**spec.config)


def _build_random(recipe: DiffusionRecipe) -> dict[str, Any]:
    parts: dict[str, Any] = {
        "transformer": _seeded(recipe.seed, recipe.transformer, ModelMixin),
        "vae": _seeded(recipe.seed + 1, recipe.vae, ModelMixin),
        **_NO_TEXT,
    }
    for offset, (encoder, tokenizer) in enumerate(_TEXT_PARTS):
        spec, words = getattr(recipe, encoder), getattr(recipe, tokenizer)
        if spec is not None:
            parts[encoder] = _seeded(recipe.seed + 2 + offset, spec, PreTrainedModel)
        if words is not None:
            parts[tokenizer] = build_tokenizer(words, recipe.text_max_length)
    if recipe.transformer_2 is not None:
        parts["transformer_2"] = _seeded(recipe.seed + 5, recipe.transformer_2, ModelMixin)
    return parts


def _own_storage(module: torch.nn.Module) -> None:
    """Copy ``module``'s parameters and buffers out of the loaded file into fresh tensors. A
    tensor read from a safetensors file can start at an unaligned address, where CPU kernels
    take another path and round differently from the same weights built in memory (measured:
    a Wan transformer forward 4.8e-7 apart with every weight equal). Tied weights stay tied."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.clone()
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[name] = buffer.clone()


def _load_local(recipe: DiffusionRecipe) -> dict[str, Any]:
    folder = recipe.weights_dir
    if folder is None or not (folder / "model_index.json").is_file():
        raise ModelConfigError(
            f"model {recipe.name!r}: weights folder {folder} is not a saved pipeline "
            "(no model_index.json); write it with pipeline.save_pretrained(folder)"
        )
    parts: dict[str, Any] = {
        "transformer": resolve_class(recipe.transformer.class_name, ModelMixin).from_pretrained(
            folder, subfolder="transformer"),
        "vae": resolve_class(recipe.vae.class_name, ModelMixin).from_pretrained(
            folder, subfolder="vae"),
        **_NO_TEXT,
    }
    for encoder, tokenizer in _TEXT_PARTS:  # each in its subfolder, as save_pretrained writes
        spec = getattr(recipe, encoder)
        if spec is not None:
            cls = resolve_class(spec.class_name, PreTrainedModel)
            parts[encoder] = cls.from_pretrained(folder / encoder)
        if getattr(recipe, tokenizer) is not None:
            parts[tokenizer] = PreTrainedTokenizerFast.from_pretrained(folder / tokenizer)
    if recipe.transformer_2 is not None:
        parts["transformer_2"] = resolve_class(
            recipe.transformer_2.class_name, ModelMixin).from_pretrained(
                folder, subfolder="transformer_2")
    for key in _MODULES:
        if parts.get(key) is not None:
            _own_storage(parts[key])
    return parts


def build_components(recipe: DiffusionRecipe, device: str = "cpu") -> DiffusionComponents:
    """Build (never cached) the recipe's modules on ``device``."""
    parts = _build_random(recipe) if recipe.weights is None else _load_local(recipe)
    dev = torch.device(device)
    for key in _MODULES:
        if parts.get(key) is not None:
            parts[key] = parts[key].to(dev).eval().requires_grad_(False)
    return DiffusionComponents(recipe=recipe, device=dev, **parts,
                               transformer_dtype=parts["transformer"].dtype)


_CACHE_LOCK = threading.Lock()
_BASELINES: dict[tuple[str, str, str, str, int, int, str], Any] = {}
_BASELINES_MAX = 64


def scheduler_baseline(c: DiffusionComponents, name: str, seed: int, steps: int,
                       set_up: Callable[[Any], None], size: str = "") -> Any:
    """Sampler ``name`` built for a job of ``seed`` and set up by ``set_up`` for ``steps`` steps
    (its timesteps set), once per process: shared, so never to be mutated (copy it). Building a
    scheduler costs more than a step of these tiny models, so a chunk copies this instead.
    ``size``: the job's image size, where its timesteps depend on it (Flux's shift)."""
    seeded = seeded_key(c.recipe.schedulers[name].class_name) is not None
    key = (c.recipe.name, str(c.recipe.source_dir), str(c.device), name, seed if seeded else 0,
           steps, size)
    with _CACHE_LOCK:
        scheduler = _BASELINES.pop(key, None)
        if scheduler is None:
            scheduler = c.scheduler(name, seed)
            set_up(scheduler)
        _BASELINES[key] = scheduler  # the most recently used last
        while len(_BASELINES) > _BASELINES_MAX:
            del _BASELINES[next(iter(_BASELINES))]
        return scheduler


def _modules(c: DiffusionComponents) -> tuple[Any, ...]:
    return tuple(getattr(c, key) for key in _MODULES)


def _move(c: DiffusionComponents, device: torch.device) -> None:
    for module in _modules(c):
        if module is not None:
            module.to(device)


DIFFUSION_RESIDENT = Resident(
    tensors=lambda c: module_tensors(_modules(c)),
    to_host=lambda c: _move(c, torch.device("cpu")),
    to_device=lambda c: _move(c, c.device),
)
"""Diffusion components in the residency: measured by their modules' parameters and buffers,
moved to host memory with ``.to("cpu")`` and back to their device."""


def component_key(recipe: DiffusionRecipe, device: str = "cpu") -> str:
    """The residency key of ``recipe``'s components on ``device``."""
    return f"diffusion:{recipe.name}:{device}:{recipe.weights_dir or 'seeded'}"


def load_components(recipe: DiffusionRecipe, device: str = "cpu") -> DiffusionComponents:
    """The recipe's modules on ``device``, held by the process's model residency (built on
    first use, and again after an eviction; seeded, so bit-identical each time)."""
    return process_residency().acquire(component_key(recipe, device),
                                       lambda: build_components(recipe, device),
                                       DIFFUSION_RESIDENT)


def build_host_components(recipe: DiffusionRecipe, device: str = "cpu") -> DiffusionComponents:
    """The recipe's modules built in host memory, bound for ``device``: what a move back from
    host memory (``DIFFUSION_RESIDENT.to_device``) puts there. Never on the device itself, so
    staging takes no device memory; the same seeded modules as :func:`build_components` (both
    build on the CPU first)."""
    return replace(build_components(recipe, "cpu"), device=torch.device(device))


def stage_components(recipe: DiffusionRecipe, device: str = "cpu") -> bool:
    """Build the recipe's modules into the residency's host tier ahead of its jobs
    (:func:`build_host_components`; :func:`load_components` then moves them to ``device``);
    False when nothing was staged (held already, no host tier or room)."""
    return process_residency().stage(component_key(recipe, device),
                                     lambda: build_host_components(recipe, device),
                                     DIFFUSION_RESIDENT)


def clear_component_cache() -> None:
    """Forget every built model (tests use it to play a fresh worker process)."""
    process_residency().clear()
    with _CACHE_LOCK:
        _BASELINES.clear()
