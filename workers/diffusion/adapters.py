"""LoRA adapters of the diffusion recipes: a folder of ``<name>.yaml`` entries, each naming its
base recipe and a local safetensors file, registered like recipes and read without torch, so the
API lists adapters and checks a job's choice cheaply (:mod:`workers.diffusion.lora` loads them).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.errors import ModelConfigError, ParamsError

DEFAULT_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "configs" / "adapters"
MAX_ADAPTERS_PER_JOB = 4


class AdapterSpec(BaseModel):
    """One registered LoRA adapter: what it fits and how it was trained (PEFT's LoraConfig)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._\-]+$")
    base: str
    """The recipe (``configs/models``) whose transformer the adapter was made for."""
    weights: str
    """The safetensors file of its LoRA weights, relative to the entry (diffusers' layout:
    ``transformer.<module>.lora_A.weight`` / ``lora_B.weight``)."""
    rank: int = Field(ge=1, le=4096)
    alpha: float = Field(gt=0)
    """LoRA alpha: a scale of 1 adds ``alpha / rank`` times the low-rank update."""
    target_modules: list[str] = Field(min_length=1)
    """Module names (suffixes) of the transformer the adapter wraps."""
    description: str = ""
    source_dir: Path = Path(".")
    """Folder of the entry (set by the registry)."""

    @property
    def weights_path(self) -> Path:
        return self.source_dir / self.weights

    def summary(self) -> dict[str, Any]:
        """What ``GET /v1/adapters`` shows of the adapter."""
        return {"name": self.name, "base": self.base, "rank": self.rank, "alpha": self.alpha,
                "target_modules": list(self.target_modules), "description": self.description}


class AdapterChoice(BaseModel):
    """One adapter a job applies, and how strongly."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    scale: float = Field(default=1.0, ge=-8, le=8)
    """Multiplies the adapter's update (0 leaves the base's output, 1 the adapter as trained)."""
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The weights file's digest: filled in at submit (or given, to pin a version), so the job
    runs with the weights it was accepted with, or fails naming the adapter."""


