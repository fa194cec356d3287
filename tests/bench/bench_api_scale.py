"""The API and the submit path against a growing backlog (a script, not a test).

Starts a private Redis and the API (uvicorn over the app factory, in its own process, as `stepline
up` runs it), with no worker and no scheduler, so every job submitted stays live. For each backlog
level (100, 1 000 and 10 000 unfinished jobs by default; the first is the baseline) it fills the
store up to the level through the API's own submit path, then measures, at that level:

- the latency of each read a client or the dashboard makes (sequential requests over one
  keep-alive connection): p50 and p99 with distribution-free 95 % intervals;
- submits per second through the REST submit path in this process (``submit_for``: rate limit,
  quota, validation, planning, admission, store, release) and over HTTP (``POST /v1/jobs`` from
  concurrent keep-alive clients, and ``POST /v1/jobs/batch`` with ``--batch`` jobs a request),
  each over several rounds (mean and its 95 % t-interval).

Prints a table (and each figure's ratio to the baseline level, which shows any growth with the
backlog) and writes JSON.

    python tests/bench/bench_api_scale.py --out bench-out/api-scale.json
    python tests/bench/bench_api_scale.py --levels 0,1000,10000 --samples 200 --out x.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from app.bench.report import Z_95, mean_ci  # noqa: E402
from app.embedded_redis import EmbeddedRedis  # noqa: E402

KEY = "bench-key-0123456789abcdef"
TENANT = "bench"
CLASSES = ("realtime", "interactive", "batch")
READS: dict[str, str] = {
    "GET /v1/jobs (limit 50)": "/v1/jobs?limit=50",
    "GET /v1/jobs (cursor page)": "",  # the page after the first one: filled in at run time
    "GET /v1/jobs?state=RUNNING (none match)": "/v1/jobs?state=RUNNING&limit=50",
    "GET /v1/stats": "/v1/stats",
    "GET /metrics": "/metrics",
    "GET /v1/dashboard/data": "/v1/dashboard/data",
    "GET /dashboard (page)": "/dashboard",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quantile_ci(values: list[float], q: float) -> dict[str, float]:
    """The ``q`` quantile (nearest rank) and a distribution-free 95 % interval: the order
    statistics whose ranks bracket it with probability ≥ 0.95 (binomial, normal
    approximation); they reach the extremes when the sample is too small for a narrower one."""
    ordered = sorted(values)
    n = len(ordered)
    rank = min(n, max(1, math.ceil(q * n))) - 1
    half = Z_95 * math.sqrt(n * q * (1 - q))
    lo = max(0, math.floor(n * q - half) - 1)
    hi = min(n - 1, math.ceil(n * q + half))
    return {"value": ordered[rank], "lo": ordered[lo], "hi": ordered[hi]}


def latency_figures(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    p50, p99 = quantile_ci(ms, 0.50), quantile_ci(ms, 0.99)
    return {"samples": len(ms), "p50_ms": round(p50["value"], 2),
            "p50_ci_ms": [round(p50["lo"], 2), round(p50["hi"], 2)],
            "p99_ms": round(p99["value"], 2), "p99_ci_ms": [round(p99["lo"], 2),
                                                             round(p99["hi"], 2)],
            "max_ms": round(max(ms), 2)}


def rate_figures(rates: list[float]) -> dict[str, Any]:
    ci = mean_ci(rates)
    return {"rounds": len(rates), "per_s": round(ci["mean"], 1),
            "ci_per_s": [round(ci["lo"], 1), round(ci["hi"], 1)],
            "each_round": [round(r, 1) for r in rates]}


def job_body(i: int) -> dict[str, Any]:
    return {"kind": "simulated", "slo": CLASSES[i % 3],
            "params": {"steps": 4, "step_ms": 10}}


class Bench:
    """The store, this process's submit path and the API process of one run."""

    def __init__(self, run_dir: Path, port: int) -> None:
        self.redis = EmbeddedRedis(run_dir / "redis")
        self.redis.start()
        try:
            self._start(run_dir, port)
        except BaseException:
            self.redis.stop()
            raise

    def _start(self, run_dir: Path, port: int) -> None:
        from app.api.context import ApiContext
        from app.celery import configure as configure_celery
        from app.schemas import JobSpec
        from tasks.runtime import current_settings

        self.env = {
            "REDIS_URL": self.redis.url, "STEPLINE_RUN_DIR": str(run_dir / "run"),
            "STEPLINE_WARM_START": "false",
            "STEPLINE_API__KEYS": json.dumps([{
                "key": KEY, "tenant": TENANT, "tier": "standard", "rate_limit_per_s": 100_000,
                "burst": 1_000_000, "max_queued": 1_000_000}]),
        }
        os.environ.update(self.env)
        current_settings.cache_clear()
        settings = current_settings()
        configure_celery(settings)
        self.ctx = ApiContext.from_settings(settings)
        self.tenant = self.ctx.tenants.resolve(KEY)
        self.specs = [JobSpec.model_validate(job_body(i)) for i in range(3)]
        self.submitted = 0
        self.url = f"http://127.0.0.1:{port}"
        log = open(run_dir / "api.log", "wb")  # noqa: SIM115
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "app.api.main:create_app",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
             "--no-access-log"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
            stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 600  # the API imports torch first: minutes when loaded
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.api.kill()
        tail = (run_dir / "api.log").read_text()[-2000:]
        raise TimeoutError(f"the API did not answer within 600 s; its log ends:\n{tail}")

    def close(self) -> None:
        self.api.terminate()
        self.api.wait(timeout=30)
        self.redis.stop()

    def live(self) -> int:
        return self.ctx.reads.live_by_state().total

    def submit_in_process(self, count: int) -> float:
        """``count`` submits through the API's submit path in this process; returns per s."""
        from app.api.jobs import submit_for

        assert self.tenant is not None
        started = time.perf_counter()
        for _ in range(count):
            submit_for(self.ctx, self.tenant, self.specs[self.submitted % 3])
            self.submitted += 1
        return count / (time.perf_counter() - started)

    def fill(self, level: int) -> None:
        while (missing := level - self.live()) > 0:
            self.submit_in_process(min(missing, 1000))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": KEY}, timeout=60)

    def submit_over_http(self, count: int, clients: int, batch: int = 0) -> float:
        """``count`` jobs from ``clients`` concurrent keep-alive clients, one POST /v1/jobs
        each, or (``batch`` > 0) ``batch`` per POST /v1/jobs/batch; jobs per s."""
        errors: list[str] = []
        share = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
        pool = [self.client() for _ in range(clients)]
        for http in pool:  # connections open before the clock starts
            http.get("/healthz").raise_for_status()
        gate = threading.Barrier(clients + 1)

        def run(http: httpx.Client, n: int, first: int) -> None:
            gate.wait()
            if batch:
                for start in range(0, n, batch):
                    jobs = [job_body(first + i) for i in range(start, min(n, start + batch))]
                    response = http.post("/v1/jobs/batch", json={"jobs": jobs})
                    if response.status_code != 201:
                        errors.append(f"{response.status_code} {response.text[:200]}")
                return
            for i in range(n):
                response = http.post("/v1/jobs", json=job_body(first + i))
                if response.status_code != 201:
                    errors.append(f"{response.status_code} {response.text[:200]}")

        threads = [threading.Thread(target=run, args=(http, n, sum(share[:i])))
                   for i, (http, n) in enumerate(zip(pool, share, strict=True))]
        for thread in threads:
            thread.start()
        gate.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        for http in pool:
            http.close()
        if errors:
            raise RuntimeError(f"{len(errors)} submits failed, first: {errors[0]}")
        return count / elapsed

    def read_latencies(self, samples: int) -> dict[str, dict[str, Any]]:
        """Each read ``samples`` times, one after another over one keep-alive connection."""
        out = {}
        with self.client() as http:
            first = http.get("/v1/jobs?limit=50").raise_for_status().json()
            paths = {**READS, "GET /v1/jobs (cursor page)":
                     f"/v1/jobs?limit=50&cursor={first['next_cursor']}"
                     if first["next_cursor"] else "/v1/jobs?limit=50"}
            # the dashboard page wants a session: its token (here an API key) for a cookie
            http.get("/dashboard", params={"token": KEY}, follow_redirects=False)
            for name, path in paths.items():
                http.get(path).raise_for_status()  # warm
                seconds = []
                for _ in range(samples):
                    started = time.perf_counter()
                    response = http.get(path)
                    seconds.append(time.perf_counter() - started)
                    response.raise_for_status()
                out[name] = {**latency_figures(seconds), "bytes": len(response.content)}
        return out


