"""LoRA adapters on a resident transformer: loaded once each, switched per job, never a rebuild.

A family whose diffusers pipeline has a LoRA loader (Wan) loads through that loader's own
``lora_state_dict`` and ``load_lora_into_transformer``; one without (DiT, PixArt: diffusers
#9887) gets PEFT's ``inject_adapter_in_model`` and ``set_peft_model_state_dict`` on its
transformer. Either way the layers are PEFT's, and a job's adapters and scales are set on them
before its forward with diffusers' ``set_weights_and_activate_adapters`` (what the pipelines'
``set_adapters`` calls), or every adapter disabled for a job without.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import diffusers
import diffusers.utils.peft_utils
import torch
import yaml
from diffusers.loaders.lora_base import LoraBaseMixin
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from workers.diffusion.adapters import AdapterSpec, weights_digest
from workers.diffusion.components import build_components
from workers.diffusion.recipes import DiffusionRecipe
from workers.errors import ParamsError
from workers.residency import adapters_to_unload

PIPELINES = {"dit": "DiTPipeline", "pixart": "PixArtSigmaPipeline", "wan": "WanPipeline",
             "wan22": "WanPipeline", "wan22_i2v": "WanImageToVideoPipeline",
             "sd3": "StableDiffusion3Pipeline",
             "flux": "FluxPipeline", "flux_kontext": "FluxKontextPipeline",
             "qwen_image": "QwenImagePipeline",
             "zimage": "ZImagePipeline", "flux2_klein": "Flux2KleinPipeline",
             "hunyuan_video15": "HunyuanVideo15Pipeline"}
"""The diffusers pipeline of each family, whose LoRA loader (if it has one) loads adapters."""
DEFAULT_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections every family's transformer names alike."""
_PREFIX = "transformer."

_LOCK = threading.Lock()
_LOADED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = \
    weakref.WeakKeyDictionary()
"""Per transformer: its loaded adapters (least recently used first) and the sha256 of the
weights file each was loaded from, so a replaced file is loaded again."""
_PEFT_UTILS: Any = diffusers.utils.peft_utils  # untyped: diffusers' own adapter switches
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, float], ...]] = \
    weakref.WeakKeyDictionary()


def pipeline_loader(family: str) -> Any | None:
    """The family's pipeline class when it has diffusers' LoRA loader, else None."""
    cls = getattr(diffusers, PIPELINES[family])
    return cls if issubclass(cls, LoraBaseMixin) else None


def lora_config(spec: AdapterSpec) -> LoraConfig:
    return LoraConfig(**lora_metadata(spec))


def lora_metadata(spec: AdapterSpec) -> dict[str, Any]:
    """The LoraConfig fields diffusers' loaders read from a safetensors file's metadata."""
    return {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.target_modules)}


def make_random_adapter(recipe: DiffusionRecipe, name: str, folder: Path, *, rank: int = 4,
                        alpha: float | None = None, seed: int = 0,
                        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
                        description: str = "") -> AdapterSpec:
    """Make and register a LoRA adapter of random weights for ``recipe`` with PEFT, locally:
    ``<name>.safetensors`` (written by the family's LoRA saver where it has one) and
    ``<name>.yaml`` in ``folder``. For tests and trying the feature; nothing is downloaded."""
    spec = AdapterSpec(name=name, base=recipe.name, weights=f"{name}.safetensors", rank=rank,
                       alpha=float(alpha if alpha is not None else rank),
                       target_modules=list(target_modules), description=description,
                       source_dir=folder)
    transformer = build_components(recipe).transformer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # init_lora_weights=False keeps both factors random, so the adapter changes the output
        config = LoraConfig(**lora_metadata(spec), init_lora_weights=False)
        inject_adapter_in_model(config, transformer, adapter_name=name)
    weights = get_peft_model_state_dict(transformer, adapter_name=name)
    folder.mkdir(parents=True, exist_ok=True)
    loader = pipeline_loader(recipe.family)
    if loader is not None:
        loader.save_lora_weights(
            folder, transformer_lora_layers=weights, weight_name=spec.weights,
            transformer_lora_adapter_metadata=lora_metadata(spec))
    else:
        save_file({_PREFIX + key: value.contiguous() for key, value in weights.items()},
                  spec.weights_path, metadata={"format": "pt"})
    entry = spec.model_dump(exclude={"name", "source_dir"})
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, **entry}, sort_keys=False))
    return spec


