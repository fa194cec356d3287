"""Benchmark of the MoE expert cache (a script, not a test).

Hit rate against cache size for LRU, LFRU and Belady's offline optimum, on routing traces recorded
from the tiny recipes and on a Zipf-skewed synthetic trace; tokens/s with 25 %, 50 % and 100 % of
the experts resident; resident expert memory against the all-resident model. CPU figures: a miss
is a host memcpy here, a host-to-device copy on CUDA.

    python tests/bench/bench_moe.py --out bench-out/moe.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from workers.moe.expert_cache import CacheConfig
from workers.moe.policy import LfruPolicy, LruPolicy, belady_hits, simulate_hits
from workers.moe.recipes import build_model, load_recipe
from workers.moe.router import RouterConfig
from workers.moe.runner import TextRunner
from workers.moe.session import open_session
from workers.moe.tokenizer import encode_prompt

PROMPTS = [
    "Explain quantum computing in simple terms",
    "Write a short poem about the ocean at night",
    "How do I bake bread at home?",
    "Tell me a story about a dragon and a brave knight",
    "What is the capital of France?",
    "Summarise this paragraph in one sentence",
]
Trace = dict[int, list[list[int]]]  # layer -> per token, the experts it needs


def record_trace(model: str, new_tokens: int) -> tuple[Trace, int]:
    """Greedy-generate every prompt with native routing; returns per-layer expert steps."""
    loaded = build_model(load_recipe(model))
    session = open_session(loaded, CacheConfig(prefetch_experts=0))
    session.new_context(RouterConfig.native())
    session.context.trace = []
    for prompt in PROMPTS:
        ids = torch.tensor([encode_prompt(loaded.tokenizer, prompt)])
        with torch.inference_mode():
            loaded.model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    trace: Trace = defaultdict(list)
    for layer, rows in session.context.trace:
        trace[layer].extend(sorted(set(row)) for row in rows)
    return dict(trace), loaded.num_experts


def zipf_trace(layers: int, experts: int, tokens: int, seed: int = 0) -> Trace:
    """Top-2 routing drawn from a Zipf(1.1) popularity, permuted per layer."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(experts)]
    trace: Trace = {}
    for layer in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        steps = []
        for _ in range(tokens):
            picks: set[int] = set()
            while len(picks) < 2:
                picks.add(order[rng.choices(range(experts), weights)[0]])
            steps.append(sorted(picks))
        trace[layer] = steps
    return trace


def hit_rates(trace: Trace, experts: int) -> list[dict[str, Any]]:
    """Hit rate (all layers) per slots-per-layer, for each policy and the Belady bound."""
    rows = []
    accesses = sum(len(e) for steps in trace.values() for e in steps)
    for slots in sorted({max(2, experts * f // 8) for f in (1, 2, 3, 4, 6)}):
        row: dict[str, Any] = {"slots_per_layer": slots, "resident_share": slots / experts}
        for name, make in (("lru", LruPolicy), ("lfru", LfruPolicy)):
            hits = sum(simulate_hits(steps, slots, make()) for steps in trace.values())
            row[name] = round(hits / accesses, 4)
        row["belady"] = round(sum(belady_hits(s, slots) for s in trace.values()) / accesses, 4)
        rows.append(row)
    return rows


def _one_pass(runner: TextRunner, model: str, new_tokens: int) -> tuple[int, float]:
    tokens, elapsed_s = 0, 0.0
    for prompt in PROMPTS:
        params = {"prompt": prompt, "max_new_tokens": new_tokens, "chunk_tokens": new_tokens,
                  "model": model}
        state = None
        for index in range(runner.plan(params).num_chunks):
            started = time.perf_counter()
            result = runner.run_chunk(params, index, state, lambda: False)
            elapsed_s += time.perf_counter() - started
            state, tokens = result.state, tokens + int(result.metrics["tokens"])
    return tokens, elapsed_s


def throughput(model: str, share: float, new_tokens: int, repeats: int = 3) -> dict[str, Any]:
    """Greedy decode tokens/s with ``share`` of the experts resident (best of ``repeats``)."""
    loaded = build_model(load_recipe(model))
    expert = loaded.model.model.layers[0].mlp.experts
    per_expert = (expert.gate_up_proj[0].numel() + expert.down_proj[0].numel()) * 4
    total = per_expert * loaded.num_experts * loaded.num_layers
    budget = int(total * share / 0.85) + 1 if share < 1.0 else None
    runner = TextRunner(router=RouterConfig.native(), cache=CacheConfig(budget_bytes=budget))
    session = runner.session(model)
    passes = [_one_pass(runner, model, new_tokens) for _ in range(repeats)]
    tokens, elapsed_s = min(passes, key=lambda p: p[1] / p[0])  # best pass: least contention
    counters = session.cache.counters
    return {
        "resident_share": share,
        "slots_per_layer": session.cache.slots_per_layer,
        "tokens_per_s": round(tokens / elapsed_s, 1),
        "hit_rate": round(counters.hit_rate, 4),
        "bytes_moved": counters.bytes_moved,
        "prefetch_accuracy": round(counters.prefetch_accuracy, 4),
        "resident_expert_bytes": session.cache.resident_bytes(),
        "all_expert_bytes": total,
        "model_bytes_all_resident": sum(p.numel() * 4 for p in loaded.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/moe.json"))
    parser.add_argument("--models", default="mixtral-tiny,qwen3-moe-tiny")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier figures for tiny matrices
    report: dict[str, Any] = {"device": "cpu", "hit_rate": {}, "throughput": {}}
    for model in args.models.split(","):
        trace, experts = record_trace(model, args.tokens)
        report["hit_rate"][f"trace:{model}"] = hit_rates(trace, experts)
        report["throughput"][model] = [throughput(model, s, args.tokens) for s in (0.25, 0.5, 1.0)]
    report["hit_rate"]["zipf:4x64"] = hit_rates(zipf_trace(4, 64, 4000), 64)
    _print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def _print(report: dict[str, Any]) -> None:
    for trace, rows in report["hit_rate"].items():
        print(f"\nhit rate, {trace}")
        print(f"{'slots':>6} {'share':>6} {'lru':>7} {'lfru':>7} {'belady':>7}")
        for r in rows:
            print(f"{r['slots_per_layer']:>6} {r['resident_share']:>6.2f} "
                  f"{r['lru']:>7.3f} {r['lfru']:>7.3f} {r['belady']:>7.3f}")
    for model, rows in report["throughput"].items():
        print(f"\nthroughput, {model} (cpu)")
        for r in rows:
            print(f"  {r['resident_share']:>4.0%} resident: {r['tokens_per_s']:>7.1f} tok/s, "
                  f"hit {r['hit_rate']:.3f}, moved {r['bytes_moved'] / 2**20:.1f} MiB, "
                  f"resident {r['resident_expert_bytes'] / 2**20:.2f} of "
                  f"{r['all_expert_bytes'] / 2**20:.2f} MiB experts "
                  f"(model {r['model_bytes_all_resident'] / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
