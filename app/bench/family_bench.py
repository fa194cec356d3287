"""``stepline bench --families``: per diffusion family, the library's own pipeline against
Stepline's chunked runner, and what First Block Cache saves.

For every image and video recipe in the registry (each family's tiny config), in one process:

* **chunked vs pipeline** — the family's diffusers pipeline ``__call__`` (prompt to pixels,
  ``output_type="pt"``) against the runner doing the same job as a worker that hands every step
  to another worker: every model evaluation its own chunk, every chunk's state encoded to
  checkpoint bytes and the next chunk resumed from them (never from the state in memory), then
  the final latents decoded to pixels (the artifact's PNG or video encoding, which the pipeline
  has no counterpart of, is left out). Repetitions interleave, their order alternating, after one
  warm-up of each; the figure is the per-repetition ratio chunked ÷ pipeline, its median with a
  distribution-free 95 % interval (:func:`app.bench.report.median_ci`). Times are the process's
  CPU seconds on one torch thread (as a worker runs): on a machine shared with other work, wall
  time measures the neighbours as much as the code; the wall ratio is reported beside it.
* **step cache** — for each family that accepts one, the runner with and without diffusers' First
  Block Cache at its default threshold: transformer block evaluations counted by forward hooks
  on every block module (real calls, not a plan), and the CPU seconds spent in denoise chunks.
  ``first_block_diffs`` lists, per forward after the first, the relative change of the first
  block's residual the cache compares with its threshold, so a run that never skips shows how
  far it was from skipping; :func:`held_timestep` is the control run that tells why.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch  # the bench runs the models themselves
from diffusers import (
    DiTPipeline,
    FluxPipeline,
    PixArtSigmaPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    WanPipeline,
    ZImagePipeline,
)

from app.bench.report import median_ci
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, step_cache, validate_params
from workers.diffusion.cache_params import FIRST_BLOCK_THRESHOLD, REFUSED_FAMILIES
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.recipes import DiffusionRecipe, diffusion_recipes
from workers.diffusion.runner import DiffusionRunner

PIPELINES: dict[str, Any] = {
    "dit": DiTPipeline, "pixart": PixArtSigmaPipeline, "wan": WanPipeline, "wan22": WanPipeline,
    "flux": FluxPipeline, "sd3": StableDiffusion3Pipeline, "qwen_image": QwenImagePipeline,
    "zimage": ZImagePipeline,
}
"""Each family's text-to-image (or -video) pipeline class in the library."""
PROMPT = "a lighthouse at dawn"
NEGATIVE = "fog"


def quiet_libraries(threads: int = 1) -> None:
    """One torch thread, as a worker runs (``torch_threads: 1``), and no warnings from the
    tokenizers about the tiny models' 16-token limit on every call."""
    import diffusers  # deferred: only the bench's command quiets them
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()


def family_params(recipe: DiffusionRecipe, steps: int, seed: int = 7,
                  step_cache: bool = False) -> dict[str, Any]:
    """The validated job the bench runs on ``recipe``: its defaults, a prompt (a class label for
    a class-conditioned model) and, where the family has them, true CFG and the second expert's
    guidance, so every pass a real job may run is timed."""
    raw: dict[str, Any] = {"model": recipe.name, "seed": seed, "num_inference_steps": steps}
    if recipe.conditioning == "class":
        raw["class_label"] = 207
    else:
        raw.update(prompt=PROMPT, negative_prompt=NEGATIVE)
    if recipe.family in ("flux", "qwen_image"):
        raw["true_cfg_scale"] = 2.0
    if recipe.two_experts:
        raw["guidance_scale_2"] = 3.0
    if step_cache:
        raw["step_cache"] = {"kind": "first_block"}  # the library's default threshold
    return validate_params(recipe.kind, raw)


def _pipeline(c: DiffusionComponents, scheduler: Any) -> Any:
    """The family's pipeline on the recipe's own (resident) modules."""
    cls = PIPELINES[c.recipe.family]
    names = inspect.signature(cls.__init__).parameters
    parts = {name: getattr(c, name) for name in names if hasattr(c, name)}
    parts["scheduler"] = scheduler
    if "boundary_ratio" in names:
        parts["boundary_ratio"] = c.recipe.boundary_ratio
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_call(c: DiffusionComponents, p: Mapping[str, Any]) -> torch.Tensor:
    """The library's pipeline run in one go on job ``p``: its pixels."""
    gen = torch.Generator().manual_seed(int(p["seed"]))
    pipe = _pipeline(c, c.scheduler(str(p["scheduler"]), int(p["seed"])))
    call: dict[str, Any] = {"num_inference_steps": p["num_inference_steps"],
                            "guidance_scale": p["guidance_scale"], "generator": gen,
                            "output_type": "pt"}
    family = c.recipe.family
    if family == "dit":
        return pipe(class_labels=[p["class_label"]], **call).images  # type: ignore[no-any-return]
    call.update(prompt=p["prompt"], negative_prompt=p["negative_prompt"], height=p["height"],
                width=p["width"], max_sequence_length=c.recipe.text_max_length)
    if family == "pixart":
        call.update(use_resolution_binning=False, clean_caption=False)
    if family in ("flux", "qwen_image"):
        call["true_cfg_scale"] = p["true_cfg_scale"]
    if family in ("wan", "wan22"):
        call["num_frames"] = p["num_frames"]
        if c.transformer_2 is not None:
            call["guidance_scale_2"] = p["guidance_scale_2"]
        return pipe(**call).frames  # type: ignore[no-any-return]
    return pipe(**call).images  # type: ignore[no-any-return]


