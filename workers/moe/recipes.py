"""MoE model recipes (``configs/models/<name>.yaml`` with ``kind: text``) and how to build them.

A recipe builds a transformers MoE model with seeded random weights, identical in every worker
process, or loads a local ``save_pretrained`` directory; the tokenizer comes with it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml  # type: ignore[import-untyped,unused-ignore]
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from workers.errors import ModelConfigError
from workers.moe.tokenizer import build_tokenizer

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
DEFAULT_MODEL = "mixtral-tiny"

_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "mixtral": MixtralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "olmoe": OlmoeConfig,
    "gpt_oss": GptOssConfig,
    "deepseek_v3": DeepseekV3Config,
    "qwen3_next": Qwen3NextConfig,
}
# Mixtral's router always renormalises its top-k weights; the others follow norm_topk_prob.
_ALWAYS_NORMALISE = {"mixtral"}


@dataclass(frozen=True, slots=True)
class MoeRecipe:
    """One MoE model recipe, as read from its YAML file."""

    name: str
    family: str
    seed: int = 0
    weights: Path | None = None
    tokenizer_vocab_size: int = 512
    config: dict[str, Any] = field(default_factory=dict)
    score_correction_std: float = 0.0
    """DeepSeek-V3: the std of a seeded random ``e_score_correction_bias`` (its routers'
    load-balancing bias, which ``from_config`` zeroes); 0 keeps the zeros."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A built model with its tokenizer and the routing facts the router needs."""

    recipe: MoeRecipe
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_experts(self) -> int:
        config = self.model.config
        return int(getattr(config, "num_local_experts", None) or config.num_experts)

    @property
    def native_top_k(self) -> int:
        return int(self.model.config.num_experts_per_tok)

    @property
    def normalises_top_k(self) -> bool:
        if self.recipe.family in _ALWAYS_NORMALISE:
            return True
        return bool(getattr(self.model.config, "norm_topk_prob", False))


def list_recipes(models_dir: Path | None = None) -> list[str]:
    """Names of the MoE (``kind: text``) recipes in ``models_dir`` (default :data:`MODELS_DIR`,
    read when called)."""
    models_dir = MODELS_DIR if models_dir is None else models_dir
    names = []
    for path in sorted(models_dir.glob("*.yaml")):
        raw = _read_yaml(path)
        if raw.get("kind") == "text":
            names.append(str(raw.get("name", path.stem)))
    return names


def load_recipe(name: str, models_dir: Path | None = None) -> MoeRecipe:
    """Read recipe ``name`` from ``models_dir`` (default :data:`MODELS_DIR`, read when called);
    raises :class:`ModelConfigError` naming what is wrong."""
    models_dir = MODELS_DIR if models_dir is None else models_dir
    path = models_dir / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(list_recipes(models_dir)) or "none"
        raise ModelConfigError(f"no MoE recipe {name!r} in {models_dir}; known recipes: {known}")
    raw = _read_yaml(path)
    if raw.get("kind") != "text" or raw.get("family") not in _CONFIGS:
        raise ModelConfigError(
            f"recipe {path.name} needs kind: text and family: one of {sorted(_CONFIGS)}"
        )
    weights = raw.get("weights")
    return MoeRecipe(
        name=str(raw.get("name", name)),
        family=str(raw["family"]),
        seed=int(raw.get("seed", 0)),
        weights=_resolve(Path(weights), path.parent) if weights else None,
        tokenizer_vocab_size=int(raw.get("tokenizer_vocab_size", 512)),
        config=dict(raw.get("config") or {}),
        score_correction_std=float(raw.get("score_correction_std", 0.0)),
    )


def build_model(recipe: MoeRecipe) -> LoadedModel:
    """Build the recipe's model in eval mode: from its weights directory, else seeded random."""
    if recipe.weights is not None:
        return _load_pretrained(recipe, recipe.weights)
    tokenizer = build_tokenizer(recipe.tokenizer_vocab_size)
    config = _make_config(recipe, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, experts_implementation="eager"
        )
        _randomise_score_correction(model, recipe.score_correction_std)
    return LoadedModel(recipe=recipe, model=_eval(model), tokenizer=tokenizer)


def save_model_dir(loaded: LoadedModel, directory: Path) -> None:
    """Write the model and tokenizer so a recipe with ``weights: <directory>`` loads them."""
    directory.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)


def _load_pretrained(recipe: MoeRecipe, directory: Path) -> LoadedModel:
    if not (directory / "config.json").is_file():
        raise ModelConfigError(
            f"recipe {recipe.name}: weights directory {directory} has no config.json; "
            "write it with save_pretrained (workers.moe.recipes.save_model_dir)"
        )
    model = AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    return LoadedModel(recipe=recipe, model=_eval(model), tokenizer=tokenizer)


def _randomise_score_correction(model: PreTrainedModel, std: float) -> None:
    """Draw every router's ``e_score_correction_bias`` from N(0, std), after the weights."""
    if std <= 0:
        return
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, std)


def _eval(model: PreTrainedModel) -> PreTrainedModel:
    model.train(False)
    return model


def _make_config(recipe: MoeRecipe, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    values = dict(recipe.config)
    values.setdefault("vocab_size", len(tokenizer))
    if int(values["vocab_size"]) < len(tokenizer):
        raise ModelConfigError(
            f"recipe {recipe.name}: vocab_size {values['vocab_size']} is smaller than the "
            f"tokenizer's {len(tokenizer)} tokens; raise vocab_size or lower tokenizer_vocab_size"
        )
    values.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    try:
        return _CONFIGS[recipe.family](**values)
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"recipe {recipe.name}: invalid config: {exc}") from exc


_PARSED_YAML: dict[Path, tuple[float, dict[str, Any]]] = {}


def _read_yaml(path: Path) -> dict[str, Any]:
    """The recipe file's mapping, parsed again only when the file changed: every text chunk
    validates its params against its recipe (~1 ms a parse on the hop path)."""
    try:
        mtime = path.stat().st_mtime
        cached = _PARSED_YAML.get(path)
        if cached is not None and cached[0] == mtime:
            return copy.deepcopy(cached[1])
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ModelConfigError(f"cannot read model recipe {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ModelConfigError(f"model recipe {path} must hold a mapping at the top level")
    _PARSED_YAML[path] = (mtime, loaded)
    return copy.deepcopy(loaded)


def _resolve(path: Path, base: Path) -> Path:
    if path.is_absolute():
        return path
    project_relative = base.parents[1] / path
    return project_relative if project_relative.exists() else base / path
