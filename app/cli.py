"""The ``stepline`` command.

Every command finds the running stack through ``--run-dir``, else ``STEPLINE_RUN_DIR``, else
``.stepline/`` in the working directory — or ``REDIS_URL`` when set.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.errors import SteplineError
from scheduler.lifecycle import JobState, SloClass

cli = typer.Typer(
    help="Stepline: SLO-aware serving of diffusion and MoE jobs.", no_args_is_help=True
)
console = Console()

RunDir = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory of the stack.")]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="YAML settings file.")]


def _setup(run_dir: Path | None, config: Path | None) -> None:
    """Export the choices so this process and every child agree on them."""
    if run_dir is not None:
        os.environ["STEPLINE_RUN_DIR"] = str(run_dir.resolve())
    elif "STEPLINE_RUN_DIR" not in os.environ:
        os.environ["STEPLINE_RUN_DIR"] = str(Path(".stepline").resolve())
    if config is not None:
        os.environ["STEPLINE_CONFIG"] = str(config.resolve())
    from app.runtime import current_settings

    current_settings.cache_clear()
    current_settings()  # fail early, with the key, value and bound


def _service() -> Any:
    from app.jobs import JobService
    from app.runtime import connect, current_settings, redis_url
    from app.store import JobStore

    settings = current_settings()
    return JobService(JobStore(connect(redis_url(settings))), settings)


@cli.command()
def up(
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 2,
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Start the stack: embedded Redis, workers, beat, scheduler (Ctrl-C stops everything)."""
    _setup(run_dir, config)
    from app.runtime import current_settings
    from app.stack import Stack, run_until_signalled

    settings = current_settings()
    stack = Stack(settings=settings, run_dir=Path(os.environ["STEPLINE_RUN_DIR"]), workers=workers)
    stack.start()
    where = settings.redis_url or f"embedded, {stack.run_dir / 'redis.sock'}"
    raise typer.Exit(run_until_signalled(
        stack, f"stepline up: {workers} workers, redis {where}; logs in {stack.run_dir / 'logs'}"
    ))


@cli.command()
def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "worker@%h",
    queues: Annotated[str, typer.Option(help="Queues in strict priority order.")] = (
        "realtime,interactive,batch,standby"
    ),
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Run one worker process in the foreground (one per device)."""
    _setup(run_dir, config)
    from app.stack import worker_command

    command = worker_command(name, queues.split(","))
    os.execv(command[0], command)


@cli.command()
def submit(
    kind: Annotated[str, typer.Option(help="simulated, image, video or text.")] = "simulated",
    slo: Annotated[SloClass, typer.Option(help="SLO class.")] = SloClass.INTERACTIVE,
    steps: Annotated[Optional[int], typer.Option(help="Steps (chunks / denoising steps).")] = None,
    step_ms: Annotated[Optional[float], typer.Option(help="Simulated step time in ms.")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="Prompt (image, video).")] = None,
    inputs: Annotated[Optional[str], typer.Option(help="Input text (text jobs).")] = None,
    param: Annotated[Optional[list[str]], typer.Option("--param", "-p", help="KEY=VALUE.")] = None,
    deadline_s: Annotated[Optional[float], typer.Option(help="Deadline, seconds from now.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait; non-zero exit unless DONE.")] = False,
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Submit a job."""
    _setup(run_dir, config)
    from app.schemas import JobSpec

    params: dict[str, Any] = {}
    if kind == "simulated":
        params.update({k: v for k, v in (("steps", steps), ("step_ms", step_ms)) if v is not None})
    elif kind in ("image", "video"):
        params.update({k: v for k, v in (("prompt", prompt), ("num_inference_steps", steps))
                       if v is not None})
    elif kind == "text" and inputs is not None:
        params["inputs"] = inputs
    params.update(_parse_params(param or []))
    try:
        spec = JobSpec(kind=kind, slo=slo, params=params, deadline_s=deadline_s)  # type: ignore[arg-type]
        job_id, _ = _service().submit(spec)
    except (SteplineError, ValueError) as exc:
        console.print(f"[red]rejected:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(job_id)
    if wait:
        raise typer.Exit(_watch(job_id))


def _parse_params(pairs: list[str]) -> dict[str, Any]:
    import json

    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--param")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def _watch(job_id: str) -> int:
    service = _service()
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task(job_id, total=None)
        while True:
            record = service.store.get(job_id)
            progress.update(bar, total=record.total, completed=record.progress,
                            description=f"{job_id} {record.state.value}")
            if record.state.is_terminal:
                break
            time.sleep(0.1)
    latency = f"{record.latency_s:.2f}s" if record.latency_s is not None else "-"
    console.print(f"{job_id} {record.state.value} in {latency}"
                  + (f" artifact={record.artifact}" if record.artifact else "")
                  + (f" error={record.error}" if record.error else ""))
    return 0 if record.state is JobState.DONE else 1


@cli.command()
def demo(
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes.")] = 2,
    run_dir: RunDir = None,
) -> None:
    """Start the embedded stack, run a mixed workload, and report each job against its SLO."""
    _setup(run_dir or Path(".stepline-demo"), None)
    from app.demo import run_demo

    raise typer.Exit(run_demo(Path(os.environ["STEPLINE_RUN_DIR"]), workers=workers))


@cli.command()
def watch(job_id: str, run_dir: RunDir = None) -> None:
    """Follow a job with a progress bar until it ends."""
    _setup(run_dir, None)
    raise typer.Exit(_watch(job_id))


@cli.command()
def cancel(job_id: str, run_dir: RunDir = None) -> None:
    """Cancel a job (a running one stops at its next chunk boundary)."""
    _setup(run_dir, None)
    try:
        state = _service().store.request_cancel(job_id)
    except SteplineError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    console.print(f"{job_id} {state.value}")


@cli.command()
def jobs(
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 30, run_dir: RunDir = None
) -> None:
    """A table of recent jobs with progress bars."""
    _setup(run_dir, None)
    store = _service().store
    origin = store.origin_id()
    from app.store import record_from_fields

    records = [record_from_fields(f, origin) for f in store.many_fields(store.list_ids(0, limit))]
    table = Table("job", "kind", "class", "state", "progress", "latency", "preempt")
    for r in records:
        filled = int(20 * r.progress / max(r.total, 1))
        bar = "█" * filled + "░" * (20 - filled)
        latency = f"{r.latency_s:.2f}s" if r.latency_s is not None else ""
        table.add_row(r.id + (" ★" if r.origin else ""), r.kind, r.slo.value, r.state.value,
                      f"{bar} {r.progress}/{r.total}", latency, str(r.preemptions))
    console.print(table)


cli.command(name="status")(jobs)


def main() -> None:
    logging.basicConfig(level=os.environ.get("STEPLINE_LOG_LEVEL", "WARNING"))
    try:
        cli()
    except SteplineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
