"""Benchmark: one Flux denoising step driven by Stepline's step runner, and by diffusers'
Modular Pipelines blocks (a script, not a test).

Same model (flux-tiny), same inputs (the job's encode chunk: prompt embeddings, packed noise,
its scheduler with timesteps set), step 0 repeated on fresh copies of the state:

- ``stepline_chunk``: ``DiffusionRunner.run_chunk`` of denoise chunk 1 from the encode
  checkpoint: restore, the blockwise forward in block groups, guidance, scheduler step, and the
  new checkpoint (what a worker runs per step);
- ``stepline_step``: the same arithmetic in memory (family ``passes``, blockwise forward,
  ``combine``, ``step``), no checkpoint;
- ``modular_step``: ``FluxDenoiseStep.loop_step`` (``FluxLoopDenoiser`` then
  ``FluxLoopAfterDenoiser``) on a ``FluxModularPipeline`` holding the same transformer and a copy
  of the same scheduler, its ``BlockState`` filled with the same tensors.

Prints medians with 95 % order-statistic intervals, the ratios to ``modular_step``, whether the
modular step's latents equal Stepline's bit for bit, and writes the JSON:

    python tests/bench/bench_modular_flux.py --repeats 30 --out bench-out/modular-flux.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers.modular_pipelines import BlockState
from diffusers.modular_pipelines.flux.denoise import FluxDenoiseStep

from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.blockwise import full_forward
from workers.diffusion.pipelines import ADAPTERS, FAMILIES
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.scheduler_state import copy_scheduler

JOB = {"model": "flux-tiny", "prompt": "a lighthouse at dawn", "seed": 7,
       "num_inference_steps": 4, "scheduler": "flow_match_euler"}


def median_ci(samples: list[float]) -> tuple[float, float, float]:
    """The median and a distribution-free 95 % interval on it (ranks n/2 ± 1.96·√n/2)."""
    ordered = sorted(samples)
    n = len(ordered)
    half = 1.96 * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[low], ordered[high]


def timed(run: Callable[[], torch.Tensor], repeats: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of each of ``repeats`` calls (after one warm-up) and the last call's latents."""
    out = run()
    samples = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        out = run()
        samples.append(time.perf_counter() - started_s)
    return samples, out


def stepline_ways(runner: DiffusionRunner, params: dict[str, Any], encoded: bytes
                  ) -> dict[str, Callable[[], torch.Tensor]]:
    """Denoise chunk 1 through the runner, and the same step's arithmetic in memory."""
    c, family, adapter = runner.components(params), FAMILIES["flux"], ADAPTERS["flux"]

    def chunk() -> torch.Tensor:
        state = Checkpoint.decode(encoded)
        return runner.run_chunk(params, 1, state, lambda: False).state.tensors["latents"]

    def step() -> torch.Tensor:
        job = runner._restore(params, 1, Checkpoint.decode(encoded))
        t = job.scheduler.timesteps[0]
        inputs, sample = family.passes(c, params, job.scheduler, job.latents, t, job.cond)
        outputs = [full_forward(adapter, c.transformer, x) for x in inputs]
        return family.step(job.scheduler, family.combine(c, params, outputs), t, sample,
                           job.generator)

    return {"stepline_chunk": chunk, "stepline_step": step}


def modular_way(runner: DiffusionRunner, params: dict[str, Any], encoded: bytes
                ) -> Callable[[], torch.Tensor]:
    """``FluxDenoiseStep.loop_step`` for step 0 on the job's own tensors and scheduler."""
    c, family = runner.components(params), FAMILIES["flux"]
    blocks = FluxDenoiseStep()
    pipe = blocks.init_pipeline()
    job = runner._restore(params, 1, Checkpoint.decode(encoded))
    inputs, _ = family.passes(c, params, job.scheduler, job.latents,
                              job.scheduler.timesteps[0], job.cond)
    x = inputs[0]

    def step() -> torch.Tensor:
        pipe.update_components(transformer=c.transformer, scheduler=copy_scheduler(job.scheduler))
        state = BlockState(latents=job.latents, guidance=x["guidance"],
                           prompt_embeds=x["encoder_hidden_states"],
                           pooled_prompt_embeds=x["pooled_projections"], txt_ids=x["txt_ids"][0],
                           img_ids=x["img_ids"][0], joint_attention_kwargs=None)
        _, state = blocks.loop_step(pipe, state, i=0, t=job.scheduler.timesteps[0])
        latents: torch.Tensor = state.latents
        return latents

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("bench-out/modular-flux.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = validate_params("image", JOB)
    runner = get_runner("image", block_groups=2)
    with torch.no_grad():
        encoded = runner.run_chunk(params, 0, None, lambda: False).state.encode()
        ways = {**stepline_ways(runner, params, encoded),
                "modular_step": modular_way(runner, params, encoded)}
        results = {name: timed(run, args.repeats) for name, run in ways.items()}
    report = summary(results, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def summary(results: dict[str, tuple[list[float], torch.Tensor]], args: argparse.Namespace
            ) -> dict[str, Any]:
    medians = {name: median_ci(samples) for name, (samples, _) in results.items()}
    base = medians["modular_step"][0]
    latents = {name: out for name, (_, out) in results.items()}
    return {
        "job": JOB, "repeats": args.repeats, "torch_threads": args.threads,
        "median_ms": {n: {"p50": m * 1e3, "ci95": [lo * 1e3, hi * 1e3]}
                      for n, (m, lo, hi) in medians.items()},
        "ratio_to_modular": {n: m[0] / base for n, m in medians.items()},
        "modular_equals_stepline_bitwise": bool(torch.equal(latents["modular_step"],
                                                            latents["stepline_step"])),
    }


if __name__ == "__main__":
    main()
