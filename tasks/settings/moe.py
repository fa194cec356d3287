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
    policy: Literal["lru", "lfru", "arc", "s3fifo", "lecar"] = "lfru"
    """Eviction policy of the resident experts: least recently used, decayed frequency (LFRU),
    adaptive replacement (ARC), S3-FIFO or LeCaR; `stepline experts replay` compares them on a
    routing trace."""
    allocation: Literal["uniform", "reuse"] = "reuse"
    """Slots per layer: the same for every layer, or the same total rebalanced toward the layers
    whose measured reuse gains most per slot."""
    rebalance_every: int = Field(default=256, ge=1)
    """Forward passes between two rebalancings of the slots (allocation: reuse)."""
    prefetch_experts: int = Field(default=2, ge=0, le=64)
    """Most experts of the next layer prefetched per layer per forward (0 disables)."""
    prefetch_min_confidence: float = Field(default=0.5, ge=0, le=1)
    """Least estimated chance that a prefetched expert is routed (it costs a slot and a copy)."""
    lookahead_weight: float = Field(default=0.7, ge=0, le=1)
    """Weight of the next router applied early (lookahead) against routing history."""
    history_decay: float = Field(default=0.999, gt=0, le=1)
    """Per-token decay of the routing history used for prediction and warm-up."""
    overlap: bool = True
    """Prefetches copy on a side lane (a CUDA stream; a copy thread on the CPU)."""


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
    checkpoint_every: int = Field(default=1, ge=1, le=1000)
    """Write a text job's durable checkpoint to Redis every this many chunks (always when it
    stops); the chunks since are replayed from it on another worker."""


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
        allocation=c.allocation,
        rebalance_every=c.rebalance_every,
        prefetch_experts=c.prefetch_experts,
        prefetch_min_confidence=c.prefetch_min_confidence,
        lookahead_weight=c.lookahead_weight,
        history_decay=c.history_decay,
        overlap=c.overlap,
    )