def read_adapter_file(path: Path) -> AdapterSpec:
    """One adapter entry; the name defaults to the file's stem."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ModelConfigError(f"cannot read adapter entry {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"adapter entry {path} must be a mapping (base, weights, rank …)")
    try:
        return AdapterSpec.model_validate({"name": path.stem, **raw, "source_dir": path.parent})
    except ValidationError as exc:
        raise ModelConfigError(f"adapter entry {path} is invalid: {exc}") from exc


class AdapterRegistry:
    """Every adapter entry in one folder, by name; read again whenever an entry file is added,
    removed or changed, so a running API sees a newly registered adapter."""

    def __init__(self, folder: Path = DEFAULT_ADAPTERS_DIR) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[str, int, int], ...] | None = None
        self._adapters: dict[str, AdapterSpec] = {}

    def _current_stamp(self) -> tuple[tuple[str, int, int], ...]:
        files = sorted(self.folder.glob("*.yaml")) if self.folder.is_dir() else []
        stats = ((path, path.stat()) for path in files)
        return tuple((path.name, stat.st_mtime_ns, stat.st_size) for path, stat in stats)

    def _load(self) -> dict[str, AdapterSpec]:
        with self._lock:
            stamp = self._current_stamp()
            if stamp != self._stamp:
                adapters: dict[str, AdapterSpec] = {}
                for name, _, _ in stamp:
                    spec = read_adapter_file(self.folder / name)
                    if spec.name in adapters:
                        raise ModelConfigError(f"adapter name {spec.name!r} is used twice in "
                                               f"{self.folder}; rename one")
                    adapters[spec.name] = spec
                self._adapters, self._stamp = adapters, stamp
            return self._adapters

    def all(self) -> list[AdapterSpec]:
        """Every adapter, by name."""
        return [spec for _, spec in sorted(self._load().items())]

    def for_base(self, base: str) -> list[str]:
        """Names of the adapters made for recipe ``base``."""
        return [spec.name for spec in self.all() if spec.base == base]

    def get(self, name: str) -> AdapterSpec | None:
        return self._load().get(name)


_DIGESTS: dict[tuple[Path, int, int, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def weights_digest(path: Path) -> str:
    """The sha256 of an adapter's weights file, hashed once per version of the file."""
    stat = path.stat()
    key = (path, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(key)
    if known is None:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        known = digest.hexdigest()
        with _DIGESTS_LOCK:
            _DIGESTS[key] = known
    return known


_REGISTRIES: dict[Path, AdapterRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def adapter_registry(folder: Path | str | None = None) -> AdapterRegistry:
    """The process-wide registry of ``folder`` (default: the project's ``configs/adapters``)."""
    path = Path(folder).resolve() if folder is not None else DEFAULT_ADAPTERS_DIR
    with _REGISTRIES_LOCK:
        if path not in _REGISTRIES:
            _REGISTRIES[path] = AdapterRegistry(path)
        return _REGISTRIES[path]


def check_adapters(choices: Sequence[AdapterChoice], base: str,
                   registry: AdapterRegistry) -> list[dict[str, Any]]:
    """``choices`` as a job carries them (name, scale and the weights' sha256, in order) once
    each names a registered adapter made for recipe ``base``; a :class:`ParamsError` names the
    one that does not."""
    if len(choices) > MAX_ADAPTERS_PER_JOB:
        raise ParamsError(f"a job applies at most {MAX_ADAPTERS_PER_JOB} adapters, not "
                          f"{len(choices)}")
    chosen: list[dict[str, Any]] = []
    for choice in choices:
        spec = _fitting(choice.name, base, registry)
        if any(c["name"] == choice.name for c in chosen):
            raise ParamsError(f"adapter {choice.name!r} is named twice; name it once with the "
                              "sum of its scales")
        check_weights(spec, choice.sha256)
        chosen.append({"name": choice.name, "scale": choice.scale,
                       "sha256": weights_digest(spec.weights_path)})
    return chosen


def _fitting(name: str, base: str, registry: AdapterRegistry) -> AdapterSpec:
    """The registered adapter ``name`` when it is made for ``base`` and its weights exist."""
    spec = registry.get(name)
    fitting = ", ".join(registry.for_base(base)) or "none"
    if spec is None:
        raise ParamsError(f"unknown adapter {name!r}; adapters of model {base!r}: "
                          f"{fitting} (GET /v1/adapters or stepline adapter list)")
    if spec.base != base:
        raise ParamsError(f"adapter {name!r} is made for model {spec.base!r}, not {base!r}; "
                          f"submit it with model={spec.base!r}, or use one of {fitting}")
    if not spec.weights_path.is_file():
        raise ParamsError(f"adapter {name!r}: its weights file {spec.weights} is missing; "
                          "register the adapter again")
    return spec


def check_weights(spec: AdapterSpec, sha256: str | None) -> None:
    """A :class:`ParamsError` unless ``spec``'s weights file has digest ``sha256`` (or none was
    recorded): a job runs with the adapter version it was accepted with."""
    if sha256 is not None and weights_digest(spec.weights_path) != sha256:
        raise ParamsError(f"adapter {spec.name!r}: its weights file is not the version this job "
                          f"names (sha256 {sha256[:12]}…); it was replaced since, so submit the "
                          "job again (or register the new weights under a new name)")


def adapter_digests(params: Mapping[str, Any]) -> dict[str, str | None]:
    """The weights digest each of a job's adapters was accepted with, by name."""
    return {str(a["name"]): a.get("sha256") for a in params.get("adapters") or ()}


def adapter_set(params: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The (name, scale) pairs a job's validated parameters apply, in order (none: ``[]``)."""
    return [(str(a["name"]), float(a["scale"])) for a in params.get("adapters") or ()]


def adapter_set_key(adapters: Sequence[tuple[str, float]]) -> str:
    """A text that is equal for two jobs exactly when they apply the same adapters and scales
    in the same order ("" for none), so only such jobs share a forward."""
    return "".join(f"+{name}@{scale!r}" for name, scale in adapters)
