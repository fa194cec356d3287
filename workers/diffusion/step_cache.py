"""diffusers' First Block Cache in the blockwise forward, with its state in the job's checkpoint.

The decision rule and the state are ``diffusers.hooks.first_block_cache``'s: per denoiser call
context (the library keys state by ``cache_context`` name; here by expert and pass), the first
block's output and residual of the last *fully computed* forward, and the residual the other
blocks added to that output. A forward skips its other blocks when
``mean|r - r_prev| / mean|r_prev| <= threshold``; a skipped forward leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.diffusion.blockwise import BlockwiseForward
from workers.diffusion.cache_params import StepCacheParams, step_cache_of
from workers.errors import CheckpointError, ParamsError

Tensors = dict[str, torch.Tensor]
_FIELDS = ("head_output", "head_residual", "tail_residual")


@dataclass(slots=True)
class FirstBlockSlot:
    """``FBCSharedBlockState`` of one call context: what its last full forward left."""

    head_output: torch.Tensor
    """The first block's output."""
    head_residual: torch.Tensor
    """The first block's output minus its input: what the next forward's is compared with."""
    tail_residual: torch.Tensor | None = None
    """The last block's output minus ``head_output`` (None until that forward reaches it)."""


@dataclass(slots=True)
class StepCache:
    """A job's step cache: its settings, each call context's slot, and how often it reused."""

    settings: StepCacheParams
    slots: dict[str, FirstBlockSlot] = field(default_factory=dict)
    hits: int = 0
    """Forwards that ran the first block only and reused the cached tail residual."""
    misses: int = 0
    """Forwards that ran every block (and refreshed the cache)."""


def new_step_cache(params: Mapping[str, Any]) -> StepCache | None:
    """An empty cache for a job whose parameters ask for one, else None."""
    settings = step_cache_of(params)
    return None if settings is None else StepCache(settings)


def cache_settings(cache: StepCache | None) -> StepCacheParams | None:
    return None if cache is None else cache.settings


def slot_name(expert: str, pass_index: int) -> str:
    """One call context: diffusers keeps one state per ``cache_context`` name of each model
    (WanPipeline: ``cond`` and ``uncond``, one per pass), so one per expert and pass."""
    return f"{expert}.{pass_index}"


def should_compute(residual: torch.Tensor, previous: torch.Tensor, threshold: float) -> bool:
    """``FBCHeadBlockHook._should_compute_remaining_blocks``, operation for operation."""
    absmean = (residual - previous).abs().mean()
    previous_absmean = previous.abs().mean()
    diff = (absmean / previous_absmean).item()
    return bool(diff > threshold)


def _head(cache: StepCache, name: str, block_in: torch.Tensor, block_out: torch.Tensor
          ) -> torch.Tensor | None:
    """After the first block: the forward's final hidden states when the rest is skipped, else
    None with the slot's head refreshed (``FBCHeadBlockHook.new_forward``)."""
    residual = block_out - block_in
    slot = cache.slots.get(name)
    if slot is not None and not should_compute(residual, slot.head_residual,
                                               cache.settings.threshold):
        if slot.tail_residual is None:
            raise CheckpointError(f"step cache slot {name!r} has no tail residual; "
                                  "resubmit the job")
        cache.hits += 1
        return slot.tail_residual + block_out
    cache.misses += 1
    if slot is None:
        cache.slots[name] = FirstBlockSlot(head_output=block_out, head_residual=residual)
    else:
        slot.head_output, slot.head_residual = block_out, residual
    return None


def run_blocks_cached(cache: StepCache, name: str, adapter: BlockwiseForward, model: Any,
                      start: int, stop: int, hidden: torch.Tensor, ctx: Tensors
                      ) -> tuple[torch.Tensor, bool]:
    """Blocks ``start`` to ``stop - 1`` of call context ``name`` under the cache; True when the
    first block found the forward close enough to the cached one and the rest was skipped
    (the hidden states returned are then the forward's final ones)."""
    last = adapter.num_blocks(model) - 1
    if last < 1:
        raise ParamsError("a first block cache needs a transformer of two blocks or more; "
                          "submit the job without step_cache")
    for index in range(start, stop):
        out = adapter.block(model, index, hidden, ctx)
        if index == 0 and (final := _head(cache, name, hidden, out)) is not None:
            return final, True
        if index == last:
            cache.slots[name].tail_residual = out - cache.slots[name].head_output
        hidden = out
    return hidden, False


def cache_to_checkpoint(cache: StepCache, tensors: Tensors) -> dict[str, Any]:
    """Put the cache's tensors (copies) into ``tensors``; its JSON metadata."""
    slots: dict[str, list[str]] = {}
    for name, slot in cache.slots.items():
        present = [f for f in _FIELDS if getattr(slot, f) is not None]
        for f in present:
            tensors[f"cache.{name}.{f}"] = getattr(slot, f).detach().clone()
        slots[name] = present
    return {**cache.settings.model_dump(), "hits": cache.hits, "misses": cache.misses,
            "slots": slots}


def cache_from_checkpoint(meta: Mapping[str, Any], tensors: Tensors, dev: torch.device
                          ) -> StepCache:
    """The cache :func:`cache_to_checkpoint` wrote; each tensor in storage of its own (as
    ``state._own``: a view of the file's bytes could round differently)."""
    settings = StepCacheParams(kind=meta["kind"], threshold=meta["threshold"])
    slots = {}
    for name, present in meta["slots"].items():
        values = {f: tensors[f"cache.{name}.{f}"].to(dev, copy=True) for f in present}
        slots[str(name)] = FirstBlockSlot(**values)
    return StepCache(settings, slots, hits=int(meta["hits"]), misses=int(meta["misses"]))
