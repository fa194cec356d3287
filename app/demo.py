"""``stepline demo``: the embedded stack, a mixed workload of real diffusers and transformers
jobs replayed under FIFO and then under Stepline on the same workers, and a short SLO report."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from app.bench.driver import Outcome
from app.bench.report import RunData, met_slo
from app.bench.run import run_policy, wait_for_workers, write_report
from app.bench.workload import generate_trace, load_workload
from app.celery import configure as configure_celery
from app.schemas import JobSpec
from app.stack import Stack
from scheduler.lifecycle import SloClass
from tasks.runtime import current_settings, store_client
from tasks.store import JobStore
from tasks.submit import JobService

console = Console()
POLICIES = ("fifo", "stepline")


def run_demo(run_dir: Path, workers: int = 2, workload_name: str = "demo") -> int:
    settings = current_settings()
    workload = load_workload(workload_name)
    trace = generate_trace(workload, workers=workers)
    out_dir = run_dir / "report"
    configure_celery(settings)
    with Stack(settings=settings, run_dir=run_dir, workers=workers) as stack:
        service = JobService(JobStore(store_client(settings)), settings)
        wait_for_workers(service.store, workers)
        console.print(
            f"[bold]Stepline demo[/bold] — {workers} workers, embedded Redis "
            f"({stack.run_dir / 'redis.sock'}), Flower {stack.flower_url} "
            f"(login in {stack.run_dir / 'flower-auth'})\n"
            f"{len(trace)} jobs over {workload.duration_s:.0f} s ({workload.description}), "
            f"replayed under {' then '.join(POLICIES)} on the same workers"
        )
        _warm_up(service)
        runs = [_run_live(service, policy, trace, workers) for policy in POLICIES]
        service.store.set_policy(None)
        report = write_report(runs, workload, workload.load, trace, out_dir)
        flower = stack.flower_url
    _print_report(runs, report, settings.artifacts_path, out_dir, flower)
    lost = [o for run in runs for o in run.outcomes if o.job_id and o.final_state is None]
    return 1 if lost else 0


def _warm_up(service: JobService) -> None:
    """Build every model once in each worker so neither policy pays the first-load cost."""

    with console.status("warming up the workers (building the models once)…"):
        ids = []
        for _ in range(2):
            for kind, params in (
                ("image", {"model": "dit-tiny", "class_label": 1, "num_inference_steps": 2}),
                ("image", {"prompt": "warm", "num_inference_steps": 2}),
                ("video", {"prompt": "warm", "num_inference_steps": 2}),
                ("text", {"inputs": "warm", "max_new_tokens": 2, "model": "qwen3-moe-tiny"}),
            ):
                spec = JobSpec(kind=kind, params=params, deadline_s=120)  # type: ignore[arg-type]
                ids.append(service.submit(spec)[0])
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(
            service.store.state(j).is_terminal for j in ids
        ):
            time.sleep(0.2)


def _run_live(service: JobService, policy: str, trace: list[Any], workers: int) -> RunData:
    progress = Progress(TextColumn("{task.description:<22}"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[met]}"))
    totals = Counter(a.slo.value for a in trace)
    bars = {slo.value: progress.add_task(f"{policy}: {slo.value}", total=totals[slo.value],
                                         met="") for slo in SloClass}

    def on_progress(outcomes: list[Outcome]) -> None:
        for slo in SloClass:
            mine = [o for o in outcomes if o.arrival.slo is slo and o.finished_at is not None]
            late = sum(1 for o in mine if o.final_state != "DONE")
            progress.update(bars[slo.value], completed=len(mine),
                            met=f"{len(mine) - late} done" + (f", {late} not" if late else ""))

    with Live(Group(progress), console=console, refresh_per_second=8):
        run = run_policy(service, policy, trace, workers, drain_timeout_s=120,
                         on_progress=on_progress)
        on_progress(run.outcomes)
    return run


def _print_report(
    runs: list[RunData], report: dict[str, Any], artifacts: Path, out_dir: Path, flower: str
) -> None:
    table = Table("class", *(f"{run.policy} SLO met" for run in runs),
                  *(f"{run.policy} p95" for run in runs), title="SLO attainment, same trace")
    for slo in SloClass:
        cells = []
        for run in runs:
            mine = [o for o in run.outcomes if o.arrival.slo is slo]
            met = sum(met_slo(o, run.records.get(o.job_id or "")) for o in mine)
            cells.append(f"{met}/{len(mine)} ({100 * met / max(len(mine), 1):.0f}%)")
        for run in runs:
            p95 = report["policies"][run.policy]["classes"][slo.value]["p95_s"]
            cells.append("-" if p95 is None else f"{p95:.2f}s")
        table.add_row(slo.value, *cells)
    console.print(table)
    kinds = Counter(p.suffix for p in artifacts.glob("*.*"))
    console.print(f"artifacts: {artifacts} — {kinds.get('.png', 0)} images (PNG), "
                  f"{kinds.get('.mp4', 0)} videos (MP4), {kinds.get('.json', 0)} texts (JSON)")
    console.print(f"report: {out_dir / 'report.json'} with plots {', '.join(report['plots'])}")
    console.print(f"Flower (while a stack runs): {flower}")
