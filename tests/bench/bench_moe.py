"""Benchmark of the MoE expert cache (a script, not a test).

1. Replay tables (`stepline experts replay`'s figures): per slots-per-layer size, each eviction
   policy's demand hit rate, Belady's optimum on the same sequences, the default cache's ratio
   to it, and with prefetch the stall-free share, prefetches used / late / wasted and bytes moved
   against demand paging. On routing traces recorded from each MoE recipe (with the lookahead
   predictor's predictions) and on synthetic traces (per-layer Zipf skew, locality, a lookahead of
   known accuracy).
2. Tokens/s of the live runner with 25 %, 50 % and 100 % of the experts resident, prefetch on
   and off. CPU figures: a miss is a host memcpy here, a host-to-device copy on CUDA.

    python tests/bench/bench_moe.py --out bench-out/moe.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from workers.moe.expert_cache import CacheConfig
from workers.moe.policy import POLICY_NAMES
from workers.moe.recipes import build_model, load_recipe
from workers.moe.record import read_inputs, record_trace
from workers.moe.replay import format_table, replay_table
from workers.moe.router import RouterConfig
from workers.moe.runner import TextRunner
from workers.moe.traces import RoutingTrace, synthetic_trace, top_k_overlap

PROMPTS = Path(__file__).resolve().parents[2] / "configs" / "prompts" / "record.jsonl"
GOAL_DEMAND_RATIO = 0.93
GOAL_BYTES = 1.3
GOAL_THROUGHPUT = 0.7


def traces(models: list[str], prompts: int, synthetic_requests: int) -> dict[str, RoutingTrace]:
    """Recorded traces of ``models`` and the synthetic ones, by name."""
    out: dict[str, RoutingTrace] = {}
    inputs = read_inputs(PROMPTS, 48)[:prompts]
    for model in models:
        out[f"recorded:{model}"] = record_trace(model, inputs)
    common = {"requests": synthetic_requests, "layers": 24, "experts": 128, "top_k": 1}
    out["synthetic:skew0.6-1.4,look0.9"] = synthetic_trace(**common, lookahead_accuracy=0.9)
    out["synthetic:skew0.3-2.2,look0.9"] = synthetic_trace(**common, skew=(0.3, 2.2),
                                                           lookahead_accuracy=0.9)
    out["synthetic:skew0.6-1.4,look0.6"] = synthetic_trace(**common, lookahead_accuracy=0.6)
    return out


def replays(named: dict[str, RoutingTrace], config: CacheConfig) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, trace in named.items():
        started = time.perf_counter()
        rows = replay_table(trace, (4, 8, 16, 32), config, POLICY_NAMES)
        accuracy = top_k_overlap(trace)
        print(f"\n{name}: {len(trace.requests)} requests, {trace.tokens()} steps, "
              f"{len(trace.moe_layers())} MoE layers x {trace.experts()} experts, lookahead "
              f"accuracy {'-' if accuracy is None else format(accuracy, '.3f')} "
              f"({time.perf_counter() - started:.0f} s)")
        print(format_table(rows, POLICY_NAMES))
        report[name] = {"lookahead_accuracy": accuracy, "rows": [r.as_dict() for r in rows]}
    return report


def _one_pass(runner: TextRunner, model: str, new_tokens: int) -> tuple[int, float]:
    tokens, elapsed_s = 0, 0.0
    for item in read_inputs(PROMPTS, new_tokens)[:6]:
        params = {"prompt": item.prompt, "max_new_tokens": new_tokens,
                  "chunk_tokens": new_tokens, "model": model}
        state = None
        for index in range(runner.plan(params).num_chunks):
            started = time.perf_counter()
            result = runner.run_chunk(params, index, state, lambda: False)
            elapsed_s += time.perf_counter() - started
            state, tokens = result.state, tokens + int(result.metrics["tokens"])
    return tokens, elapsed_s


def throughput(model: str, share: float, new_tokens: int, prefetch: bool,
               repeats: int = 3) -> dict[str, Any]:
    """Greedy decode tokens/s with ``share`` of the experts resident (best of ``repeats``)."""
    loaded = build_model(load_recipe(model))
    expert = loaded.model.model.layers[0].mlp.experts
    per_expert = (expert.gate_up_proj[0].numel() + expert.down_proj[0].numel()) * 4
    total = per_expert * loaded.num_experts * loaded.num_layers
    budget = int(total * share / 0.85) + 1 if share < 1.0 else None
    config = CacheConfig(budget_bytes=budget, prefetch_experts=2 if prefetch else 0)
    runner = TextRunner(router=RouterConfig.native(), cache=config)
    session = runner.session(model)
    passes = [_one_pass(runner, model, new_tokens) for _ in range(repeats)]
    tokens, elapsed_s = min(passes, key=lambda p: p[1] / p[0])  # best pass: least contention
    c = session.cache.counters
    return {
        "resident_share": share,
        "prefetch": prefetch,
        "slots": session.cache.capacities(),
        "tokens_per_s": round(tokens / elapsed_s, 1),
        "stall_free": round(c.hit_rate, 4),
        "late": c.late,
        "bytes_moved": c.bytes_moved,
        "prefetch_used_share": round(c.prefetch_used / c.prefetch_issued, 4)
        if c.prefetch_issued else None,
        "lookahead_accuracy": c.lookahead_accuracy,
        "stall_s": round(c.stall_s, 4),
        "resident_expert_bytes": session.cache.resident_bytes(),
        "all_expert_bytes": total,
    }


def goals(report: dict[str, Any]) -> list[str]:
    """One line per goal of the cache, per trace / model."""
    lines = []
    for name, item in report["replay"].items():
        row = next((r for r in item["rows"] if r["slots_per_layer"] == 8), None)
        if row is None:
            continue
        ratio = row["default_over_belady"]
        lines.append(f"{name} @8: default/Belady {ratio:.3f} (goal >= {GOAL_DEMAND_RATIO}) "
                     f"{'met' if ratio >= GOAL_DEMAND_RATIO else 'MISSED'}")
        p = row.get("prefetch")
        if p:
            met = p["stall_free"] >= row["belady"] and (p["bytes_over_demand"] or 0) <= GOAL_BYTES
            lines.append(f"{name} @8: stall-free {p['stall_free']:.3f} vs Belady "
                         f"{row['belady']:.3f}, bytes {p['bytes_over_demand']:.2f}x demand "
                         f"(goal >= Belady at <= {GOAL_BYTES}x) {'met' if met else 'MISSED'}")
    for model, rows in report["throughput"].items():
        by = {(r["resident_share"], r["prefetch"]): r["tokens_per_s"] for r in rows}
        full = by.get((1.0, True))
        quarter = by.get((0.25, True))
        if full and quarter:
            ratio = quarter / full
            lines.append(f"{model}: tokens/s at 25 % resident {ratio:.2f}x all-resident "
                         f"(goal >= {GOAL_THROUGHPUT}) "
                         f"{'met' if ratio >= GOAL_THROUGHPUT else 'MISSED'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/moe.json"))
    parser.add_argument("--models", default="mixtral-tiny,qwen3-moe-tiny,olmoe-tiny")
    parser.add_argument("--prompts", type=int, default=30, help="prompts recorded per model")
    parser.add_argument("--synthetic-requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per throughput prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier figures for tiny matrices
    models = args.models.split(",")
    config = replace(CacheConfig(), overlap=False)
    report: dict[str, Any] = {"device": "cpu", "copy_cost": 0.5,
                              "default": {"policy": config.policy,
                                          "allocation": config.allocation,
                                          "prefetch_experts": config.prefetch_experts},
                              "replay": {}, "throughput": {}}
    report["replay"] = replays(traces(models, args.prompts, args.synthetic_requests), config)
    for model in models[:2]:
        rows = [throughput(model, share, args.tokens, prefetch)
                for share in (0.25, 0.5, 1.0) for prefetch in (False, True)]
        report["throughput"][model] = rows
        print(f"\nthroughput, {model} (cpu)")
        for r in rows:
            print(f"  {r['resident_share']:>4.0%} resident, prefetch "
                  f"{'on ' if r['prefetch'] else 'off'}: {r['tokens_per_s']:>7.1f} tok/s, "
                  f"stall-free {r['stall_free']:.3f}, moved {r['bytes_moved'] / 2**20:.1f} MiB")
    report["goals"] = goals(report)
    print("\n" + "\n".join(report["goals"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
