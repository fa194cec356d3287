"""First job vs second job after a fresh `stepline up` (a script, not a test).

Starts `stepline up --workers 1` of a checkout (this one, or another given with --checkout) in a
fresh run directory on free ports, waits until it answers (and, with warm start, until /readyz
says the worker is warm — the time `stepline up` itself waits), then per kind (image, video,
text) submits one job, waits for it, and submits the same job again: each job's latency is
submit to DONE as the client sees it. Writes JSON and prints a table.

    python tests/bench/bench_first_job.py --out bench-out/first-job.json
    python tests/bench/bench_first_job.py --checkout ../main --out bench-out/first-job-main.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

JOBS: dict[str, dict[str, Any]] = {
    "image": {"kind": "image", "slo": "interactive",
              "params": {"prompt": "a red fox", "num_inference_steps": 4}},
    "video": {"kind": "video", "slo": "batch",
              "params": {"prompt": "a red fox running", "num_inference_steps": 4}},
    "text": {"kind": "text", "slo": "interactive",
             "params": {"inputs": "Explain quantum computing in simple terms",
                        "max_new_tokens": 16}},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Any, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if check():
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout_s:.0f}s")


def run_job(http: httpx.Client, body: dict[str, Any]) -> float:
    """Seconds from submit to DONE, as the client sees them."""
    started = time.perf_counter()
    job_id = http.post("/v1/jobs", json=body, timeout=600).raise_for_status().json()["id"]
    while True:
        state = http.get(f"/v1/jobs/{job_id}", timeout=600).json()["state"]
        if state in ("DONE", "FAILED", "CANCELLED", "EXPIRED"):
            break
        time.sleep(0.02)
    if state != "DONE":
        raise RuntimeError(f"job {job_id} ended {state}")
    return time.perf_counter() - started


def measure(checkout: Path, run_dir: Path) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "STEPLINE_RUN_DIR": str(run_dir),
           "STEPLINE_SERVICE__API_PORT": str(port),
           "STEPLINE_SERVICE__FLOWER_PORT": str(free_port())}
    env.pop("REDIS_URL", None)
    env.pop("STEPLINE_WARM_START", None)
    started = time.monotonic()
    up = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--workers", "1"], cwd=checkout,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert up.stdout is not None
        for line in up.stdout:  # the banner's first line: `stepline up` reports ready
            if line.startswith("stepline up:"):
                break
        ready_s = time.monotonic() - started
        key = (run_dir / "api-key").read_text().strip()
        with httpx.Client(base_url=url, headers={"X-API-Key": key}) as http:
            wait_until(lambda: http.get("/healthz").status_code == 200, 120, "the API")
            kinds = {}
            for kind, body in JOBS.items():
                first, second = run_job(http, body), run_job(http, body)
                kinds[kind] = {"first_s": first, "second_s": second, "ratio": first / second}
        return {"checkout": str(checkout), "up_until_ready_s": ready_s, "kinds": kinds}
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--out", type=Path, default=Path("bench-out/first-job.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stepline-first-job-") as tmp:
        report = measure(args.checkout.resolve(), Path(tmp) / "run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{report['checkout']}: `stepline up` reported ready after "
          f"{report['up_until_ready_s']:.1f}s")
    print(f"{'kind':<6} {'first s':>8} {'second s':>9} {'first/second':>13}")
    for kind, row in report["kinds"].items():
        print(f"{kind:<6} {row['first_s']:>8.2f} {row['second_s']:>9.2f} {row['ratio']:>13.2f}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
