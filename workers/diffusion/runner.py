"""The image/video job runner: ``encode`` → ``denoise[0..E-1]`` → ``decode``, resumable anywhere.

A denoise chunk is one model evaluation (one iteration of the pipeline's loop), so ``E`` is the
scheduler's ``len(timesteps)``: a second-order step is two chunks. A chunk runs its transformer
block by block in ``block_groups`` groups and asks ``should_yield`` between groups; when told to,
it checkpoints the partial evaluation and returns ``complete=False``, and the same chunk index
later continues from there, bit-exactly. :meth:`DiffusionRunner.run_batch` runs the denoise
chunks of several jobs of one model and shape as one transformer forward per pass, their encode
chunks as one text-encoder call and their decode chunks as one VAE decode.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.checkpoint import Checkpoint
from workers.diffusion.adapters import (
    AdapterRegistry,
    AdapterSpec,
    adapter_digests,
    adapter_registry,
    adapter_set,
    adapter_set_key,
    check_weights,
)
from workers.diffusion.artifacts import VIDEO_FPS, image_artifact, video_artifact
from workers.diffusion.batching import batch_groups, decode_together, run_passes_together
from workers.diffusion.blockwise import BlockwiseForward, group_bounds, run_blocks
from workers.diffusion.cache_params import step_cache_key, step_cache_of
from workers.diffusion.components import (
    DiffusionComponents,
    component_key,
    load_components,
    model_evaluations,
    scheduler_baseline,
    stage_components,
    timed_scheduler,
)
from workers.diffusion.conditioning import image_latents, pipeline_layout, skipped, start_at
from workers.diffusion.families import (
    ExpertFamily,
    ImageFamily,
    MaskFamily,
    PipelineFamily,
    SizedScheduleFamily,
    decode_job,
)
from workers.diffusion.inpainting import blend, is_masked
from workers.diffusion.inputs import is_conditioned
from workers.diffusion.lora import apply_adapters, loaded_adapters
from workers.diffusion.pipelines import ADAPTERS, FAMILIES
from workers.diffusion.recipes import DiffusionRecipe, diffusion_recipe
from workers.diffusion.scheduler_state import copy_scheduler
from workers.diffusion.state import (
    JobState,
    StepProgress,
    Tensors,
    state_from_checkpoint,
    state_to_checkpoint,
)
from workers.diffusion.step_cache import (
    cache_settings,
    new_step_cache,
    run_blocks_cached,
    slot_name,
)
from workers.errors import CheckpointError, ParamsError
from workers.registry import ModelRegistry
from workers.residency import process_residency
from workers.runner import BatchItem, ChunkPlan, ChunkResult, ShouldYield

log = logging.getLogger(__name__)


def _never_yield() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class RestoredChunk:
    """A batch item's denoise or decode chunk with its job state restored, and what that took."""

    item: BatchItem
    job: JobState
    restore_s: float


def chunk_names(evaluations: int) -> tuple[str, ...]:
    """``encode``, ``denoise[0]`` … ``denoise[evaluations-1]``, ``decode``."""
    return tuple(chunk_name(evaluations, index) for index in range(evaluations + 2))


def chunk_name(evaluations: int, index: int) -> str:
    """Chunk ``index``'s name in :func:`chunk_names` (without building them all each step)."""
    if index == 0:
        return "encode"
    return f"denoise[{index - 1}]" if index <= evaluations else "decode"


