"""Benchmark of step-level batching (a script, not a test), with and without batching in one run:

1. ``kernel``: per recipe (dit-tiny, pixart-tiny, wan-tiny and the MoE text recipes), the
   runner's batched step against the same jobs one by one, at batch 4 and 8: throughput ratio
   (95 % CI over repeats) and what batching does to the numbers — max abs latent difference and
   PSNR for images and video, token agreement for text.
2. ``stream``: a saturated stream of compatible jobs per model on a real stack (embedded Redis,
   Celery worker, tick), batching on vs off: jobs/s, and a realtime probe stream's SLO
   attainment beside it (realtime jobs are exact, so never batched).
3. ``load``: the ``batching`` workload (simulated device) at loads from 0.6 to 1.5, batching on
   vs off: SLO attainment per class (95 % Wilson intervals) and the highest load at which every
   class stays within its SLO (``capacity``).

    python tests/bench/bench_batching.py --out bench-out/batching.json [--parts kernel,stream,load]

Figures are ratios measured in the same run on the same machine; the kernel and stream parts
run the real ``diffusers`` / ``transformers`` modules with small random weights on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.bench.driver import Outcome, replay  # noqa: E402
from app.bench.report import mean_ci, wilson_interval  # noqa: E402
from app.bench.workload import generate_trace, load_workload  # noqa: E402

# -- 1. kernel --------------------------------------------------------------------------------

DIFFUSION = {
    "dit-tiny": ("image", [{"class_label": 1}, {"class_label": 7, "guidance_scale": 1.0},
                           {"class_label": 3, "scheduler": "dpmpp_2m"}]),
    "pixart-tiny": ("image", [{"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0},
                              {"prompt": "a red car", "scheduler": "euler"}]),
    "wan-tiny": ("video", [{"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0}]),
}
TEXT = ("qwen3-moe-tiny", "olmoe-tiny", "mixtral-tiny")
PROMPTS = ["Explain quantum computing in simple terms", "Tell me a story about a dragon",
           "What is the capital of France? Paris is", "How do I bake bread?",
           "Write a short poem about the ocean at night", "Summarise this in one sentence.",
           "Numbers and code: 0 1 2 3 4 5", "hi there"]


def _roundtrip(state: Any) -> Any:
    from workers.checkpoint import Checkpoint

    return Checkpoint.decode(state.encode())


def _diffusion_jobs(model: str, kind: str, raws: list[dict[str, Any]], steps: int,
                    n: int) -> list[dict[str, Any]]:
    from workers.diffusion import validate_params

    return [validate_params(kind, dict(raws[i % len(raws)], model=model, seed=100 + i,
                                       num_inference_steps=steps)) for i in range(n)]


def diffusion_kernel(model: str, batch: int, steps: int, repeats: int) -> dict[str, Any]:
    from workers.diffusion.runner import DiffusionRunner
    from workers.runner import BatchItem

    kind, raws = DIFFUSION[model]
    runner = DiffusionRunner(kind, max_batch=batch)
    params = _diffusion_jobs(model, kind, raws, steps, batch)
    encoded = [_roundtrip(runner.run_chunk(p, 0, None, lambda: False).state) for p in params]
    evals = [runner.evaluations(p) for p in params]
    last = min(evals)

    def alone() -> list[Any]:
        states = list(encoded)
        for i in range(1, last + 1):
            states = [runner.run_chunk(p, i, s, lambda: False).state
                      for p, s in zip(params, states, strict=True)]
        return states

    def batched() -> list[Any]:
        states = list(encoded)
        for i in range(1, last + 1):
            items = [BatchItem(p, i, s) for p, s in zip(params, states, strict=True)]
            states = [r.state for r in runner.run_batch(items)]
        return states

    ratios, solo_s, batch_s = _timed_pairs(alone, batched, repeats)
    a, b = alone(), batched()
    diffs, psnrs = [], []
    for x, y in zip(a, b, strict=True):
        la, lb = x.tensors["latents"], y.tensors["latents"]
        diffs.append(float((la - lb).abs().max()))
        mse = float(((la - lb) ** 2).mean())
        peak = float(la.max() - la.min())
        psnrs.append(math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse))
    return {"model": model, "batch": batch, "steps": last, "one_by_one_s": solo_s,
            "batched_s": batch_s, "throughput_ratio": mean_ci(ratios),
            "max_abs_latent_diff": max(diffs), "min_latent_psnr_db": min(psnrs),
            "bit_identical_jobs": sum(d == 0 for d in diffs)}


def text_kernel(model: str, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    from workers.moe.runner import TextRunner
    from workers.runner import BatchItem

    runner = TextRunner()
    params = [{"prompt": q, "max_new_tokens": tokens + 1, "chunk_tokens": tokens,
               "model": model, "routing": "native"} for q in PROMPTS[:batch]]
    prefilled = [runner.run_chunk(p, 0, None, lambda: False).state for p in params]
    items = [BatchItem(p, 1, s) for p, s in zip(params, prefilled, strict=True)]

    def alone() -> list[Any]:
        return [runner.run_chunk(p, 1, s, lambda: False) for p, s in zip(params, prefilled,
                                                                         strict=True)]

    def batched() -> list[Any]:
        return runner.run_batch(items)

    ratios, solo_s, batch_s = _timed_pairs(alone, batched, repeats)
    same = total = whole = 0
    for x, y in zip(alone(), batched(), strict=True):
        ia, ib = x.state.tensors["ids"].tolist(), y.state.tensors["ids"].tolist()
        start = int(x.state.meta["prompt_tokens"])
        same += sum(p == q for p, q in zip(ia[start:], ib[start:], strict=False))
        total += len(ia) - start
        whole += ia == ib
    return {"model": model, "batch": batch, "tokens": tokens, "one_by_one_s": solo_s,
            "batched_s": batch_s, "throughput_ratio": mean_ci(ratios),
            "token_agreement": same / max(total, 1), "sequences_equal": whole}


def _timed_pairs(alone: Callable[[], Any], batched: Callable[[], Any],
                 repeats: int) -> tuple[list[float], float, float]:
    alone(), batched()  # warm-up: first calls build models and caches
    ratios, solo, together = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        alone()
        a = time.perf_counter() - started
        started = time.perf_counter()
        batched()
        b = time.perf_counter() - started
        ratios.append(a / b)
        solo.append(a)
        together.append(b)
    return ratios, statistics.median(solo), statistics.median(together)


def run_kernel(repeats: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)  # as a worker process runs (``torch_threads``)
    rows = []
    for model in DIFFUSION:
        for batch in (4, 8):
            rows.append(diffusion_kernel(model, batch, steps=8, repeats=repeats))
            _print_kernel(rows[-1])
    for model in TEXT:
        for batch in (4, 8):
            rows.append(text_kernel(model, batch, tokens=16, repeats=repeats))
            _print_kernel(rows[-1])
    return rows


def _print_kernel(row: dict[str, Any]) -> None:
    r = row["throughput_ratio"]
    numerics = (f"agreement {row['token_agreement']:.3f}" if "token_agreement" in row else
                f"max|dlatent| {row['max_abs_latent_diff']:.2g}, "
                f"PSNR >= {row['min_latent_psnr_db']:.0f} dB")
    print(f"kernel {row['model']:15s} b={row['batch']}: {r['mean']:.2f}x "
          f"[{r['lo']:.2f}, {r['hi']:.2f}]  {numerics}", flush=True)


# -- live stacks ---------------------------------------------------------------------------

class LiveStack:
    """A Stepline stack (embedded Redis, tick, workers) with batching on or off."""

    def __init__(self, batching: bool, workers: int) -> None:
        self.batching, self.workers = batching, workers

    def __enter__(self) -> LiveStack:
        from app.celery import configure as configure_celery
        from app.stack import Stack
        from tasks.runtime import connect, current_settings, redis_url
        from tasks.store import JobStore
        from tasks.submit import JobService

        run_dir = Path(tempfile.mkdtemp(prefix="stepline-batching-"))
        os.environ["STEPLINE_RUN_DIR"] = str(run_dir)
        os.environ["STEPLINE_SCHEDULER__BATCHING__ENABLED"] = "true" if self.batching else "false"
        current_settings.cache_clear()
        settings = current_settings()
        configure_celery(settings)
        self.stack = Stack(settings, run_dir, workers=self.workers, with_api=False,
                           with_flower=False)
        self.stack.start()
        self.service = JobService(JobStore(connect(redis_url(settings))), settings)
        _wait_workers(self.service.store, self.workers)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()


def _wait_workers(store: Any, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(store.heartbeats()) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the first ticks


def _wait_done(store: Any, job_ids: list[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = {j: store.record(j) for j in job_ids}
        if all(r.state.is_terminal for r in records.values()):
            return records
        time.sleep(0.1)
    raise TimeoutError(f"jobs still running after {timeout_s} s")


# -- 2. saturated stream --------------------------------------------------------------------

STREAM_JOBS = {
    "dit-tiny": ("image", {"model": "dit-tiny", "num_inference_steps": 12, "class_label": 3}),
    "pixart-tiny": ("image", {"model": "pixart-tiny", "num_inference_steps": 12,
                              "prompt": "a lighthouse at dusk"}),
    "qwen3-moe-tiny": ("text", {"model": "qwen3-moe-tiny", "prompt": "Tell me about tides",
                                "max_new_tokens": 48, "routing": "native"}),
}
PROBE = ("image", {"model": "dit-tiny", "num_inference_steps": 8, "class_label": 5})


def stream_run(live: LiveStack, model: str, jobs: int) -> dict[str, Any]:
    from app.schemas import JobSpec
    from scheduler.lifecycle import SloClass

    kind, params = STREAM_JOBS[model]
    service = live.service
    warm = [service.submit(JobSpec(kind=kind, slo=SloClass.INTERACTIVE, deadline_s=600,
                                   params={**params, "seed": 1}))[0],  # type: ignore[arg-type]
            service.submit(JobSpec(kind=PROBE[0], slo=SloClass.REALTIME, deadline_s=600,
                                   params={**PROBE[1], "seed": 1}))[0]]  # type: ignore[arg-type]
    _wait_done(service.store, warm, 300)
    started = time.time()
    ids = [service.submit(JobSpec(kind=kind, slo=SloClass.INTERACTIVE, deadline_s=600,
                                  params={**params, "seed": 10 + k}))[0]  # type: ignore[arg-type]
           for k in range(jobs)]
    probes: list[str] = []
    while not all(service.store.record(j).state.is_terminal for j in ids):
        probes.append(service.submit(JobSpec(kind=PROBE[0], slo=SloClass.REALTIME,  # type: ignore[arg-type]
                                             params={**PROBE[1], "seed": len(probes)}))[0])
        time.sleep(0.5)
    records = _wait_done(service.store, ids + probes, 300)
    ended = max(r.finished_at_s or 0.0 for j, r in records.items() if j in ids)
    met = sum(1 for j in probes if records[j].latency_s is not None
              and records[j].finished_at_s is not None
              and records[j].finished_at_s <= records[j].deadline_at_s)
    ci = wilson_interval(met, len(probes))
    return {"model": model, "batching": live.batching, "jobs": jobs,
            "jobs_per_s": jobs / (ended - started), "makespan_s": ended - started,
            "realtime_probes": len(probes), "realtime_attainment": met / max(len(probes), 1),
            "realtime_attainment_ci95": ci}


def run_stream(jobs: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, dict[bool, list[dict[str, Any]]]] = {m: {False: [], True: []}
                                                          for m in STREAM_JOBS}
    for batching in (False, True):
        with LiveStack(batching, workers=1) as live:
            for model in STREAM_JOBS:
                for _ in range(repeats):
                    row = stream_run(live, model, jobs)
                    runs[model][batching].append(row)
                    print(f"stream {model:15s} batching={'on ' if batching else 'off'}: "
                          f"{row['jobs_per_s']:.2f} jobs/s, realtime "
                          f"{row['realtime_attainment']:.0%} of {row['realtime_probes']}",
                          flush=True)
    summary = {}
    for model, by_mode in runs.items():
        ratios = [on["jobs_per_s"] / off["jobs_per_s"]
                  for off, on in zip(by_mode[False], by_mode[True], strict=True)]
        summary[model] = {"throughput_ratio": mean_ci(ratios), "runs": by_mode[False]
                          + by_mode[True]}
        r = summary[model]["throughput_ratio"]
        print(f"stream {model:15s} batching on / off: {r['mean']:.2f}x "
              f"[{r['lo']:.2f}, {r['hi']:.2f}]", flush=True)
    return summary


# -- 3. the mixed workload at rising load ---------------------------------------------------

def load_run(live: LiveStack, load: float, duration_s: float) -> dict[str, Any]:
    workload = load_workload("batching")
    trace = generate_trace(workload, workers=live.workers, load=load, duration_s=duration_s)
    outcomes = replay(live.service, trace, drain_timeout_s=240)
    return {"load": load, "batching": live.batching, **_by_class(live, outcomes)}


def _by_class(live: LiveStack, outcomes: list[Outcome]) -> dict[str, Any]:
    store = live.service.store
    classes: dict[str, list[bool]] = {}
    for o in outcomes:
        met = False
        if o.job_id is not None and o.final_state == "DONE":
            record = store.record(o.job_id)
            met = record.finished_at_s is not None \
                and record.finished_at_s <= record.deadline_at_s
        classes.setdefault(o.arrival.slo.value, []).append(met)
    out: dict[str, Any] = {}
    for name, mets in sorted(classes.items()):
        ci = wilson_interval(sum(mets), len(mets))
        out[name] = {"jobs": len(mets), "attainment": sum(mets) / len(mets),
                     "ci95": ci}
    return {"classes": out}


def run_load(loads: Sequence[float], duration_s: float, within: float,
             workers: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for batching in (False, True):
        with LiveStack(batching, workers=workers) as live:
            for load in loads:
                row = load_run(live, load, duration_s)
                rows.append(row)
                cells = ", ".join(f"{c} {v['attainment']:.0%}"
                                  for c, v in row["classes"].items())
                print(f"load {load:.1f} batching={'on ' if batching else 'off'}: {cells}",
                      flush=True)
    capacity = {}
    for batching in (False, True):
        ok = [r["load"] for r in rows if r["batching"] is batching
              and all(v["attainment"] >= within for v in r["classes"].values())]
        capacity["on" if batching else "off"] = max(ok, default=None)
    print(f"capacity within SLO (every class >= {within:.0%}): batching off "
          f"{capacity['off']}, on {capacity['on']}", flush=True)
    return {"rows": rows, "capacity": capacity, "within": within, "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/batching.json"))
    parser.add_argument("--parts", default="kernel,stream,load")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-jobs", type=int, default=24)
    parser.add_argument("--stream-repeats", type=int, default=2)
    parser.add_argument("--loads", default="0.6,0.9,1.2,1.5")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=2, help="workers of the load sweep")
    parser.add_argument("--within", type=float, default=0.9,
                        help="attainment every class needs for a load to count as within SLO")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"load_average_at_start": os.getloadavg()}
    if "kernel" in parts:
        report["kernel"] = run_kernel(args.repeats)
    if "stream" in parts:
        report["stream"] = run_stream(args.stream_jobs, args.stream_repeats)
    if "load" in parts:
        loads = [float(x) for x in args.loads.split(",")]
        report["load"] = run_load(loads, args.duration, args.within, args.workers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
