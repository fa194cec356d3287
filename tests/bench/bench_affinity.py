"""Benchmark of expert/checkpoint affinity on real workers (a script, not a test).

Starts a private stack (embedded Redis, N workers, beat and scheduler), submits a burst of
text jobs over three MoE models and image jobs at once, waits for all, and reports the
worker-local checkpoint-cache hit rate, the expert-cache hit rate of the text jobs, how often a
job's next chunk ran on another worker, and the makespan. Run it once per setting:

    python tests/bench/bench_affinity.py --kinds none --out bench-out/affinity-off.json
    python tests/bench/bench_affinity.py --kinds text --out bench-out/affinity-text.json
    python tests/bench/bench_affinity.py --kinds text,image --out bench-out/affinity-all.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks import keys

MODELS = ("qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny")
PROMPTS = ("Explain quantum computing in simple terms", "Write a short poem about the ocean",
           "Tell me a story about a dragon and a brave knight", "How do I bake bread at home?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kinds", default="text", help="none, or job kinds with affinity")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--text-jobs", type=int, default=12)
    parser.add_argument("--image-jobs", type=int, default=4)
    parser.add_argument("--budget-mb", default="0.5", help="expert cache budget per model")
    parser.add_argument("--out", type=Path, default=Path("bench-out/affinity.json"))
    args = parser.parse_args()
    kinds = [] if args.kinds == "none" else args.kinds.split(",")
    run_dir = Path(tempfile.mkdtemp(prefix="stepline-affinity-"))
    os.environ.update({
        "STEPLINE_RUN_DIR": str(run_dir), "STEPLINE_AFFINITY__ENABLED": str(bool(kinds)).lower(),
        "STEPLINE_AFFINITY__KINDS": json.dumps(kinds or ["text"]),
        "STEPLINE_MOE__CACHE__BUDGET_MB": args.budget_mb,
    })
    os.environ.pop("REDIS_URL", None)
    report = run(args, run_dir)
    report["setting"] = {"affinity_kinds": kinds, "workers": args.workers,
                         "expert_budget_mb": float(args.budget_mb)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    from app.schemas import JobSpec
    from app.stack import Stack
    from scheduler.lifecycle import SloClass
    from tasks.runtime import connect, current_settings, redis_url
    from tasks.store import JobStore
    from tasks.submit import JobService

    settings = current_settings()
    with Stack(settings=settings, run_dir=run_dir, workers=args.workers, with_api=False,
               with_flower=False) as stack:
        store = JobStore(connect(redis_url(settings)))
        _wait_for_workers(store, args.workers)
        service = JobService(store, settings)
        specs = [JobSpec(kind="text", slo=SloClass.BATCH, deadline_s=600, params={
            "prompt": PROMPTS[i % len(PROMPTS)], "model": MODELS[i % len(MODELS)],
            "max_new_tokens": 48, "chunk_tokens": 4, "seed": i})
            for i in range(args.text_jobs)]
        specs += [JobSpec(kind="image", slo=SloClass.BATCH, deadline_s=600, params={
            "model": "dit-tiny", "class_label": i, "num_inference_steps": 12, "seed": i})
            for i in range(args.image_jobs)]
        started = time.monotonic()
        ids = [service.submit(spec)[0] for spec in specs]
        while not all(store.state(j).is_terminal for j in ids):
            time.sleep(0.05)
            if stack.dead():
                raise SystemExit(f"stack process died: {stack.dead()}; see {run_dir}/logs")
        makespan_s = time.monotonic() - started
        time.sleep(settings.broker.chunk_lease / 3 + 0.5)  # one more heartbeat with counters
        return _report(store, settings, ids, makespan_s)


def _wait_for_workers(store: Any, count: int) -> None:

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = [k for k in store.redis.scan_iter(keys.WORKER_PREFIX + "w*")]
        if len(names) >= count:
            return
        time.sleep(0.2)
    raise SystemExit("the workers did not start")


def _report(store: Any, settings: Any, ids: list[str], makespan_s: float) -> dict[str, Any]:

    ckpt = {"hits": 0, "misses": 0}
    for key in store.redis.scan_iter(keys.WORKER_PREFIX + "w*"):
        raw = store.redis.get(key)
        body = json.loads(raw) if raw else {}
        for name in ckpt:
            ckpt[name] += body.get("ckpt_cache", {}).get(name, 0)
    experts = {"hits": 0, "misses": 0}
    moves = {"text": [0, 0], "image": [0, 0]}  # [hops to another worker, hops]
    for job_id in ids:
        fields = store.fields(job_id)
        workers = [e["by"] for e in store.events(job_id) if e["kind"] == "commit"]
        moves[fields["kind"]][0] += sum(a != b for a, b in itertools.pairwise(workers))
        moves[fields["kind"]][1] += max(len(workers) - 1, 0)
        if fields["kind"] == "text" and fields.get("artifact"):
            body = json.loads((settings.artifacts_path / fields["artifact"]).read_bytes())
            for name in experts:
                experts[name] += body["metrics"]["cache"].get(name, 0)
    done = sum(store.fields(j)["state"] == "DONE" for j in ids)
    return {
        "jobs": len(ids), "done": done, "makespan_s": round(makespan_s, 3),
        "checkpoint_cache": {**ckpt, "hit_rate": _rate(ckpt)},
        "expert_cache_text_jobs": {**experts, "hit_rate": _rate(experts)},
        "hops_to_another_worker": {kind: {"moved": m, "hops": n, "share": round(m / n, 4)
                                          if n else None} for kind, (m, n) in moves.items()},
    }


def _rate(counts: dict[str, int]) -> float | None:
    total = counts["hits"] + counts["misses"]
    return round(counts["hits"] / total, 4) if total else None


if __name__ == "__main__":
    main()
