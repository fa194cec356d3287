"""MoE text generation: recipes, the expert cache, the router, hot update and the chunk runner.

``get_runner()`` returns the worker's runner for job kind ``"text"``.
"""

from __future__ import annotations

import torch

from workers.moe.expert_cache import CacheConfig, ExpertCache, residency_fit
from workers.moe.params import TextParams, validate_params
from workers.moe.router import RouterConfig
from workers.moe.runner import TextRunner
from workers.runner import JobRunner

_RUNNERS: dict[tuple[str, str, str], TextRunner] = {}


def get_runner(
    router: RouterConfig | None = None, cache: CacheConfig | None = None, device: str = "cpu"
) -> JobRunner:
    """The process's text runner for this router and cache configuration (the reference
    defaults when None) on ``device``; one instance per distinct configuration, since it holds
    the loaded models."""
    router, cache = router or RouterConfig(), cache or CacheConfig()
    key = (repr(router), repr(cache), device)
    if key not in _RUNNERS:
        _RUNNERS[key] = TextRunner(router=router, cache=cache, device=device)
    return _RUNNERS[key]


def residency(hot_experts: int = 16) -> dict[str, dict[str, object]]:
    """What this process's expert caches hold, per model (empty before any text job ran)."""
    merged: dict[str, dict[str, object]] = {}
    for runner in _RUNNERS.values():
        merged.update(runner.residency(hot_experts))
    return merged


def device_memory_bytes(device: str) -> int | None:
    """Total memory of a CUDA device (None for the CPU, whose budget is the host's business)."""
    if not device.startswith("cuda"):
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


__all__ = [
    "CacheConfig",
    "ExpertCache",
    "RouterConfig",
    "TextParams",
    "TextRunner",
    "device_memory_bytes",
    "get_runner",
    "residency",
    "residency_fit",
    "validate_params",
]
