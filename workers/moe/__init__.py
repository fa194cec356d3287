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


def unload_idle(now_s: float) -> int:
    """Idle-unload the experts of every loaded model of this process (``now_s`` on the
    runners' clock, ``time.monotonic()``); returns how many were unloaded."""
    return sum(runner.tick(now_s) for runner in _RUNNERS.values())


def cache_totals() -> dict[str, float]:
    """This process's expert caches summed over models and versions: stall-free ``hits``,
    ``misses`` (every access that waited: demand loads and late prefetches), stall seconds,
    bytes moved, prefetch outcomes, and expert runs with the token routings they served (hits
    per token and per run) — the heartbeat's ``expert_cache`` entry."""
    totals: dict[str, float] = {"hits": 0, "misses": 0, "stall_s": 0.0, "bytes_moved": 0,
                                "prefetch_issued": 0, "prefetch_used": 0, "prefetch_wasted": 0,
                                "expert_runs": 0, "token_lookups": 0, "token_hits": 0}
    for runner in _RUNNERS.values():
        for session in runner.loaded_sessions().values():
            c = session.cache.counters
            totals["hits"] += c.hits
            totals["misses"] += c.misses + c.late
            totals["stall_s"] += c.stall_s
            totals["bytes_moved"] += c.bytes_moved
            totals["prefetch_issued"] += c.prefetch_issued
            totals["prefetch_used"] += c.prefetch_used
            totals["prefetch_wasted"] += c.prefetch_wasted
            totals["expert_runs"] += c.expert_runs
            totals["token_lookups"] += c.token_lookups
            totals["token_hits"] += c.token_hits
    return totals


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
    "cache_totals",
    "device_memory_bytes",
    "get_runner",
    "residency",
    "residency_fit",
    "unload_idle",
    "validate_params",
]
