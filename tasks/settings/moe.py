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
    """Experts activated per token (capped at the model's own expert count). Experts, in
    [1, 64]."""
    temperature: float = Field(default=0.5, gt=0, le=10)
    """Softmax temperature applied to router logits (1: the logits as they are). Unitless, in
    (0, 10]."""
    expert_capacity: int = Field(default=256, ge=1, le=1_048_576)
    """Most tokens one expert takes per forward pass before the fallback applies. Tokens, in
    [1, 1048576] (2**20: more than one forward pass of any context window)."""
    fallback_strategy: Literal["random", "next_best"] = "random"
    """Where a token goes when its chosen expert is full."""
    diversity_penalty: float = Field(default=0.0, ge=0, le=10)
    """Logits subtracted from an expert in proportion to its share of the request's routing so
    far (0 disables), so that a request does not always land on the same experts. Logits per
    unit share, in [0, 10]."""


class ExpertCacheSettings(BaseModel):
    """The per-worker expert cache."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    memory_threshold: float = Field(default=0.85, gt=0, le=1)
    """Share of the memory budget the resident experts may fill before eviction. A fraction,
    in (0, 1]."""
    idle_unload: Seconds = Field(default=300.0, gt=0, le=86400)
    """Experts unused this long are unloaded. Seconds, in (0, 86400]."""
    warmup_experts: int = Field(default=16, ge=0, le=100_000)
    """The most frequent experts (layer and expert pairs, over all layers) loaded at start.
    Experts, in [0, 100000] (the largest models have some 15000)."""
    budget_mb: float | None = Field(default=None, gt=0, le=1_048_576)
    """Device memory for resident experts; null: resource_limits.memory of the device's memory
    on CUDA, every expert on CPU. The slots fill memory_threshold of it. MiB, in
    (0, 1048576] (1 TiB, past any device: a budget given in bytes is refused)."""
    policy: Literal["lru", "lfru", "arc", "s3fifo", "lecar"] = "lfru"
    """Eviction policy of the resident experts: least recently used, decayed frequency (LFRU),
    adaptive replacement (ARC), S3-FIFO or LeCaR; `stepline experts replay` compares them on a
    routing trace."""
    allocation: Literal["uniform", "reuse"] = "reuse"
    """Slots per layer: the same for every layer, or the same total rebalanced toward the layers
    whose measured reuse gains most per slot."""
    rebalance_every: int = Field(default=256, ge=1, le=1_000_000_000)
    """Forward passes between two rebalancings of the slots (allocation: reuse). Forward
    passes, in [1, 1e9] (a very large value: never)."""
    prefetch_experts: int = Field(default=2, ge=0, le=64)
    """Most experts of the next layer prefetched per layer per forward (0 disables). Experts,
    in [0, 64]."""
    prefetch_min_confidence: float = Field(default=0.5, ge=0, le=1)
    """Least estimated chance that a prefetched expert is routed (it costs a slot and a copy).
    A probability, in [0, 1]."""
    lookahead_weight: float = Field(default=0.7, ge=0, le=1)
    """Weight of the next router applied early (lookahead) against routing history. A
    fraction, in [0, 1]."""
    history_decay: float = Field(default=0.999, gt=0, le=1)
    """Per-token decay of the routing history used for prediction and warm-up (1: none). A
    factor, in (0, 1]."""
    overlap: bool = True
    """Prefetches copy on a side lane (a CUDA stream; a copy thread on the CPU)."""


class VersionSettings(BaseModel):
    """Hot update of expert versions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    traffic_step: float = Field(default=0.05, gt=0, le=1)
    """Share of traffic moved to a new version per healthy step. A fraction, in (0, 1]."""
    step_interval: Seconds = Field(default=30.0, gt=0, le=86400)
    """Least time between two traffic steps. Seconds, in (0, 86400]."""
    min_samples: int = Field(default=20, ge=1, le=1_000_000)
    """Requests each version must serve in a step before the step is judged. Requests, in
    [1, 1000000]."""
    rollback_degradation: float = Field(default=0.15, gt=0, le=10)
    """Relative latency or error-rate degradation versus the live version that rolls back
    (0.15: 15 % worse). A ratio, in (0, 10]."""
    keep_versions: int = Field(default=3, ge=1, le=32)
    """Versions kept for rollback. Versions, in [1, 32]."""


class ResourceLimits(BaseModel):
    """Device limits, as shares of what the device has."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    memory: float = Field(default=0.75, gt=0, le=1)
    """Share of device memory Stepline may use. A fraction, in (0, 1]."""
    compute: float = Field(default=0.90, gt=0, le=1)
    """Share of device compute Stepline may use. A fraction, in (0, 1]."""


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
    stops); the chunks since are replayed from it on another worker. Chunks, in [1, 1000]."""


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
