"""Benchmark: per-step overhead of chunked diffusion against the same diffusers pipeline run
directly, plus checkpoint size and save/load time, for each recipe's default sampler or the ones
named.

Two chunked runs are measured against the pipeline, in the same process, interleaved run by run
(their order rotates, so drift of the machine falls on all three alike):

* ``hot`` — what a worker does when the job's next step lands on it again (the affinity hop):
  the state stays in memory and the durable copy is encoded after every step
  (``checkpoint_every: 1``), never decoded;
* ``cold`` — every step's state also decoded from those bytes: a hop to another worker.

Ratios are per run (chunked ÷ direct), median with a distribution-free 95 % interval.

Usage: python -m tests.bench.bench_diffusion [--runs 15] [--steps 20 50] [--samplers heun]
       [--threads 1] [--out bench-out/diffusion.json]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import DiTPipeline, PixArtSigmaPipeline, WanPipeline

from app.bench.report import median_ci
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.recipes import diffusion_recipe

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 1}),
    "pixart-tiny": ("image", {"prompt": "a red fox in snow"}),
    "wan-tiny": ("video", {"prompt": "waves at dusk"}),
}


def _quiet(pipe: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_s(c: DiffusionComponents, p: dict[str, Any]) -> float:
    """Seconds of the library's pipeline, prompt to latents (decode excluded on both sides)."""
    gen = torch.Generator().manual_seed(p["seed"])
    common = {"num_inference_steps": p["num_inference_steps"], "generator": gen,
              "guidance_scale": p["guidance_scale"]}
    sched = c.scheduler(p["scheduler"], p["seed"])
    if c.recipe.family != "pixart" and "generator" in inspect.signature(sched.step).parameters:
        sched.step = functools.partial(type(sched).step, sched, generator=gen)  # as the runner
    start_s = time.perf_counter()
    if c.recipe.family == "dit":  # DiTPipeline has no latent output: it always decodes
        _quiet(DiTPipeline(transformer=c.transformer, vae=c.vae, scheduler=sched))(
            class_labels=[p["class_label"]], output_type="pt", **common)
    elif c.recipe.family == "pixart":
        _quiet(PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                   transformer=c.transformer, scheduler=sched))(
            prompt=p["prompt"], height=p["height"], width=p["width"], output_type="latent",
            use_resolution_binning=False, clean_caption=False,
            max_sequence_length=c.recipe.text_max_length, **common)
    else:
        _quiet(WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                           transformer=c.transformer, scheduler=sched))(
            prompt=p["prompt"], height=p["height"], width=p["width"], num_frames=p["num_frames"],
            output_type="latent", max_sequence_length=c.recipe.text_max_length, **common)
    return time.perf_counter() - start_s


def _chunked(kind: str, p: dict[str, Any], cold: bool) -> dict[str, Any]:
    """Seconds of encode + every denoise chunk, each state encoded to bytes (and, ``cold``,
    resumed from them), and codec figures."""
    runner = get_runner(kind)
    state, save_s, load_s, sizes = None, [], [], []
    start_s = time.perf_counter()
    for index in range(runner.plan(p).num_chunks - 1):  # decode excluded, as for the pipeline
        result = runner.run_chunk(p, index, state, lambda: False)
        t0 = time.perf_counter()
        blob = result.state.encode()
        t1 = time.perf_counter()
        state = Checkpoint.decode(blob) if cold else result.state
        save_s.append(t1 - t0)
        load_s.append(time.perf_counter() - t1)
        sizes.append(len(blob))
    total_s = time.perf_counter() - start_s
    if kind == "image" and p["model"] == "dit-tiny":
        assert state is not None
        total_s += _timed(lambda: runner.decode_pixels(p, state))
    return {"total_s": total_s, "save_s": statistics.median(save_s),
            "load_s": statistics.median(load_s), "bytes": max(sizes)}


def _timed(fn: Any) -> float:
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def bench_model(model: str, runs: int, steps: int, sampler: str | None) -> dict[str, Any]:
    kind, extra = JOBS[model]
    p = validate_params(kind, {"model": model, "num_inference_steps": steps, "scheduler": sampler,
                               **extra})
    c = get_runner(kind).components(p)
    measures: dict[str, Callable[[], dict[str, Any]]] = {
        "direct": lambda: {"total_s": _pipeline_s(c, p)},
        "hot": lambda: _chunked(kind, p, cold=False),
        "cold": lambda: _chunked(kind, p, cold=True),
    }
    for measure in measures.values():
        measure()  # warm-up
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in measures}
    names = list(measures)
    for run in range(runs):
        for name in names[run % 3:] + names[: run % 3]:  # rotate the order run by run
            rows[name].append(measures[name]())
    direct = [r["total_s"] for r in rows["direct"]]
    out: dict[str, Any] = {
        "model": model, "scheduler": p["scheduler"], "steps": steps, "runs": runs,
        "model_evaluations": get_runner(kind).plan(p).num_chunks - 2,
        "shape": f"{p['height']}x{p['width']}x{p['num_frames']}",
        "direct_job_s": statistics.median(direct),
        "direct_step_ms": 1000 * statistics.median(direct) / steps,
        "checkpoint_bytes": max(r["bytes"] for r in rows["cold"]),
        "checkpoint_save_ms": 1000 * statistics.median(r["save_s"] for r in rows["cold"]),
        "checkpoint_load_ms": 1000 * statistics.median(r["load_s"] for r in rows["cold"]),
    }
    for name in ("hot", "cold"):
        chunked = [r["total_s"] for r in rows[name]]
        out[name] = {
            "chunked_job_s": statistics.median(chunked),
            "overhead_ratio": median_ci([b / a for a, b in zip(direct, chunked, strict=True)]),
            "overhead_per_step_ms": median_ci(
                [1000 * (b - a) / steps for a, b in zip(direct, chunked, strict=True)]),
        }
    return out


def _ratio(figure: dict[str, float]) -> str:
    return f"{figure['median']:.3f} [{figure['lo']:.3f}, {figure['hi']:.3f}]"


def _line(r: dict[str, Any]) -> str:
    hot, cold = r["hot"], r["cold"]
    return (f"{r['model']:12s} {r['scheduler']:10s} {r['shape']:8s} {r['steps']:3d} steps  "
            f"direct {r['direct_step_ms']:5.1f} ms/step  chunked/direct "
            f"hot {_ratio(hot['overhead_ratio'])} "
            f"({hot['overhead_per_step_ms']['median']:+.2f} ms/step)  "
            f"cold {_ratio(cold['overhead_ratio'])}  "
            f"ckpt {r['checkpoint_bytes'] / 1024:.1f} KiB save {r['checkpoint_save_ms']:.2f} ms "
            f"load {r['checkpoint_load_ms']:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, nargs="*", default=[20, 50])
    parser.add_argument("--models", nargs="*", default=sorted(JOBS))
    parser.add_argument("--samplers", nargs="*", default=[None],
                        help="sampler names; each model runs those it offers (default: its own)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (workers run with torch_threads: 1)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/diffusion.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for m in args.models:
        for s in args.samplers:
            for steps in args.steps:
                if s is None or s in diffusion_recipe(m).schedulers:
                    rows.append(r := bench_model(m, args.runs, steps, s))
                    print(_line(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": "cpu", "torch_threads": torch.get_num_threads(), "runs": args.runs,
              "results": rows}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