def measure_level(bench: Bench, level: int, samples: int, submits: int, rounds: int,
                  clients: int, batch: int) -> dict[str, Any]:
    fill_started = time.perf_counter()
    bench.fill(level)
    filled_s = time.perf_counter() - fill_started
    at_reads = bench.live()
    reads = bench.read_latencies(samples)
    at_submits = bench.live()
    in_process = [bench.submit_in_process(submits) for _ in range(rounds)]
    over_http = [bench.submit_over_http(submits, clients) for _ in range(rounds)]
    batched = [bench.submit_over_http(submits * 4, clients, batch) for _ in range(rounds)]
    return {"level": level, "live_at_reads": at_reads, "live_at_submits": at_submits,
            "live_after": bench.live(), "fill_s": round(filled_s, 1), "reads": reads,
            "submit_in_process": rate_figures(in_process),
            "submit_http": {**rate_figures(over_http), "clients": clients},
            "submit_http_batch": {**rate_figures(batched), "clients": clients,
                                  "jobs_per_request": batch}}


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Each figure at ``other``'s level over the same at the baseline level."""
    out: dict[str, Any] = {}
    for name, figures in other["reads"].items():
        b = base["reads"][name]
        out[name] = {"p50": round(figures["p50_ms"] / b["p50_ms"], 2),
                     "p99": round(figures["p99_ms"] / b["p99_ms"], 2)}
    for path in ("submit_in_process", "submit_http", "submit_http_batch"):
        out[path] = round(other[path]["per_s"] / base[path]["per_s"], 2)
    return out


