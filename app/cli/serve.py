"""Commands that run the stack or a part of it: up, worker, demo (registered by ``app.cli``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.common import ConfigFile, RunDir, _setup, console


def up(
    workers: Annotated[str, typer.Option(
        metavar="N|MIN:MAX",
        help="Worker processes: N (a fixed pool) or MIN:MAX (autoscaled from the jobs waiting, "
             "the oldest wait and the scheduler's load; see service.autoscale).")] = "2",
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Start the stack: Redis, workers, beat, scheduler, REST API, Flower (Ctrl-C stops all)."""
    from app.autoscale import WorkerRange  # deferred: the store
    from app.stack import (  # deferred: the API server
        Stack,
        run_until_signalled,
        up_banner,
        wait_for_api,
        wait_for_ready,
    )
    from tasks.runtime import current_settings  # deferred: the settings tree, for commands only

    try:
        pool = WorkerRange.parse(workers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workers") from None
    _setup(run_dir, config)

    settings = current_settings()
    stack = Stack(settings=settings, run_dir=Path(os.environ["STEPLINE_RUN_DIR"]),
                  workers=pool.min_workers, max_workers=pool.max_workers,
                  on_autoscale=lambda line: print(f"  autoscale  {line}", flush=True))
    stack.start()
    if not wait_for_api(stack.api_url):
        console().print(f"[yellow]the API is not answering yet; see {stack.run_dir / 'logs'}")
    elif settings.warm_start:
        _await_warm_workers(stack.api_url, wait_for_ready)
    raise typer.Exit(run_until_signalled(stack, up_banner(stack, pool)))


def _await_warm_workers(api_url: str, wait_for_ready: Any) -> None:
    """Hold the banner until every worker has run its warm-up (GET /readyz)."""
    started_s = time.monotonic()
    with console().status("workers warming up (a tiny job of every recipe; warm_start: false "
                        "skips it)"):
        warm = wait_for_ready(api_url)
    if warm:
        console().print(f"workers warm in {time.monotonic() - started_s:.1f}s")
    else:
        console().print(f"[yellow]workers still warming; {api_url}/readyz says when they are")


def worker(
    name: Annotated[str, typer.Option(help="Celery node name.")] = "worker@%h",
    queues: Annotated[str, typer.Option(help="Queues in strict priority order.")] = (
        "realtime,interactive,batch,standby"
    ),
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Run one worker process in the foreground (one per device)."""
    from app.stack import worker_command  # deferred: the API server

    _setup(run_dir, config)

    command = worker_command(name, queues.split(","))
    os.execv(command[0], command)


def demo(
    workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes.")] = 2,
    workload: Annotated[str, typer.Option(help="A name in configs/workloads.")] = "demo",
    run_dir: RunDir = None,
) -> None:
    """Start the embedded stack, run a mixed workload, and report each job against its SLO."""
    from app.demo import run_demo  # deferred: the stack and the bench

    _setup(run_dir or Path(".stepline-demo"), None)

    raise typer.Exit(run_demo(Path(os.environ["STEPLINE_RUN_DIR"]), workers=workers,
                              workload_name=workload))
