"""The state of a diffusion job between chunks, and its exact round trip through a Checkpoint.

Latents, conditioning (prompt/class embeddings, negative ones under CFG), the scheduler's full
runtime state, the RNG state, and — inside a step stopped at a block-group boundary — the
step's pass inputs, finished pass outputs, hidden states and block context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.checkpoint import Checkpoint
from workers.diffusion.scheduler_state import restore_scheduler_state, save_scheduler_state
from workers.diffusion.step_cache import StepCache, cache_from_checkpoint, cache_to_checkpoint
from workers.errors import CheckpointError

Tensors = dict[str, torch.Tensor]
STATE_VERSION = 2
"""2: the scheduler's state is its difference from the job's set-up scheduler (timesteps set),
not from an unset one, so version-1 checkpoints are refused rather than resumed wrongly."""
STEP_CACHE_STATE_VERSION = 3
"""3: version 2 plus the job's step cache (settings and tensors), written only for a job with one:
a worker that predates step caches refuses it rather than resume the job uncached, and every
uncached checkpoint stays version 2 (read as a job without a step cache)."""
INPAINT_STATE_VERSION = 4
"""4: an inpainting job's state, its blend inputs (image latents, initial noise, mask) under
``inpaint.``, with or without a step cache: a worker that predates inpainting refuses it rather
than resume the job unblended, and every other checkpoint keeps its version (2 or 3)."""
VERSIONS = (STATE_VERSION, STEP_CACHE_STATE_VERSION, INPAINT_STATE_VERSION)


@dataclass(slots=True)
class StepProgress:
    """How far a denoising step got: pass ``pass_index``, next block group ``group``."""

    step: int
    inputs: list[Tensors]
    sample: torch.Tensor
    outputs: list[torch.Tensor] = field(default_factory=list)
    pass_index: int = 0
    group: int = 0
    hidden: torch.Tensor | None = None
    ctx: Tensors | None = None


@dataclass(slots=True)
class JobState:
    """Everything needed to run the next chunk of a diffusion job exactly."""

    model: str
    scheduler_name: str
    next_chunk: int
    latents: torch.Tensor
    cond: Tensors
    scheduler: Any
    generator: torch.Generator
    progress: StepProgress | None = None
    adapters: list[tuple[str, float]] = field(default_factory=list)
    """The LoRA adapters (name, scale) the job's forwards apply: part of its state, so a resume
    under another adapter set is refused rather than blended."""
    step_cache: StepCache | None = None
    """The job's step cache and what it keeps between steps (None: every block runs)."""
    inpaint: Tensors | None = None
    """An inpainting job's blend inputs after each step (image latents, initial noise, mask;
    :mod:`workers.diffusion.inpainting`); None for any other job."""


def _put_group(tensors: Tensors, prefix: str, group: Tensors) -> list[str]:
    for key, value in group.items():
        tensors[f"{prefix}{key}"] = value.detach().clone()  # clone: no shared storage in the file
    return sorted(group)