def chunked_call(runner: DiffusionRunner, p: Mapping[str, Any],
                 on_denoise_s: Callable[[float], None] | None = None) -> torch.Tensor:
    """The job through the runner, every chunk resumed from the previous one's checkpoint bytes;
    its pixels. ``on_denoise_s`` hears each denoise chunk's seconds."""
    state: Checkpoint | None = None
    evaluations = runner.evaluations(p)
    for index in range(evaluations + 1):
        started_s = time.process_time()
        result = runner.run_chunk(p, index, state, lambda: False)
        if index > 0 and on_denoise_s is not None:
            on_denoise_s(time.process_time() - started_s)
        state = Checkpoint.decode(result.state.encode())
    assert state is not None
    return runner.decode_pixels(p, state)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and process CPU seconds of ``fn()``."""
    wall_s, cpu_s = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall_s, time.process_time() - cpu_s


def time_family(recipe: DiffusionRecipe, steps: int, repetitions: int) -> dict[str, Any]:
    """Pipeline and chunked seconds of one recipe's job, interleaved; the ratio per repetition."""
    p = family_params(recipe, steps)
    runner = get_runner(recipe.kind)
    c = runner.components(p)
    measures = {"pipeline": lambda: pipeline_call(c, p), "chunked": lambda: chunked_call(runner, p)}
    for measure in measures.values():
        measure()  # warm-up: lazy imports, allocator, first-call caches
    wall: dict[str, list[float]] = {name: [] for name in measures}
    cpu: dict[str, list[float]] = {name: [] for name in measures}
    order = list(measures)
    for rep in range(repetitions):
        for name in order if rep % 2 == 0 else order[::-1]:
            wall_s, cpu_s = _timed(measures[name])
            wall[name].append(wall_s)
            cpu[name].append(cpu_s)
    ratios = [b / a for a, b in zip(cpu["pipeline"], cpu["chunked"], strict=True)]
    wall_ratios = [b / a for a, b in zip(wall["pipeline"], wall["chunked"], strict=True)]
    return {"model": recipe.name, "family": recipe.family, "kind": recipe.kind,
            "scheduler": p["scheduler"], "steps": steps, "evaluations": runner.evaluations(p),
            "shape": f"{p['height']}x{p['width']}x{p['num_frames']}",
            "repetitions": repetitions,
            "pipeline_s": statistics.median(cpu["pipeline"]),
            "chunked_s": statistics.median(cpu["chunked"]),
            "ratio": median_ci(ratios), "ratios": ratios,
            "wall_pipeline_s": statistics.median(wall["pipeline"]),
            "wall_chunked_s": statistics.median(wall["chunked"]),
            "wall_ratio": median_ci(wall_ratios)}


def _transformers(c: DiffusionComponents) -> list[Any]:
    return [m for m in (c.transformer, c.transformer_2) if m is not None]


@contextmanager
def counted_blocks(c: DiffusionComponents) -> Iterator[list[int]]:
    """A one-element list counting calls of every transformer block (each element of each
    ``ModuleList`` the transformers hold directly) while the context is open."""
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1

    handles = [block.register_forward_pre_hook(hook)
               for model in _transformers(c) for child in model.children()
               if isinstance(child, torch.nn.ModuleList) for block in child]
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def first_block_diffs(diffs: list[float]) -> Iterator[None]:
    """Every value the step cache compares with its threshold, appended to ``diffs``."""
    original = step_cache.should_compute

    def recorded(residual: torch.Tensor, previous: torch.Tensor, threshold: float) -> bool:
        diffs.append(((residual - previous).abs().mean() / previous.abs().mean()).item())
        return original(residual, previous, threshold)

    step_cache.should_compute = recorded
    try:
        yield
    finally:
        step_cache.should_compute = original


