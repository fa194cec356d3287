"""Benchmark: what a First Block Cache saves per threshold on the tiny recipes (a script, not a
test).

Each job runs its encode and denoise chunks on one runner (no stops), uncached and at each
threshold, run by run with the order rotated so drift falls on every setting alike. Per setting:
transformer block evaluations (counted by forward hooks on the block modules), transformer time
(the runner's passes: prologue, blocks, the cache's decision, epilogue) and step time (whole
denoise chunks), each as a per-run ratio cached ÷ uncached, median with a distribution-free
95 % interval; and how far the final latents moved from the uncached run's (relative L2).

Usage: python -m tests.bench.bench_step_cache [--runs 7] [--steps 20]
       [--thresholds 0.05 0.1 0.2] [--threads 1] [--out bench-out/step_cache.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from app.bench.report import median_ci
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.runner import DiffusionRunner

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 207, "guidance_scale": 4.0}),
    "pixart-tiny": ("image", {"prompt": "a red fox in snow", "negative_prompt": "blurry"}),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "negative_prompt": "static"}),
    "flux-tiny": ("image", {"prompt": "a lighthouse at dawn", "height": 32, "width": 48}),
}


class BlockCounter:
    """Counts forwards of every transformer block of a runner's models."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.calls = 0
        self._handles = [m.register_forward_hook(self._count) for m in modules]

    def _count(self, *_: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _block_modules(runner: DiffusionRunner, params: Mapping[str, Any]) -> list[torch.nn.Module]:
    """Every transformer block of the job's transformers (Wan: ``blocks``, DiT and PixArt:
    ``transformer_blocks``)."""
    c = runner.components(params)
    models = [m for m in (c.transformer, c.transformer_2) if m is not None]
    return [block for m in models
            for block in (m.blocks if hasattr(m, "blocks") else m.transformer_blocks)]


def _run_job(kind: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """One job to its final latents: block evaluations, transformer and denoise seconds."""
    runner = get_runner(kind)
    counter = BlockCounter(_block_modules(runner, params))
    passes = runner._run_passes
    spent = {"transformer_s": 0.0, "denoise_s": 0.0}

    def timed_passes(*args: Any) -> bool:
        start_s = time.perf_counter()
        try:
            return passes(*args)
        finally:
            spent["transformer_s"] += time.perf_counter() - start_s

    runner._run_passes = timed_passes  # type: ignore[method-assign,assignment]
    state: Checkpoint | None = None
    try:
        for index in range(runner.evaluations(params) + 1):
            start_s = time.perf_counter()
            state = runner.run_chunk(params, index, state, lambda: False).state
            spent["denoise_s"] += (time.perf_counter() - start_s) if index else 0.0
    finally:
        del runner._run_passes
        counter.close()
    assert state is not None
    return {**spent, "block_evaluations": counter.calls, "latents": state.tensors["latents"],
            "hits": state.meta.get("step_cache", {}).get("hits", 0)}


def _settings(model: str, steps: int, thresholds: list[float]) -> dict[str, dict[str, Any]]:
    kind, extra = JOBS[model]
    base = {"model": model, "num_inference_steps": steps, "seed": 3, **extra}
    out = {"uncached": validate_params(kind, base)}
    for t in thresholds:
        out[f"{t:g}"] = validate_params(kind, {**base, "step_cache": {"kind": "first_block",
                                                                      "threshold": t}})
    return out


def bench_model(model: str, runs: int, steps: int, thresholds: list[float]) -> dict[str, Any]:
    kind = JOBS[model][0]
    settings = _settings(model, steps, thresholds)
    names = list(settings)
    for name in names:
        _run_job(kind, settings[name])  # warm-up: models built, caches filled
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for run in range(runs):
        shift = run % len(names)
        for name in names[shift:] + names[:shift]:
            rows[name].append(_run_job(kind, settings[name]))
    base = rows["uncached"]
    evaluations = get_runner(kind).evaluations(settings["uncached"])
    out: dict[str, Any] = {"model": model, "scheduler": settings["uncached"]["scheduler"],
                           "steps": steps, "model_evaluations": evaluations, "runs": runs,
                           "settings": {}}
    for name in names:
        out["settings"][name] = _summary(rows[name], base)
    return out


def _ratios(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> dict[str, float]:
    return median_ci([r[key] / b[key] for r, b in zip(rows, base, strict=True)])


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    latents, reference = rows[0]["latents"], base[0]["latents"]
    return {
        "block_evaluations": rows[0]["block_evaluations"],
        "cache_hits": rows[0]["hits"],
        "block_ratio": rows[0]["block_evaluations"] / base[0]["block_evaluations"],
        "transformer_s": statistics.median(r["transformer_s"] for r in rows),
        "transformer_ratio": _ratios(rows, base, "transformer_s"),
        "denoise_ratio": _ratios(rows, base, "denoise_s"),
        "latents_rel_l2": float((latents - reference).norm() / reference.norm()),
    }


def _lines(r: Mapping[str, Any]) -> list[str]:
    def ci(f: Mapping[str, float]) -> str:
        return f"{f['median']:.3f} [{f['lo']:.3f}, {f['hi']:.3f}]"

    return [f"{r['model']:12s} {name:9s} blocks {s['block_evaluations']:4d} "
            f"({s['block_ratio']:.3f})  transformer {1000 * s['transformer_s']:7.1f} ms "
            f"ratio {ci(s['transformer_ratio'])}  step ratio {ci(s['denoise_ratio'])}  "
            f"latents rel L2 {s['latents_rel_l2']:.4f}"
            for name, s in r["settings"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.05, 0.1, 0.2])
    parser.add_argument("--models", nargs="*", default=sorted(JOBS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (workers run with torch_threads: 1)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/step_cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for model in args.models:
        results.append(r := bench_model(model, args.runs, args.steps, args.thresholds))
        print("\n".join(_lines(r)), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": "cpu", "torch_threads": torch.get_num_threads(), "runs": args.runs,
              "steps": args.steps, "thresholds": args.thresholds, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
