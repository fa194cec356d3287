"""Settings of MoE serving: router and expert cache (``moe:`` in configs/default.yaml)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.settings.durations import Seconds

if TYPE_CHECKING:
    from workers.moe import CacheConfig, RouterConfig

_MIB = 1024 * 1024


class RouterSettings(BaseModel):
    """Expert routing, as in the reference design's router block."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    k: int = Field(default=8, ge=1, le=64)
    """Experts activated per token (capped at the model's own expert count)."""
    temperature: float = Field(default=0.5, gt=0, le=10)
    """Softmax temperature applied to router logits."""
    expert_capacity: int = Field(default=256, ge=1)
    """Most tokens one expert takes per forward pass before the fallback applies."""
    fallback_strategy: Literal["random", "next_best"] = "random"
    """Where a token goes when its chosen expert is full."""
    diversity_penalty: float = Field(default=0.0, ge=0, le=10)
    """Logits subtracted from an expert in proportion to its share of the request's routing so
    far (0 disables); counters requests that always land on the same experts."""


class ExpertCacheSettings(BaseModel):
    """The per-worker expert cache."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    memory_threshold: float = Field(default=0.85, gt=0, le=1)
    """Share of the memory budget the resident experts may fill before eviction."""
    idle_unload: Seconds = Field(default=300.0, gt=0)
    """Experts unused this long are unloaded."""
    warmup_experts: int = Field(default=16, ge=0)
    """The most frequent experts loaded at start."""
    budget_mb: float | None = Field(default=None, gt=0)
    """Device memory for resident experts, in MiB; unset: resource_limits.memory of the device's
    memory on CUDA, every expert on CPU. The slots fill memory_threshold of it."""
    policy: Literal["lru", "lfru"] = "lfru"
    """Eviction policy: least recently used, or decayed frequency (LFRU, history-aware)."""
    prefetch_experts: int = Field(default=2, ge=0, le=64)
    """Experts of the next layer prefetched from the routing history per layer (0 disables)."""
    prefetch_min_confidence: float = Field(default=0.3, ge=0, le=1)
    """A prefetch may evict a resident expert only when its predicted share is at least this."""


class VersionSettings(BaseModel):
    """Hot update of expert versions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    traffic_step: float = Field(default=0.05, gt=0, le=1)
    """Share of traffic moved to a new version per healthy step."""
    step_interval: Seconds = Field(default=30.0, gt=0)
    """Least time between two traffic steps."""
    min_samples: int = Field(default=20, ge=1)
    """Requests each version must serve in a step before the step is judged."""
    rollback_degradation: float = Field(default=0.15, gt=0, le=10)
    """Relative latency or error-rate degradation versus the live version that rolls back."""
    keep_versions: int = Field(default=3, ge=1, le=32)
    """Versions kept for rollback."""


class ResourceLimits(BaseModel):
    """Device limits, as shares of what the device has."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    memory: float = Field(default=0.75, gt=0, le=1)
    """Share of device memory Stepline may use."""
    compute: float = Field(default=0.90, gt=0, le=1)
    """Share of device compute Stepline may use."""


class MoeSettings(BaseModel):
    """MoE text generation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    router: RouterSettings = Field(default_factory=RouterSettings)
    """Router block."""
    cache: ExpertCacheSettings = Field(default_factory=ExpertCacheSettings)
    """Expert cache block."""
    resource_limits: ResourceLimits = Field(default_factory=ResourceLimits)
    """Device limits."""
    versions: VersionSettings = Field(default_factory=VersionSettings)
    """Expert hot update."""


def router_config(settings: MoeSettings) -> RouterConfig:
    """The router block of the settings as the worker's own :class:`RouterConfig`."""
    from workers.moe import RouterConfig  # deferred: workers.moe loads torch

    r = settings.router
    return RouterConfig(
        k=r.k,
        temperature=r.temperature,
        expert_capacity=r.expert_capacity,
        fallback=r.fallback_strategy,
        diversity_penalty=r.diversity_penalty,
    )


def cache_config(settings: MoeSettings, device: str) -> CacheConfig:
    """The cache block as the worker's :class:`CacheConfig`; the budget defaults to the
    device's share (``resource_limits.memory``) of its memory."""
    from workers.moe import CacheConfig, device_memory_bytes  # deferred: loads torch

    c = settings.cache
    budget: int | None = int(c.budget_mb * _MIB) if c.budget_mb is not None else None
    total = device_memory_bytes(device) if budget is None else None
    if total is not None:
        budget = int(total * settings.resource_limits.memory)
    return CacheConfig(
        budget_bytes=budget,
        memory_threshold=c.memory_threshold,
        idle_unload_s=c.idle_unload,
        warmup_experts=c.warmup_experts,
        policy=c.policy,
        prefetch_experts=c.prefetch_experts,
        prefetch_min_confidence=c.prefetch_min_confidence,
    )