def _load(family: str, transformer: torch.nn.Module, spec: AdapterSpec) -> None:
    """Load ``spec`` onto ``transformer`` as adapter ``spec.name`` (its loader, else PEFT)."""
    loader = pipeline_loader(family)
    try:
        if loader is not None:
            state, metadata = loader.lora_state_dict(
                str(spec.weights_path), return_lora_metadata=True)
            with warnings.catch_warnings():  # PEFT's note on a second adapter, as below
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                loader.load_lora_into_transformer(
                    state, transformer=transformer, adapter_name=spec.name,
                    metadata=metadata or {f"{_PREFIX}{k}": v
                                          for k, v in lora_metadata(spec).items()})
            return
        state = {key.removeprefix(_PREFIX): value
                 for key, value in load_file(spec.weights_path).items()}
        with warnings.catch_warnings():  # a second adapter on one model is the point here
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(lora_config(spec), transformer, adapter_name=spec.name)
        result: Any = set_peft_model_state_dict(transformer, state, adapter_name=spec.name)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ParamsError(f"adapter {spec.name!r} does not fit model {spec.base!r}: {exc}") from exc
    unexpected = [key for key in result.unexpected_keys if "lora_" in key]
    if unexpected:
        _PEFT_UTILS.delete_adapter_layers(transformer, spec.name)
        raise ParamsError(f"adapter {spec.name!r} does not fit model {spec.base!r}: no module "
                          f"for {', '.join(unexpected[:3])}")


def _unload(transformer: torch.nn.Module, name: str) -> None:
    _PEFT_UTILS.delete_adapter_layers(transformer, name)


def ensure_loaded(family: str, transformer: torch.nn.Module, specs: Sequence[AdapterSpec],
                  on_load: Callable[[str, float], None] | None = None) -> None:
    """Load each of ``specs`` onto ``transformer`` unless it is already there from the same file
    (``on_load`` is told each load's adapter and seconds); unload the least recently used
    beyond :data:`workers.residency.MAX_LOADED_ADAPTERS`."""
    loaded = _LOADED.setdefault(transformer, {})
    for spec in specs:
        stamp = weights_digest(spec.weights_path)
        if loaded.get(spec.name) != stamp:
            if spec.name in loaded:
                _unload(transformer, spec.name)
                del loaded[spec.name]
            started_s = time.perf_counter()
            _load(family, transformer, spec)
            if on_load is not None:
                on_load(spec.name, time.perf_counter() - started_s)
            transformer.requires_grad_(False)
            _ACTIVE.pop(transformer, None)
        loaded[spec.name] = loaded.pop(spec.name, stamp)  # most recently used last
    wanted = {spec.name for spec in specs}
    for name in adapters_to_unload(list(loaded), wanted):
        _unload(transformer, name)
        del loaded[name]
        _ACTIVE.pop(transformer, None)


def activate(transformer: torch.nn.Module, adapters: Sequence[tuple[str, float]]) -> None:
    """Set the adapters (name, scale) a forward applies, in order; none: every adapter off."""
    wanted = tuple(adapters)
    if _ACTIVE.get(transformer) == wanted or (not wanted and transformer not in _LOADED):
        return
    if wanted:
        _PEFT_UTILS.set_adapter_layers(transformer, enabled=True)
        _PEFT_UTILS.set_weights_and_activate_adapters(transformer, [name for name, _ in wanted],
                                          [scale for _, scale in wanted])
    else:
        _PEFT_UTILS.set_adapter_layers(transformer, enabled=False)
    _ACTIVE[transformer] = wanted


def apply_adapters(family: str, transformer: torch.nn.Module,
                   adapters: Sequence[tuple[AdapterSpec, float]],
                   on_load: Callable[[str, float], None] | None = None) -> torch.nn.Module:
    """``transformer`` with exactly ``adapters`` (each at its scale) active, loading what is not
    yet loaded (``on_load``: each load's adapter and seconds); the base module itself, never
    rebuilt."""
    with _LOCK:
        if adapters:
            ensure_loaded(family, transformer, [spec for spec, _ in adapters], on_load)
        activate(transformer, [(spec.name, scale) for spec, scale in adapters])
    return transformer


def loaded_adapters(transformer: torch.nn.Module) -> list[str]:
    """The adapters loaded on ``transformer``, least recently used first."""
    return list(_LOADED.get(transformer, {}))
