"""Build a recipe's modules: seeded random weights, or a local folder; the process's model
residency (``workers.residency``) holds them under its memory budget.

Seeded construction means every worker process builds bit-identical weights, so a job can move
between workers; nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import threading
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
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
from workers.residency import (
    LoadSource,
    ModelResidency,
    Resident,
    module_tensors,
    process_residency,
)

_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
_TEXT_PARTS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"),
               ("text_encoder_3", "tokenizer_3"))
"""Each text encoder with its tokenizer, by their diffusers component names (Stable Diffusion 3
has all three); text encoder ``i`` is built from ``seed + 2 + i`` unless it gives its own seed."""
_MODULES = ("transformer", "vae", "transformer_2", *(encoder for encoder, _ in _TEXT_PARTS))
"""The parts that are torch modules: moved, measured and put in eval mode together."""
_NO_TEXT: dict[str, Any] = {name: None for pair in _TEXT_PARTS for name in pair}


@dataclass(frozen=True, slots=True, weakref_slot=True)
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


_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3,
                 "text_encoder_3": 4, "transformer_2": 5}
"""Each module's seed, as an offset from the recipe's (a text encoder may give its own)."""
_TOKENIZER_OF = dict(_TEXT_PARTS)
CORE_PARTS = ("transformer", "vae")
"""The modules of a model's own residency item; each text encoder (with its tokenizer) and Wan
2.2's low-noise expert are items of their own (:func:`load_components`)."""


def part_seed(recipe: DiffusionRecipe, name: str) -> int:
    """The seed module ``name`` of ``recipe`` is built from: a text encoder's own ``seed``,
    else the recipe's plus the module's offset."""
    spec = getattr(recipe, name)
    own = getattr(spec, "seed", None)
    return int(own) if own is not None else recipe.seed + _SEED_OFFSETS[name]


def _seeded(seed: int, spec: ComponentSpec, base: type) -> Any:
    cls: Any = resolve_class(spec.class_name, base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if issubclass(cls, PreTrainedModel):
            return cls(cls.config_class(**spec.config))
        return cls(**spec.config)


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


def _weights_folder(recipe: DiffusionRecipe) -> Path:
    folder = recipe.weights_dir
    if folder is None or not (folder / "model_index.json").is_file():
        raise ModelConfigError(
            f"model {recipe.name!r}: weights folder {folder} is not a saved pipeline "
            "(no model_index.json); write it with pipeline.save_pretrained(folder)"
        )
    return folder


def _module(recipe: DiffusionRecipe, name: str) -> Any:
    """Module ``name`` of ``recipe``: seeded, or read from its ``weights:`` folder's subfolder
    of that name (as ``save_pretrained`` writes it)."""
    spec = getattr(recipe, name)
    base = ModelMixin if name in ("transformer", "vae", "transformer_2") else PreTrainedModel
    if recipe.weights is None:
        return _seeded(part_seed(recipe, name), spec, base)
    cls = resolve_class(spec.class_name, base)
    folder = _weights_folder(recipe)
    module = (cls.from_pretrained(folder, subfolder=name) if base is ModelMixin
              else cls.from_pretrained(folder / name))
    _own_storage(module)
    return module


def _tokenizer(recipe: DiffusionRecipe, name: str) -> PreTrainedTokenizerFast | None:
    words = getattr(recipe, name)
    if words is None:
        return None
    if recipe.weights is None:
        return build_tokenizer(words, recipe.text_max_length)
    loaded: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(
        _weights_folder(recipe) / name)
    return loaded


def _ready(module: Any, device: torch.device) -> Any:
    return module.to(device).eval().requires_grad_(False)


def build_components(recipe: DiffusionRecipe, device: str = "cpu",
                     parts: Collection[str] | None = None) -> DiffusionComponents:
    """Build (never cached) the recipe's modules on ``device``: all of them, or only those
    named in ``parts`` (the others None)."""
    dev = torch.device(device)
    built: dict[str, Any] = {"transformer": None, "vae": None, "transformer_2": None, **_NO_TEXT}
    for name in ("transformer", "vae", "transformer_2", *_TOKENIZER_OF):
        if getattr(recipe, name) is not None and (parts is None or name in parts):
            built[name] = _ready(_module(recipe, name), dev)
            if name in _TOKENIZER_OF:
                built[_TOKENIZER_OF[name]] = _tokenizer(recipe, _TOKENIZER_OF[name])
    transformer = built.pop("transformer")
    dtype = transformer.dtype if transformer is not None else torch.float32
    return DiffusionComponents(recipe=recipe, device=dev, transformer=transformer,
                               transformer_dtype=dtype, **built)


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


@dataclass(frozen=True, slots=True)
class HeldPart:
    """A module held as its own residency item, bound for ``device``: a text encoder with its
    tokenizer, or Wan 2.2's low-noise expert (no tokenizer)."""

    module: Any
    tokenizer: PreTrainedTokenizerFast | None
    device: torch.device


PART_RESIDENT = Resident(
    tensors=lambda p: module_tensors([p.module]),
    to_host=lambda p: p.module.to(torch.device("cpu")),
    to_device=lambda p: p.module.to(p.device),
)
"""A held part in the residency: its module's parameters and buffers, moved like a model's."""


def component_key(recipe: DiffusionRecipe, device: str = "cpu") -> str:
    """The residency key of ``recipe``'s own modules (transformer and VAE) on ``device``."""
    return f"diffusion:{recipe.name}:{device}:{recipe.weights_dir or 'seeded'}"


_DIGESTS: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}


