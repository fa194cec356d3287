"""Model recipes from ``configs/models/*.yaml``: one file per recipe, read without torch.

A recipe names its ``kind`` (image, video, text …); each kind's runner parses the rest. The
registry only finds, reads and indexes the files, so the API can validate jobs cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workers.errors import ModelConfigError

DEFAULT_MODELS_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"


@dataclass(frozen=True, slots=True)
class RecipeFile:
    """One recipe as written: its name, kind, the file it came from and the raw mapping."""

    name: str
    kind: str
    path: Path
    spec: Mapping[str, Any]


def read_recipe_file(path: Path) -> RecipeFile:
    """Read one YAML recipe; the name defaults to the file's stem."""
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ModelConfigError(f"cannot read model recipe {path}: {exc}") from exc
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise ModelConfigError(f"model recipe {path} must be a mapping with a 'kind' string")
    name = str(spec.get("name") or path.stem)
    return RecipeFile(name=name, kind=spec["kind"], path=path, spec=spec)


class ModelRegistry:
    """Every recipe in one folder, by name. Reading is lazy and happens once."""

    def __init__(self, models_dir: Path = DEFAULT_MODELS_DIR) -> None:
        self.models_dir = models_dir
        self._recipes: dict[str, RecipeFile] | None = None

    def _load(self) -> dict[str, RecipeFile]:
        if self._recipes is None:
            recipes: dict[str, RecipeFile] = {}
            for path in sorted(self.models_dir.glob("*.yaml")):
                recipe = read_recipe_file(path)
                if recipe.name in recipes:
                    raise ModelConfigError(
                        f"model recipe name {recipe.name!r} is used by both "
                        f"{recipes[recipe.name].path.name} and {path.name}; rename one"
                    )
                recipes[recipe.name] = recipe
            self._recipes = recipes
        return self._recipes

    def names(self, kind: str | None = None) -> list[str]:
        """Recipe names, optionally only those of one kind."""
        return [n for n, r in self._load().items() if kind is None or r.kind == kind]

    def get(self, name: str) -> RecipeFile:
        """The recipe called ``name``; the error lists the known ones."""
        recipes = self._load()
        if name not in recipes:
            known = ", ".join(sorted(recipes)) or "none"
            raise ModelConfigError(
                f"unknown model {name!r} in {self.models_dir}; known models: {known}"
            )
        return recipes[name]


_DEFAULT_REGISTRY: ModelRegistry | None = None


def default_registry() -> ModelRegistry:
    """The process-wide registry over the project's ``configs/models``."""
    global _DEFAULT_REGISTRY
    if _DEFAULT_REGISTRY is None:
        _DEFAULT_REGISTRY = ModelRegistry()
    return _DEFAULT_REGISTRY
