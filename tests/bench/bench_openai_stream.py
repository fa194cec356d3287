"""Streaming chat benchmark (a script, not a test): TTFT, inter-token latency and output tokens/s
of POST /v1/chat/completions with stream: true, timed by the client from the SSE stream itself.

Each request asks for a fixed output length (``ignore_eos`` + ``max_tokens``, as benchmark
clients of OpenAI-compatible servers do) with ``stream_options.continuous_usage_stats``, so every
chunk says how many tokens it carries. Per concurrency level (1 / 4 / 16 requests in flight,
each round starting them together): TTFT (send to the first content chunk), ITL (the gap before
each content chunk, divided among the tokens it carries: Stepline sends one event per committed
decode chunk of ``chunk_tokens`` tokens), each with p50 (95 % CI) and p99 over all requests, and
output tokens/s per round (mean, 95 % CI over rounds). Starts its own stack (`stepline up`'s
processes, warm) unless --url names a running one. Writes JSON and prints a table.

    python tests/bench/bench_openai_stream.py --out bench-out/openai-stream.json
    python tests/bench/bench_openai_stream.py --url http://127.0.0.1:8080 \\
        --key "$(cat .stepline/api-key)"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.bench.report import mean_ci, median_ci, percentile
from app.run_files import API_KEY_FILE
from app.stack import Stack, wait_for_api, wait_for_ready
from tasks.settings import load_settings

MODEL = "qwen3-moe-tiny"
PROMPT = "Tell me a story about a dragon and a brave knight"


@dataclass
class StreamTiming:
    """What the client saw of one streamed request."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0


async def stream_one(http: httpx.AsyncClient, max_tokens: int, chunk_tokens: int) -> StreamTiming:
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": PROMPT}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stepline": {"params": {"chunk_tokens": chunk_tokens}}}
    timing, counted = StreamTiming(), 0
    sent_s = last_s = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now_s, event = time.perf_counter(), json.loads(line[6:])
            usage = event.get("usage") or {}
            total = int(usage.get("completion_tokens", counted))
            content = any((c.get("delta") or {}).get("content") for c in event.get("choices", []))
            if content and total > counted:
                if timing.ttft_s is None:
                    timing.ttft_s = now_s - sent_s
                else:
                    gap = (now_s - last_s) / (total - counted)
                    timing.itl_s.extend([gap] * (total - counted))
                last_s = now_s
            counted = max(counted, total)
    timing.tokens = counted
    return timing


async def one_round(url: str, key: str, concurrency: int, max_tokens: int,
                    chunk_tokens: int) -> tuple[list[StreamTiming], float]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=600, limits=limits) as http:
        started_s = time.perf_counter()
        timings = await asyncio.gather(*(stream_one(http, max_tokens, chunk_tokens)
                                         for _ in range(concurrency)))
        return list(timings), time.perf_counter() - started_s


def level(url: str, key: str, concurrency: int, rounds: int, max_tokens: int,
          chunk_tokens: int) -> dict[str, Any]:
    ttft, itl, rates, tokens = [], [], [], []
    for _ in range(rounds):
        timings, wall_s = asyncio.run(one_round(url, key, concurrency, max_tokens, chunk_tokens))
        ttft += [t.ttft_s for t in timings if t.ttft_s is not None]
        itl += [gap for t in timings for gap in t.itl_s]
        tokens += [t.tokens for t in timings]
        rates.append(sum(t.tokens for t in timings) / wall_s)
    return {"concurrency": concurrency, "rounds": rounds, "requests": len(tokens),
            "output_tokens_all_requests": sorted(set(tokens)),
            "ttft_ms": _quantiles(ttft), "itl_ms": _quantiles(itl),
            "output_tokens_per_s": mean_ci(rates)}


def _quantiles(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    return {"p50": median_ci(ms), "p99": percentile(ms, 99), "n": len(ms)}


@contextmanager
def own_stack(workers: int) -> Iterator[tuple[str, str]]:
    """A fresh stack (workers warm) on free ports; yields its URL and API key."""
    from tests.bench.bench_first_job import free_port

    with tempfile.TemporaryDirectory(prefix="stepline-stream-") as tmp:
        run_dir = Path(tmp) / "run"
        os.environ.update({"STEPLINE_RUN_DIR": str(run_dir),  # the stack's processes read it
                           "STEPLINE_SERVICE__API_PORT": str(free_port()),
                           "STEPLINE_SERVICE__FLOWER_PORT": str(free_port())})
        os.environ.pop("STEPLINE_WARM_START", None)
        os.environ.pop("REDIS_URL", None)
        settings = load_settings()
        with Stack(settings=settings, run_dir=run_dir, workers=workers,
                   with_flower=False) as stack:
            if not (wait_for_api(stack.api_url, 120) and wait_for_ready(stack.api_url)):
                raise RuntimeError(f"the stack did not get ready; see {run_dir / 'logs'}")
            yield stack.api_url, (run_dir / API_KEY_FILE).read_text().strip()


def table(report: dict[str, Any]) -> str:
    rows = [f"{'conc':>4} {'TTFT p50 ms (95% CI)':>24} {'p99':>7} {'ITL p50 ms (95% CI)':>22} "
            f"{'p99':>7} {'out tok/s (95% CI)':>22}"]
    for r in report["levels"]:
        t, i, o = r["ttft_ms"], r["itl_ms"], r["output_tokens_per_s"]
        rows.append(f"{r['concurrency']:>4} {t['p50']['median']:>7.0f} ({t['p50']['lo']:>5.0f}-"
                    f"{t['p50']['hi']:>5.0f})  {t['p99']:>7.0f} {i['p50']['median']:>7.1f} "
                    f"({i['p50']['lo']:>5.1f}-{i['p50']['hi']:>5.1f}) {i['p99']:>7.1f} "
                    f"{o['mean']:>8.1f} ({o['lo']:>5.1f}-{o['hi']:>5.1f})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="A running stack's API (default: start one).")
    parser.add_argument("--key", help="Its API key (with --url).")
    parser.add_argument("--workers", type=int, default=2, help="Workers of the own stack.")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-out/openai-stream.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    def run(url: str, key: str) -> dict[str, Any]:
        level(url, key, 1, 1, args.max_tokens, args.chunk_tokens)  # one unmeasured request
        return {"model": MODEL, "max_tokens": args.max_tokens, "ignore_eos": True,
                "chunk_tokens": args.chunk_tokens, "url": url if args.url else "own stack",
                "workers": None if args.url else args.workers,
                "levels": [level(url, key, c, args.rounds, args.max_tokens, args.chunk_tokens)
                           for c in levels]}

    if args.url:
        report = run(args.url, args.key or "")
    else:
        with own_stack(args.workers) as (url, key):
            report = run(url, key)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"streaming chat on {MODEL}, {args.max_tokens} tokens per request (ignore_eos), "
          f"chunk_tokens {args.chunk_tokens}, {args.rounds} rounds per level")
    print(table(report))
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