def folder_digest(folder: Path) -> str:
    """SHA-256 over every file under ``folder`` (relative name and bytes), computed again only
    when a file's size or modification time changes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stats = tuple((str(p.relative_to(folder)), (st := p.stat()).st_size, st.st_mtime_ns)
                  for p in files)
    with _CACHE_LOCK:
        known = _DIGESTS.get(str(folder))
    if known is not None and known[0] == stats:
        return known[1]
    digest = hashlib.sha256()
    for path, (name, _, _) in zip(files, stats, strict=True):
        digest.update(name.encode() + b"\0")
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    with _CACHE_LOCK:
        _DIGESTS[str(folder)] = (stats, digest.hexdigest())
    return digest.hexdigest()


def text_encoder_identity(recipe: DiffusionRecipe, encoder: str) -> str:
    """What a text encoder (with its tokenizer) of ``recipe`` is, by content: its class and,
    seeded, its config, seed, tokenizer spec and prompt length (everything its build reads);
    from a ``weights:`` folder, the digest of its and its tokenizer's files. Equal identities
    build bit-identical modules (``test_residency.py`` checks it), so they are held once."""
    spec, tokenizer = getattr(recipe, encoder), _TOKENIZER_OF[encoder]
    body: dict[str, Any] = {"class": spec.class_name}
    if recipe.weights is None:
        words = getattr(recipe, tokenizer)
        body.update(config=spec.config, seed=part_seed(recipe, encoder),
                    tokenizer=None if words is None else words.model_dump(),
                    max_length=recipe.text_max_length)
    else:
        folder = _weights_folder(recipe)
        body.update(weights=folder_digest(folder / encoder),
                    tokenizer=folder_digest(folder / tokenizer))
    text = json.dumps(body, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def part_keys(recipe: DiffusionRecipe, device: str = "cpu") -> dict[str, str]:
    """The residency keys of ``recipe``'s separately held modules on ``device``, by component
    name: each text encoder's, keyed by its content identity (shared by every recipe that
    names the same one), and a low-noise expert's, under the model's own key."""
    keys = {encoder: f"text_encoder:{text_encoder_identity(recipe, encoder)}:{device}"
            for encoder in _TOKENIZER_OF if getattr(recipe, encoder) is not None}
    if recipe.transformer_2 is not None:
        keys["transformer_2"] = f"{component_key(recipe, device)}:transformer_2"
    return keys


def build_part(recipe: DiffusionRecipe, name: str, device: str = "cpu",
               bound_for: str | None = None) -> HeldPart:
    """Module ``name`` of ``recipe`` (with its tokenizer, for a text encoder) built on
    ``device``, bound for ``bound_for`` (default: ``device``); the same module
    :func:`build_components` builds."""
    c = build_components(recipe, device, parts=(name,))
    tokenizer = getattr(c, _TOKENIZER_OF[name]) if name in _TOKENIZER_OF else None
    return HeldPart(getattr(c, name), tokenizer, torch.device(bound_for or device))


def _part_builder(recipe: DiffusionRecipe, name: str, device: str,
                  bound_for: str | None = None) -> Callable[[], HeldPart]:
    return lambda: build_part(recipe, name, device, bound_for)


_ASSEMBLED: weakref.WeakValueDictionary[str, DiffusionComponents] = weakref.WeakValueDictionary()
"""The last components handed out per model, reused while their parts are the resident ones
(so a chunk gets the same object; dropped when no caller holds it)."""


def load_components(recipe: DiffusionRecipe, device: str = "cpu",
                    residency: ModelResidency | None = None) -> DiffusionComponents:
    """The recipe's modules on ``device``, held by the process's model residency (built on
    first use, and again after an eviction; seeded, so bit-identical each time): the model's
    own item (transformer and VAE) and one item per separately held part (:func:`part_keys`),
    acquired together and pinned for the caller's :meth:`~ModelResidency.in_use` bracket. A
    load of any of them is announced as the model's, taking their expected seconds together."""
    r = residency or process_residency()
    key, keys = component_key(recipe, device), part_keys(recipe, device)
    absent = [k for k in (key, *keys.values()) if r.tier_of(k) != "device"]
    expected = sum(r.expected_load_s(k) for k in absent)
    source: LoadSource = "disk" if any(r.tier_of(k) == "disk" for k in absent) else "host"
    announce = r.loading(key, expected or None, source) if absent else contextlib.nullcontext()
    with announce, r.in_use():
        core = r.acquire(key, lambda: build_components(recipe, device, CORE_PARTS),
                         DIFFUSION_RESIDENT)
        held = {name: r.acquire(part, _part_builder(recipe, name, device), PART_RESIDENT)
                for name, part in keys.items()}
    return _assembled(key, core, held)