def show(levels: list[dict[str, Any]]) -> None:
    names = list(levels[0]["reads"])
    # a level's submits add to the backlog: the next level starts at least that high
    head = f"{'':42}" + "".join(f"{str(lv['live_at_reads']) + ' live':>30}" for lv in levels)
    print(head)
    print("latency: p50 [95% CI] / p99 [95% CI], ms")
    for name in names:
        cells = []
        for lv in levels:
            f = lv["reads"][name]
            cells.append(f"{f['p50_ms']:.1f} / {f['p99_ms']:.1f} "
                         f"[{f['p99_ci_ms'][0]:.0f}-{f['p99_ci_ms'][1]:.0f}]")
        print(f"{name:42}" + "".join(f"{c:>30}" for c in cells))
    print("submits/s: mean [95% CI]")
    for path, label in (("submit_in_process", "submit path in-process"),
                        ("submit_http", "POST /v1/jobs over HTTP"),
                        ("submit_http_batch", "POST /v1/jobs/batch over HTTP")):
        cells = [f"{lv[path]['per_s']:.0f} [{lv[path]['ci_per_s'][0]:.0f}-"
                 f"{lv[path]['ci_per_s'][1]:.0f}]" for lv in levels]
        print(f"{label:42}" + "".join(f"{c:>30}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="100,1000,10000",
                        help="backlog levels, comma-separated; the first is the baseline")
    parser.add_argument("--samples", type=int, default=100, help="requests per read and level")
    parser.add_argument("--submits", type=int, default=300, help="submits per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per submit path and level")
    parser.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients")
    parser.add_argument("--batch", type=int, default=100,
                        help="jobs per POST /v1/jobs/batch (its rounds submit 4x --submits)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    levels = sorted(int(x) for x in args.levels.split(","))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stepline-bench-") as tmp:
        bench = Bench(Path(tmp), free_port())
        try:
            results = []
            for level in levels:
                results.append(measure_level(bench, level, args.samples, args.submits,
                                             args.rounds, args.clients, args.batch))
                print(f"level {level}: measured ({time.perf_counter() - started:.0f}s)",
                      file=sys.stderr)
        finally:
            bench.close()
    show(results)
    report: dict[str, Any] = {
        "levels": results,
        "ratio_to_baseline": {str(r["level"]): ratios(results[0], r) for r in results[1:]},
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m": os.getloadavg()[0]},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report["ratio_to_baseline"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