class DiffusionRunner:
    """Runs image or video jobs (``kind``) with parameters from :func:`validate_params`;
    ``max_batch`` bounds how many jobs' chunks :meth:`run_batch` runs together; a job's LoRA
    adapters come from ``adapters`` (default: ``configs/adapters``)."""

    def __init__(self, kind: str, block_groups: int = 2, device: str = "cpu",
                 registry: ModelRegistry | None = None, video_fps: int = VIDEO_FPS,
                 max_batch: int = 8, adapters: AdapterRegistry | None = None) -> None:
        if kind not in ("image", "video"):
            raise ParamsError(f"kind {kind!r} is not a diffusion kind; use image or video")
        if max_batch < 1:
            raise ParamsError(f"max_batch is {max_batch}; use 1 (no batching) or more")
        self.kind = kind
        self.max_batch = max_batch
        self.block_groups = block_groups
        self.device = device
        self.registry = registry
        self.video_fps = video_fps
        self.adapters = adapters or adapter_registry()
        self._recipes: dict[str, DiffusionRecipe] = {}

    def recipe(self, params: Mapping[str, Any]) -> DiffusionRecipe:
        name = str(params["model"])
        recipe = self._recipes.get(name)  # a step asks several times; parsed once anyway
        if recipe is None:
            recipe = self._recipes[name] = diffusion_recipe(name, self.registry)
        return recipe

    def components(self, params: Mapping[str, Any]) -> DiffusionComponents:
        return load_components(self.recipe(params), self.device)

    def stage(self, params: Mapping[str, Any]) -> bool:
        """Build the job's base model into host memory ahead of it (its adapters load on the
        device with its first chunk)."""
        return stage_components(self.recipe(params), self.device)

    def transformer(self, params: Mapping[str, Any], expert: str = "transformer") -> Any:
        """The resident transformer with the job's adapters, at its scales, the only ones
        active (loaded on first use; the base is never rebuilt for them); ``expert``: the
        component of a two-expert recipe's step (its ``transformer_2`` takes no adapters)."""
        c = self.components(params)
        if expert != "transformer":
            if adapter_set(params):
                raise ParamsError(f"model {c.recipe.name!r} applies no adapters to {expert}")
            return getattr(c, expert)
        chosen = [(self._adapter(name, params), scale) for name, scale in adapter_set(params)]
        if not chosen:
            return apply_adapters(c.recipe.family, c.transformer, chosen)
        # the residency counts, times and advertises them (placement reads them in the
        # heartbeat), and a load a chunk waits for is announced like a base model's
        residency, key = process_residency(), component_key(c.recipe, self.device)
        have = set(loaded_adapters(c.transformer))
        missing = [spec.name for spec, _ in chosen if spec.name not in have]
        announce = residency.loading(key, residency.expected_adapters_s(missing), "adapter") \
            if missing else contextlib.nullcontext()
        with announce:
            transformer = apply_adapters(
                c.recipe.family, c.transformer, chosen,
                on_load=lambda name, seconds: residency.adapter_loaded(key, name, seconds))
        residency.note_adapters(key, loaded_adapters(c.transformer))
        return transformer

    def _adapter(self, name: str, params: Mapping[str, Any]) -> AdapterSpec:
        spec = self.adapters.get(name)
        if spec is None or spec.base != params["model"]:
            raise ParamsError(f"adapter {name!r} of model {params['model']!r} is not registered "
                              "on this worker (diffusion.adapters_dir); register it there")
        check_weights(spec, adapter_digests(params).get(name))
        return spec

    def evaluations(self, params: Mapping[str, Any]) -> int:
        """Denoise chunks of the job: its scheduler's model evaluations (those an
        image-conditioned job skips left out)."""
        return model_evaluations(self.recipe(params), str(params["scheduler"]),
                                 int(params["num_inference_steps"])) - self._skipped(params)

    def _skipped(self, params: Mapping[str, Any]) -> int:
        """The scheduler's timesteps before the job's first (image-conditioned jobs only)."""
        if not is_conditioned(params):
            return 0
        scheduler = timed_scheduler(self.recipe(params), str(params["scheduler"]),
                                    int(params["num_inference_steps"]))
        return skipped(params, int(scheduler.order), self.recipe(params).family)

    def _timestep(self, params: Mapping[str, Any], scheduler: Any, step: int) -> Any:
        """The timestep of the job's denoise step ``step`` (0: its first)."""
        return scheduler.timesteps[self._skipped(params) + step]

    def _next_timestep(self, params: Mapping[str, Any], scheduler: Any, step: int) -> Any:
        """The timestep after the job's denoise step ``step``; None after its last."""
        return None if step + 1 >= self.evaluations(params) else \
            self._timestep(params, scheduler, step + 1)

    def plan(self, params: Mapping[str, Any]) -> ChunkPlan:
        r = self.recipe(params)
        evals = self.evaluations(params)
        costs = (r.cost_units.encode, *([r.cost_units.denoise] * evals), r.cost_units.decode)
        shape = f"{params['height']}x{params['width']}x{params['num_frames']}"
        cache = step_cache_key(step_cache_of(params))  # cached steps cost less: learned apart
        return ChunkPlan(names=chunk_names(evals), cost_units=costs,
                         cost_key=f"{r.name}:{shape}{cache}")

    def run_chunk(self, params: Mapping[str, Any], index: int, state: Checkpoint | None,
                  should_yield: ShouldYield) -> ChunkResult:
        evals = self.evaluations(params)
        started_s = time.perf_counter()
        with torch.no_grad():
            if index == 0:
                result = self._encode(params)
            elif 1 <= index <= evals + 1:
                job = self._restore(params, index, state)
                if index <= evals:
                    result = self._denoise(params, job, should_yield)
                else:
                    result = self._decode(params, job)
            else:
                raise ParamsError(f"chunk index {index} is out of range; this job has {evals + 2}")
        result.metrics.update(chunk=chunk_name(evals, index),
                              compute_s=time.perf_counter() - started_s)
        return result

    def batch_key(self, params: Mapping[str, Any], index: int) -> str | None:
        """Model, adapter set (names and scales), ControlNet and shape for a denoise chunk: jobs
        that agree on them share a forward whatever their prompt, seed, guidance, scheduler,
        step or ControlNet scale (each job's residuals are its own inputs). An encode
        or decode chunk adds its name, so it batches only with its own kind. None for an index
        out of range, and for a denoise chunk of a job with a step cache (whether a forward skips
        blocks is each job's own decision, on its own rows)."""
        evaluations = self.evaluations(params)
        if not 0 <= index <= evaluations + 1:
            return None
        if 1 <= index <= evaluations and step_cache_of(params) is not None:
            return None
        shape = f"{params['height']}x{params['width']}x{params['num_frames']}"
        control = f"+controlnet:{params['controlnet']}" if params.get("controlnet") else ""
        key = f"{self.recipe(params).name}{adapter_set_key(adapter_set(params))}{control}:{shape}"
        if index == 0:
            return f"{key}:encode"
        if index == evaluations + 1:
            return f"{key}:decode"
        expert = self._planned_expert(params, index)
        return key if expert == "transformer" else f"{key}:{expert}"

    def _planned_expert(self, params: Mapping[str, Any], index: int) -> str:
        """The transformer denoise chunk ``index`` runs on, from the job's timesteps alone (no
        model is loaded: the API asks this too)."""
        family, recipe = self._family(params), self.recipe(params)
        if not isinstance(family, ExpertFamily):
            return "transformer"
        scheduler = timed_scheduler(recipe, str(params["scheduler"]),
                                    int(params["num_inference_steps"]))
        return family.expert(recipe, scheduler, self._timestep(params, scheduler, index - 1))

    def _expert(self, params: Mapping[str, Any], job: JobState, step: int) -> str:
        """The transformer that runs ``step`` of ``job``, by its own scheduler's timestep."""
        family = self._family(params)
        if not isinstance(family, ExpertFamily):
            return "transformer"
        return family.expert(self.recipe(params), job.scheduler,
                             self._timestep(params, job.scheduler, step))

    def run_batch(self, items: Sequence[BatchItem]) -> list[ChunkResult]:
        """Each item's chunk; chunks of equal :meth:`batch_key` (at most ``max_batch`` at a time,
        in item order) together: encodes in one text-encoder call, denoise steps in one forward
        per pass, decodes in one VAE decode. A chunk with no key, a step already in progress
        (a block-group yield) or no partner runs as :meth:`run_chunk` runs it."""
        keys = [self.batch_key(item.params, item.index) for item in items]
        restored = {position: self._timed_restore(item)
                    for position, (item, key) in enumerate(zip(items, keys, strict=True))
                    if key is not None and item.index > 0}  # denoise and decode chunks
        for position, r in restored.items():
            if r.job.progress is not None:
                keys[position] = None  # finish the interrupted step exactly as it began
        results: dict[int, ChunkResult] = {}
        for group in batch_groups(keys, self.max_batch):
            results.update(zip(group, self._run_group(items, group, restored), strict=True))
        return [results[position] for position in range(len(items))]

    def decode_pixels(self, params: Mapping[str, Any], state: Checkpoint) -> torch.Tensor:
        """Pixels in [0, 1] of a fully denoised state: what the ``decode`` chunk encodes."""
        with torch.no_grad():
            job = self._restore(params, self.evaluations(params) + 1, state)
            c = self.components(params)
            return decode_job(self._family(params), c, params,
                              pipeline_layout(params, job.latents, c.recipe.family))

    def _family(self, params: Mapping[str, Any]) -> PipelineFamily:
        return FAMILIES[self.recipe(params).family]

    def _baseline(self, params: Mapping[str, Any]) -> Any:
        """The job's scheduler as its encode chunk set it up, never stepped: shared, read-only.
        A checkpoint holds what differs from it, and a chunk resumes on a copy of it."""
        c, family = self.components(params), self._family(params)
        steps = int(params["num_inference_steps"])
        if isinstance(family, SizedScheduleFamily):
            sized = family
            return scheduler_baseline(
                c, str(params["scheduler"]), int(params["seed"]), steps,
                lambda scheduler: sized.set_job_timesteps(c, params, scheduler, steps),
                size=f"{params['height']}x{params['width']}")
        return scheduler_baseline(c, str(params["scheduler"]), int(params["seed"]), steps,
                                  lambda scheduler: family.set_timesteps(c, scheduler, steps))

    def _restore(self, params: Mapping[str, Any], index: int, state: Checkpoint | None) -> JobState:
        if state is None:
            raise CheckpointError(f"chunk {index} needs the state the previous chunk wrote")
        live, state.live = state.live, None  # taken once: a second resume rebuilds
        adapters = adapter_set(params)
        cache = step_cache_of(params)
        if isinstance(live, JobState) and live.next_chunk == index \
                and live.model == params["model"] and live.adapters == adapters \
                and cache_settings(live.step_cache) == cache:
            return live  # the state this runner saved it from: equal to a rebuild, and cheaper
        job = state_from_checkpoint(state, copy_scheduler(self._baseline(params)),
                                    self.components(params).device)
        if job.next_chunk != index or job.model != params["model"]:
            raise CheckpointError(
                f"checkpoint is for chunk {job.next_chunk} of model {job.model!r}, "
                f"not chunk {index} of {params['model']!r}"
            )
        if job.adapters != adapters:
            raise CheckpointError(f"checkpoint is for adapters {job.adapters}, not {adapters}")
        if cache_settings(job.step_cache) != cache:
            raise CheckpointError(f"checkpoint is for step cache {cache_settings(job.step_cache)}, "
                                  f"not {cache}")
        return job

    def _save(self, params: Mapping[str, Any], job: JobState) -> Checkpoint:
        """The checkpoint of ``job`` (its tensors copies: the job runs on); the job itself
        rides along as its ``live`` state for a resume on this worker."""
        checkpoint = state_to_checkpoint(job, self._baseline(params))
        checkpoint.live = job
        return checkpoint

    def _encode(self, params: Mapping[str, Any]) -> ChunkResult:
        return self._encoded(params, self._family(params).encode(self.components(params), params))

    def _encoded(self, params: Mapping[str, Any], cond: Tensors) -> ChunkResult:
        """The encode chunk's state around the job's conditioning ``cond``: its own scheduler,
        and initial noise drawn from its own seed, alone or in a batch."""
        generator = torch.Generator(device="cpu").manual_seed(int(params["seed"]))
        scheduler = copy_scheduler(self._baseline(params))  # built, timesteps set: as the pipeline
        if len(scheduler.timesteps) - self._skipped(params) != self.evaluations(params):
            raise ParamsError(
                f"scheduler {params['scheduler']!r} made {len(scheduler.timesteps)} timesteps, not "
                f"the {self.evaluations(params)} this job was planned with; resubmit it")
        latents, inpaint = self._init_latents(params, scheduler, generator)
        job = JobState(model=str(params["model"]), scheduler_name=str(params["scheduler"]),
                       next_chunk=1, latents=latents, cond=cond, scheduler=scheduler,
                       generator=generator, adapters=adapter_set(params),
                       step_cache=new_step_cache(params), inpaint=inpaint)
        return ChunkResult(state=self._save(params, job))

    def _init_latents(self, params: Mapping[str, Any], scheduler: Any,
                      generator: torch.Generator) -> tuple[torch.Tensor, Tensors | None]:
        """Pure noise, or for an image-conditioned job its image noised to its first step; and
        for an inpainting job what each of its steps blends with (None for any other)."""
        c, family = self.components(params), self._family(params)
        if not is_conditioned(params):
            return family.init_latents(c, params, scheduler, generator), None
        start_at(scheduler, params, c.recipe.family)
        if is_masked(params):
            if not isinstance(family, MaskFamily):
                raise ParamsError(f"model {c.recipe.name!r} takes no mask; leave mask out")
            return family.inpaint_latents(c, params, scheduler, generator)
        if isinstance(family, ImageFamily):
            return family.image_latents(c, params, scheduler, generator), None
        dtype = c.text_encoder.dtype if c.text_encoder is not None else c.transformer_dtype
        return image_latents(c, params, scheduler, generator, dtype), None

    def _start_step(self, params: Mapping[str, Any], job: JobState) -> StepProgress:
        step = job.next_chunk - 1
        t = self._timestep(params, job.scheduler, step)
        inputs, sample = self._family(params).passes(
            self.components(params), params, job.scheduler, job.latents, t, job.cond)
        return StepProgress(step=step, inputs=inputs, sample=sample)

    def _run_passes(self, params: Mapping[str, Any], job: JobState, p: StepProgress,
                    should_yield: ShouldYield) -> bool:
        """Advance ``p`` to the end of the step; False when it stopped at a group boundary."""
        expert = self._expert(params, job, p.step)
        model = self.transformer(params, expert)
        adapter = ADAPTERS[self.recipe(params).family]
        groups = group_bounds(adapter.num_blocks(model), self.block_groups)
        while p.pass_index < len(p.inputs):
            if p.hidden is None:
                p.hidden, p.ctx = adapter.prologue(model, p.inputs[p.pass_index])
            assert p.ctx is not None
            while p.group < len(groups):
                p.group = self._run_group_of(job, expert, p, adapter, model, groups)
                last = p.group == len(groups) and p.pass_index == len(p.inputs) - 1
                if not last and should_yield():
                    return False
            p.outputs.append(adapter.epilogue(model, p.hidden, p.ctx))
            p.pass_index, p.group, p.hidden, p.ctx = p.pass_index + 1, 0, None, None
        return True

    @staticmethod
    def _run_group_of(job: JobState, expert: str, p: StepProgress, adapter: BlockwiseForward,
                      model: Any, groups: Sequence[tuple[int, int]]) -> int:
        """Run block group ``p.group`` of the pass in progress; the next group to run (past the
        last when the job's step cache reused the rest of the forward)."""
        start, stop = groups[p.group]
        assert p.hidden is not None and p.ctx is not None
        if job.step_cache is None:
            p.hidden = run_blocks(adapter, model, start, stop, p.hidden, p.ctx)
            return p.group + 1
        name = slot_name(expert, p.pass_index)
        p.hidden, reused = run_blocks_cached(job.step_cache, name, adapter, model, start, stop,
                                             p.hidden, p.ctx)
        return len(groups) if reused else p.group + 1

    def _denoise(self, params: Mapping[str, Any], job: JobState,
                 should_yield: ShouldYield) -> ChunkResult:
        progress = job.progress or self._start_step(params, job)
        if not self._run_passes(params, job, progress, should_yield):
            job.progress = progress
            log.debug("model %s yielded in step %d at pass %d group %d", job.model,
                      progress.step, progress.pass_index, progress.group)
            return ChunkResult(state=self._save(params, job), complete=False,
                               metrics={"yielded_pass": progress.pass_index,
                                        "yielded_group": progress.group})
        return self._finish_step(params, job, progress)

    def _finish_step(self, params: Mapping[str, Any], job: JobState,
                     progress: StepProgress) -> ChunkResult:
        """Guidance and the scheduler step on the finished passes; the state of the next chunk."""
        c, family = self.components(params), self._family(params)
        t = self._timestep(params, job.scheduler, progress.step)
        if isinstance(family, ExpertFamily):
            params = family.step_params(c.recipe, params, job.scheduler, t)
        output = family.combine(c, params, progress.outputs)
        job.latents = family.step(job.scheduler, output, t, progress.sample, job.generator)
        if job.inpaint is not None:
            job.latents = blend(job.scheduler, job.inpaint, job.latents,
                                self._next_timestep(params, job.scheduler, progress.step))
        job.progress, job.next_chunk = None, job.next_chunk + 1
        return ChunkResult(state=self._save(params, job))

    def _alone(self, item: BatchItem) -> ChunkResult:
        result = self.run_chunk(item.params, item.index, item.state, _never_yield)
        result.metrics["batch_size"] = 1
        return result

    def _timed_restore(self, item: BatchItem) -> RestoredChunk:
        started_s = time.perf_counter()
        job = self._restore(item.params, item.index, item.state)
        return RestoredChunk(item, job, time.perf_counter() - started_s)

    def _run_group(self, items: Sequence[BatchItem], group: Sequence[int],
                   restored: Mapping[int, RestoredChunk]) -> list[ChunkResult]:
        """The chunks at positions ``group`` of ``items``, one batch group: together when there
        are several, else as :meth:`run_chunk` runs the chunk."""
        first = items[group[0]]
        if len(group) == 1:
            lone = restored.get(group[0])
            return [self._alone(first) if lone is None else self._restored_alone(lone)]
        if first.index == 0:
            return self._encode_together([items[position] for position in group])
        members = [restored[position] for position in group]
        if first.index > self.evaluations(first.params):
            return self._decode_together(members)
        return self._denoise_together(members)

    def _restored_alone(self, r: RestoredChunk) -> ChunkResult:
        """What :meth:`run_chunk` does with a denoise or decode chunk, from the restored job."""
        started_s = time.perf_counter()
        params = r.item.params
        with torch.no_grad():
            if r.item.index > self.evaluations(params):
                result = self._decode(params, r.job)
            else:
                result = self._denoise(params, r.job, _never_yield)
        self._add_metrics(result, r.item, time.perf_counter() - started_s + r.restore_s, 1)
        return result

    def _encode_together(self, items: Sequence[BatchItem]) -> list[ChunkResult]:
        """Each job's encode chunk, every prompt of all jobs in one text-encoder call; each
        job's scheduler and initial noise its own, as :meth:`_encode` makes them alone."""
        started_s = time.perf_counter()
        params = items[0].params
        c, family = self.components(params), self._family(params)
        with torch.no_grad():
            conds = family.encode_many(c, [item.params for item in items])
            results = [self._encoded(item.params, cond)
                       for item, cond in zip(items, conds, strict=True)]
        compute_s = time.perf_counter() - started_s
        for item, result in zip(items, results, strict=True):
            self._add_metrics(result, item, compute_s, len(items))
        log.debug("model %s: %d jobs' encodes shared a call", params["model"], len(items))
        return results

    def _decode_together(self, members: Sequence[RestoredChunk]) -> list[ChunkResult]:
        """Each job's decode chunk, all final latents in one VAE decode; each job's pixels and
        artifact then its own, as :meth:`_decode` makes them alone."""
        started_s = time.perf_counter()
        params = members[0].item.params
        c, family = self.components(params), self._family(params)
        with torch.no_grad():
            pixels = decode_together(family, c, [m.item.params for m in members],
                                     [pipeline_layout(m.item.params, m.job.latents, c.recipe.family)
                                      for m in members])
            results = [self._artifact(m.item.params, m.job, p)
                       for m, p in zip(members, pixels, strict=True)]
        compute_s = time.perf_counter() - started_s + sum(m.restore_s for m in members)
        for m, result in zip(members, results, strict=True):
            self._add_metrics(result, m.item, compute_s, len(members))
        log.debug("model %s: %d jobs' decodes shared a VAE call", members[0].job.model,
                  len(members))
        return results

    def _denoise_together(self, members: Sequence[RestoredChunk]) -> list[ChunkResult]:
        """One step of each job, every pass as one forward over all jobs that have it; then each
        job's own guidance, scheduler step and generator, as :meth:`_denoise` does alone."""
        experts = {self._expert(m.item.params, m.job, m.job.next_chunk - 1) for m in members}
        if len(experts) > 1:  # planned alike from timesteps, but each job steps its own
            return [self._restored_alone(m) for m in members]
        started_s = time.perf_counter()
        params = members[0].item.params
        model = self.transformer(params, experts.pop())
        adapter = ADAPTERS[self.recipe(params).family]
        with torch.no_grad():
            steps = [self._start_step(m.item.params, m.job) for m in members]
            outputs, shared_with = run_passes_together(adapter, model, [s.inputs for s in steps])
            results = []
            for m, step, outs in zip(members, steps, outputs, strict=True):
                step.outputs, step.pass_index = outs, len(step.inputs)
                results.append(self._finish_step(m.item.params, m.job, step))
        # every member waited for the whole batch: its compute is the batch's, restores included
        compute_s = time.perf_counter() - started_s + sum(m.restore_s for m in members)
        for m, result, size in zip(members, results, shared_with, strict=True):
            self._add_metrics(result, m.item, compute_s, size)
        log.debug("model %s: %d jobs' steps shared a forward", members[0].job.model, len(members))
        return results

    def _add_metrics(self, result: ChunkResult, item: BatchItem, compute_s: float,
                     batch_size: int) -> None:
        result.metrics.update(chunk=chunk_name(self.evaluations(item.params), item.index),
                              compute_s=compute_s, batch_size=batch_size)

    def _decode(self, params: Mapping[str, Any], job: JobState) -> ChunkResult:
        c = self.components(params)
        pixels = decode_job(self._family(params), c, params,
                            pipeline_layout(params, job.latents, c.recipe.family))
        return self._artifact(params, job, pixels)

    def _artifact(self, params: Mapping[str, Any], job: JobState, pixels: torch.Tensor
                  ) -> ChunkResult:
        """The decode chunk's result: the job's artifact from its pixels, and a done state."""
        fmt = str(params["output_format"])
        if self.kind == "image":
            artifact = image_artifact(pixels, fmt)
        else:
            artifact, fmt = video_artifact(pixels, fmt, self.video_fps)
        done = Checkpoint(meta={"model": job.model, "next_chunk": job.next_chunk + 1, "done": True})
        return ChunkResult(state=done, artifact=artifact, metrics={"output_format": fmt})