def _assembled(key: str, core: DiffusionComponents,
               held: Mapping[str, HeldPart]) -> DiffusionComponents:
    parts: dict[str, Any] = {name: part.module for name, part in held.items()}
    parts.update({_TOKENIZER_OF[name]: part.tokenizer for name, part in held.items()
                  if name in _TOKENIZER_OF})
    with _CACHE_LOCK:
        last = _ASSEMBLED.get(key)
        if last is not None and last.transformer is core.transformer and all(
                getattr(last, name) is value for name, value in parts.items()):
            return last
        c = replace(core, **parts)
        _ASSEMBLED[key] = c
        return c


def build_host_components(recipe: DiffusionRecipe, device: str = "cpu",
                          parts: Collection[str] | None = None) -> DiffusionComponents:
    """The recipe's modules (or only ``parts``) built in host memory, bound for ``device``: what
    a move back from host memory (``DIFFUSION_RESIDENT.to_device``) puts there. Never on the
    device itself, so staging takes no device memory; the same seeded modules as
    :func:`build_components` (both build on the CPU first)."""
    return replace(build_components(recipe, "cpu", parts), device=torch.device(device))


def stage_components(recipe: DiffusionRecipe, device: str = "cpu") -> bool:
    """Build the recipe's items into the residency's host tier ahead of its jobs (its own
    modules, and each separately held part not held already; :func:`load_components` then
    moves them to ``device``); False when nothing was staged (all held already, no host tier
    or room)."""
    r = process_residency()
    staged = r.stage(component_key(recipe, device),
                     lambda: build_host_components(recipe, device, CORE_PARTS),
                     DIFFUSION_RESIDENT)
    for name, part in part_keys(recipe, device).items():
        staged = r.stage(part, _part_builder(recipe, name, "cpu", device),
                         PART_RESIDENT) or staged
    return staged


def clear_component_cache() -> None:
    """Forget every built model (tests use it to play a fresh worker process)."""
    process_residency().clear()
    with _CACHE_LOCK:
        _BASELINES.clear()


def library_pipeline(cls: type[Any], c: DiffusionComponents) -> Any:
    """The library's pipeline ``cls`` on ``c``'s modules (each one it takes that ``c`` has, None
    for the rest and for its scheduler), to call its own ``encode_prompt``: building one costs
    well under a millisecond."""
    names = [n for n in inspect.signature(cls).parameters if n != "scheduler"]
    return cls(scheduler=None, **{n: getattr(c, n, None) for n in names})