@contextmanager
def held_timestep(c: DiffusionComponents) -> Iterator[bool]:
    """A diagnostic, not a serving mode: the transformer's timestep embedding
    (``time_text_embed``, where it has one) fed the first timestep it saw at every step, so the
    only change between steps is the latents'. True when the model has such an embedding."""
    embed = getattr(c.transformer, "time_text_embed", None)
    if embed is None:
        yield False
        return
    first: list[torch.Tensor] = []

    def hold(_module: object, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not first:
            first.append(args[0].clone())
        return (torch.full_like(args[0], float(first[0].flatten()[0])), *args[1:])

    handle = embed.register_forward_pre_hook(hold)
    try:
        yield True
    finally:
        handle.remove()


def _cache_run(runner: DiffusionRunner, recipe: DiffusionRecipe, steps: int, cached: bool,
               hold_timestep: bool = False) -> dict[str, Any] | None:
    """One job's block evaluations, denoise seconds and (cached) the cache's comparisons."""
    p = family_params(recipe, steps, step_cache=cached)
    c = runner.components(p)
    denoise_s: list[float] = []
    diffs: list[float] = []
    with held_timestep(c) if hold_timestep else contextlib.nullcontext(True) as applies:
        if not applies:
            return None
        chunked_call(runner, p)  # warm-up
        with counted_blocks(c) as blocks, first_block_diffs(diffs):
            _, job_s = _timed(lambda: chunked_call(runner, p, denoise_s.append))
    row: dict[str, Any] = {"block_evaluations": blocks[0], "transformer_s": sum(denoise_s),
                           "job_s": job_s}
    if cached:
        row["first_block_diffs"] = [round(d, 4) for d in diffs]
        row["median_first_block_diff"] = statistics.median(diffs) if diffs else None
    return row


def cache_family(recipe: DiffusionRecipe, steps: int) -> dict[str, Any]:
    """Block evaluations and denoise seconds with and without First Block Cache; for a model
    with a ``time_text_embed``, the cached run again with its timestep embedding held
    (:func:`held_timestep`), the control that tells what makes the tiny model's steps differ."""
    runner = get_runner(recipe.kind)
    out: dict[str, Any] = {"model": recipe.name, "family": recipe.family, "steps": steps,
                           "threshold": FIRST_BLOCK_THRESHOLD,
                           "uncached": _cache_run(runner, recipe, steps, cached=False),
                           "first_block": _cache_run(runner, recipe, steps, cached=True)}
    held = _cache_run(runner, recipe, steps, cached=True, hold_timestep=True)
    if held is not None:
        out["first_block_timestep_held"] = held
    base, fbc = out["uncached"], out["first_block"]
    out["fewer_block_evaluations"] = base["block_evaluations"] / max(fbc["block_evaluations"], 1)
    out["transformer_s_saved"] = base["transformer_s"] - fbc["transformer_s"]
    if held is not None:
        out["fewer_block_evaluations_timestep_held"] = (
            base["block_evaluations"] / max(held["block_evaluations"], 1))
    return out


def run_family_bench(steps: int = 8, repetitions: int = 9, cache_steps: int = 28,
                     models: list[str] | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every image and video recipe (or those named): timings, then step-cache counts."""
    recipes = [r for kind in ("image", "video") for r in diffusion_recipes(kind)
               if models is None or r.name in models]
    unknown = sorted(set(models or ()) - {r.name for r in recipes})
    if unknown:
        raise ValueError(f"no image or video recipe named {', '.join(unknown)}; see "
                         "configs/models")
    started_s = time.perf_counter()
    timings, caches = [], []
    for recipe in recipes:
        timings.append(row := time_family(recipe, steps, repetitions))
        progress(f"{recipe.name}: chunked/pipeline {row['ratio']['median']:.3f}")
    for recipe in recipes:
        if recipe.family not in REFUSED_FAMILIES:
            caches.append(row := cache_family(recipe, cache_steps))
            progress(f"{recipe.name}: first block cache {row['fewer_block_evaluations']:.2f}x "
                     "fewer block evaluations")
    return {"device": "cpu", "torch_threads": torch.get_num_threads(), "clock": "process CPU",
            "timings": timings,
            "step_cache": caches, "refused_step_cache": sorted(REFUSED_FAMILIES),
            "wall_s": time.perf_counter() - started_s}


def family_table(report: Mapping[str, Any]) -> str:
    """The report as two plain-text tables."""
    lines = [f"{'model':16s} {'family':10s} {'shape':9s} evals  pipeline_s  chunked_s  "
             "ratio [95% CI]  (CPU seconds; wall ratio)"]
    for r in report["timings"]:
        ci = r["ratio"]
        lines.append(f"{r['model']:16s} {r['family']:10s} {r['shape']:9s} {r['evaluations']:5d} "
                     f"{r['pipeline_s']:10.4f} {r['chunked_s']:10.4f}  {ci['median']:.3f} "
                     f"[{ci['lo']:.3f}, {ci['hi']:.3f}]  wall {r['wall_ratio']['median']:.3f}")
    lines.append("")
    lines.append(f"{'model':16s} steps  blocks uncached  blocks FBC  fewer  transformer_s saved")
    for r in report["step_cache"]:
        lines.append(f"{r['model']:16s} {r['steps']:5d} {r['uncached']['block_evaluations']:15d} "
                     f"{r['first_block']['block_evaluations']:11d} "
                     f"{r['fewer_block_evaluations']:5.2f}x {r['transformer_s_saved']:+.4f} "
                     f"of {r['uncached']['transformer_s']:.4f}"
                     + (f"  (timestep held: {r['fewer_block_evaluations_timestep_held']:.2f}x)"
                        if "fewer_block_evaluations_timestep_held" in r else ""))
    return "\n".join(lines)