def _own(tensor: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``tensor`` on ``dev`` in storage of its own: a decoded tensor views the checkpoint's bytes,
    whose alignment differs from a fresh allocation's, and CPU kernels pick their vectorised
    paths by alignment, so a view could round differently from the uninterrupted run."""
    return tensor.to(dev, copy=True)


def memory_orders(tensors: Tensors) -> dict[str, list[int]]:
    """Each tensor laid out in memory other than row-major (a channels-last latent, as a VAE
    encoding or ``scale_noise`` leaves it), with its dimensions from the outermost in memory.
    The checkpoint's bytes are row-major; kernels choose their paths by layout, so a resumed
    tensor must be laid out as the uninterrupted run's was to round alike."""
    orders = {}
    for key, tensor in tensors.items():
        if tensor.dim() > 1 and not tensor.is_contiguous():
            strides = tensor.stride()
            order = sorted(range(tensor.dim()), key=lambda d: (-strides[d], d))
            if tensor.permute(order).is_contiguous():
                orders[key] = order
    return orders


def laid_out(tensors: Tensors, orders: dict[str, list[int]]) -> Tensors:
    """``tensors`` with each one named in ``orders`` copied into that memory order."""
    out = dict(tensors)
    for key, order in orders.items():
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out[key] = tensors[key].permute(order).contiguous().permute(inverse)
    return out


def _take_group(tensors: Tensors, prefix: str, keys: list[str], dev: torch.device) -> Tensors:
    return {key: _own(tensors[f"{prefix}{key}"], dev) for key in keys}


def _progress_to(p: StepProgress, tensors: Tensors) -> dict[str, Any]:
    tensors["partial.sample"] = p.sample.detach().clone()
    in_keys = [_put_group(tensors, f"partial.in.{i}.", x) for i, x in enumerate(p.inputs)]
    for i, out in enumerate(p.outputs):
        tensors[f"partial.out.{i}"] = out.detach().clone()
    if p.hidden is not None:
        tensors["partial.hidden"] = p.hidden.detach().clone()
    ctx_keys = _put_group(tensors, "partial.ctx.", p.ctx or {})
    return {"step": p.step, "pass": p.pass_index, "group": p.group, "in_keys": in_keys,
            "outputs": len(p.outputs), "hidden": p.hidden is not None, "ctx_keys": ctx_keys}


def _progress_from(m: dict[str, Any], tensors: Tensors, dev: torch.device) -> StepProgress:
    return StepProgress(
        step=int(m["step"]), pass_index=int(m["pass"]), group=int(m["group"]),
        sample=_own(tensors["partial.sample"], dev),
        inputs=[_take_group(tensors, f"partial.in.{i}.", keys, dev)
                for i, keys in enumerate(m["in_keys"])],
        outputs=[_own(tensors[f"partial.out.{i}"], dev) for i in range(int(m["outputs"]))],
        hidden=_own(tensors["partial.hidden"], dev) if m["hidden"] else None,
        ctx=_take_group(tensors, "partial.ctx.", m["ctx_keys"], dev) if m["hidden"] else None,
    )


def state_to_checkpoint(s: JobState, baseline: Any) -> Checkpoint:
    """Encode ``s``; ``baseline`` is the job's scheduler as set up, before any step."""
    tensors: Tensors = {"latents": s.latents.detach().clone(), "rng": s.generator.get_state()}
    cond_keys = _put_group(tensors, "cond.", s.cond)
    sched_tensors, sched_meta = save_scheduler_state(s.scheduler, baseline)
    tensors.update(sched_tensors)
    meta: dict[str, Any] = {
        "version": STATE_VERSION, "model": s.model, "scheduler": s.scheduler_name,
        "next_chunk": s.next_chunk, "cond_keys": cond_keys, "scheduler_state": sched_meta,
        "partial": None if s.progress is None else _progress_to(s.progress, tensors),
    }
    if s.inpaint is not None:  # before the memory orders: an image latent's layout is kept
        meta["version"] = INPAINT_STATE_VERSION
        meta["inpaint_keys"] = _put_group(tensors, "inpaint.", s.inpaint)
    if orders := memory_orders(tensors):
        meta["memory_orders"] = orders
    if s.adapters:
        meta["adapters"] = [[name, scale] for name, scale in s.adapters]
    if s.step_cache is not None:
        meta["version"] = max(meta["version"], STEP_CACHE_STATE_VERSION)
        meta["step_cache"] = cache_to_checkpoint(s.step_cache, tensors)
    return Checkpoint(tensors=tensors, meta=meta)


def state_from_checkpoint(ck: Checkpoint, fresh_scheduler: Any, dev: torch.device) -> JobState:
    """Decode a checkpoint written by :func:`state_to_checkpoint` onto ``dev``;
    ``fresh_scheduler`` is a copy of the same baseline, the saved state is set on it."""
    m, t = ck.meta, laid_out(ck.tensors, ck.meta.get("memory_orders", {}))
    if m.get("version") not in VERSIONS:
        raise CheckpointError(f"diffusion state version {m.get('version')!r} is not one of "
                              f"{', '.join(map(str, VERSIONS))}")
    cached = m["version"] == STEP_CACHE_STATE_VERSION or "step_cache" in m
    try:
        generator = torch.Generator(device="cpu")
        generator.set_state(t["rng"])
        scheduler = restore_scheduler_state(fresh_scheduler, t, m["scheduler_state"], dev)
        return JobState(
            model=m["model"], scheduler_name=m["scheduler"], next_chunk=int(m["next_chunk"]),
            latents=_own(t["latents"], dev), cond=_take_group(t, "cond.", m["cond_keys"], dev),
            scheduler=scheduler, generator=generator,
            progress=None if m["partial"] is None else _progress_from(m["partial"], t, dev),
            adapters=[(str(name), float(scale)) for name, scale in m.get("adapters", [])],
            step_cache=cache_from_checkpoint(m["step_cache"], t, dev) if cached else None,
            inpaint=_take_group(t, "inpaint.", m["inpaint_keys"], dev)
            if m["version"] == INPAINT_STATE_VERSION else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"diffusion checkpoint is incomplete: {exc!r}") from exc
