"""MoE text generation: recipes, the expert cache, the router, hot update and the chunk runner.

``get_runner()`` returns the worker's runner for job kind ``"text"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.moe.expert_cache import CacheConfig, ExpertCache, residency_fit
from workers.moe.params import TextParams, validate_params
from workers.moe.router import RouterConfig
from workers.moe.runner import TextRunner
from workers.runner import JobRunner

if TYPE_CHECKING:
    from app.settings.moe import MoeSettings

_MIB = 1024 * 1024
_RUNNERS: dict[tuple[str, str], TextRunner] = {}


def get_runner(settings: MoeSettings | None = None, device: str = "cpu") -> JobRunner:
    """The process's text runner for ``settings`` (the reference defaults when None) on
    ``device``; one instance per distinct configuration, since it holds the loaded models."""
    key = (settings.model_dump_json() if settings is not None else "", device)
    if key not in _RUNNERS:
        router, cache = (
            (router_config(settings), cache_config(settings, device))
            if settings is not None
            else (RouterConfig(), CacheConfig())
        )
        _RUNNERS[key] = TextRunner(router=router, cache=cache, device=device)
    return _RUNNERS[key]


def residency(hot_experts: int = 16) -> dict[str, dict[str, object]]:
    """What this process's expert caches hold, per model (empty before any text job ran)."""
    merged: dict[str, dict[str, object]] = {}
    for runner in _RUNNERS.values():
        merged.update(runner.residency(hot_experts))
    return merged


def router_config(settings: MoeSettings) -> RouterConfig:
    """The router block of the settings as a :class:`RouterConfig`."""
    r = settings.router
    return RouterConfig(
        k=r.k,
        temperature=r.temperature,
        expert_capacity=r.expert_capacity,
        fallback=r.fallback_strategy,
        diversity_penalty=r.diversity_penalty,
    )


def cache_config(settings: MoeSettings, device: str) -> CacheConfig:
    """The cache block as a :class:`CacheConfig`; the budget defaults to the device share."""
    c = settings.cache
    budget: int | None = int(c.budget_mb * _MIB) if c.budget_mb is not None else None
    if budget is None and device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
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


__all__ = [
    "CacheConfig",
    "ExpertCache",
    "RouterConfig",
    "TextParams",
    "TextRunner",
    "get_runner",
    "residency",
    "residency_fit",
    "validate_params",
]
