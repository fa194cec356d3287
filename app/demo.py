"""``stepline demo``: start the embedded stack, run a small mixed workload, report each job."""

from __future__ import annotations

import random
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from app.jobs import JobService
from app.runtime import connect, current_settings, redis_url
from app.schemas import JobRecord, JobSpec
from app.stack import Stack
from app.store import JobStore
from scheduler.lifecycle import JobState, SloClass

console = Console()

# (class, steps, step_ms, how many): short urgent jobs among long batch "videos".
MIX = [
    (SloClass.BATCH, 40, 100.0, 2),
    (SloClass.INTERACTIVE, 10, 60.0, 4),
    (SloClass.REALTIME, 4, 30.0, 8),
]


def _table(records: list[JobRecord]) -> Table:
    table = Table("job", "class", "state", "progress", "latency", "SLO")
    for r in records:
        filled = int(20 * r.progress / max(r.total, 1))
        latency = f"{r.latency_s:.2f}s" if r.latency_s is not None else ""
        met = ""
        if r.finished_at is not None:
            met = "met" if r.finished_at <= r.deadline_at else "MISSED"
        table.add_row(r.id, r.slo.value, r.state.value,
                      "█" * filled + "░" * (20 - filled) + f" {r.progress}/{r.total}", latency, met)
    return table


def run_demo(run_dir: Path, workers: int = 2, seed: int = 7) -> int:
    settings = current_settings()
    rng = random.Random(seed)
    arrivals = sorted(
        (rng.uniform(0, 6), slo, steps, step_ms)
        for slo, steps, step_ms, count in MIX for _ in range(count)
    )
    with Stack(settings=settings, run_dir=run_dir, workers=workers) as stack:
        service = JobService(JobStore(connect(redis_url(settings))), settings)
        _wait_for_workers(service.store, workers)
        console.print(f"[bold]Stepline demo[/bold]: {workers} workers, embedded Redis at "
                      f"{stack.run_dir / 'redis.sock'}, {len(arrivals)} simulated jobs")
        started, ids = time.monotonic(), []
        with Live(console=console, refresh_per_second=8) as live:
            while True:
                now = time.monotonic() - started
                while arrivals and arrivals[0][0] <= now:
                    _, slo, steps, step_ms = arrivals.pop(0)
                    spec = JobSpec(kind="simulated", slo=slo,
                                   params={"steps": steps, "step_ms": step_ms})
                    ids.append(service.submit(spec)[0])
                records = [service.store.get(job_id) for job_id in ids]
                live.update(_table(records))
                if not arrivals and all(r.state.is_terminal for r in records):
                    break
                time.sleep(0.1)
    return _report(records)


def _wait_for_workers(store: JobStore, count: int, timeout_s: float = 60) -> None:
    from tasks.context import WORKER_KEY

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(list(store.redis.scan_iter(WORKER_KEY + "w*"))) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"workers did not start in {timeout_s}s; see the run directory's logs")


def _report(records: list[JobRecord]) -> int:
    console.print("\n[bold]SLO attainment by class[/bold]")
    for slo in SloClass:
        mine = [r for r in records if r.slo is slo]
        met = sum(1 for r in mine if r.state is JobState.DONE and r.finished_at is not None
                  and r.finished_at <= r.deadline_at)
        console.print(f"  {slo.value:<12} {met}/{len(mine)} met")
    failed = [r for r in records if r.state is not JobState.DONE]
    return 1 if failed else 0
