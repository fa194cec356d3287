"""The ``stepline`` command.

Every command finds the running stack through ``--run-dir``, else ``STEPLINE_RUN_DIR``, else
``.stepline/`` in the working directory — or ``REDIS_URL`` when set. The job commands (submit,
status, jobs, watch, cancel, result) go through the REST API with the Python client, using the
key in ``STEPLINE_API_KEY`` or ``<run-dir>/api-key``; the API's address is
``STEPLINE_API_URL``, else ``service.api_host``/``service.api_port``.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from scheduler.lifecycle import JobState, SloClass
from tasks.errors import SteplineError

if TYPE_CHECKING:
    from pydantic import ValidationError
    from rich.console import Console

# Each command imports what only it needs (the API, the dashboard, the bench, the stack, torch)
# inside its body, so `stepline submit --help` or `stepline jobs` start in a fraction of a
# second; tests/unit/test_cli_imports.py holds them out of the module's imports.

# Plain (click) help and tracebacks: rich's help renderer and traceback imports alone cost more
# than the 0.4 s a command's start is allowed; the output itself goes through rich (console()).
cli = typer.Typer(
    help="Stepline: SLO-aware serving of diffusion and MoE jobs.", no_args_is_help=True,
    rich_markup_mode=None, pretty_exceptions_enable=False,
)


@functools.cache
def console() -> Console:
    """The output console, made on first use (rich is imported by the commands that print)."""
    from rich.console import Console

    return Console()

RunDir = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory of the stack.")]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="YAML settings file.")]


def _setup(run_dir: Path | None, config: Path | None) -> None:
    """Export the choices so this process and every child agree on them."""
    from tasks.runtime import current_settings  # deferred: the settings tree, for commands only

    _use_run_dir(run_dir)
    if config is not None:
        os.environ["STEPLINE_CONFIG"] = str(config.resolve())

    current_settings.cache_clear()
    current_settings()  # fail early, with the key, value and bound


def _use_run_dir(run_dir: Path | None) -> None:
    """For commands that only talk to the API: the run directory chosen, nothing else read
    (the API's address and key are files the stack left there; no settings tree)."""
    if run_dir is not None:
        os.environ["STEPLINE_RUN_DIR"] = str(run_dir.resolve())
    elif "STEPLINE_RUN_DIR" not in os.environ:
        os.environ["STEPLINE_RUN_DIR"] = str(Path(".stepline").resolve())


def _client() -> Any:
    """A client of the running stack's API (errors say how to start it when it is not up)."""
    from app.client import Client  # deferred: httpx

    return Client(run_dir=Path(os.environ["STEPLINE_RUN_DIR"]))


@cli.command()
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
    from app.stack import worker_command  # deferred: the API server

    _setup(run_dir, config)

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
    adapter: Annotated[Optional[list[str]], typer.Option(
        "--adapter", "-a", help="NAME or NAME:SCALE, a LoRA adapter of the model (image, video; "
        "stepline adapter list); repeat to apply several in order.")] = None,
    deadline_s: Annotated[Optional[float], typer.Option(help="Deadline, seconds from now.")] = None,
    image: Annotated[Optional[Path], typer.Option(help="Input image (PNG, JPEG, WebP): image-to-"
                                                  "image.", exists=True, dir_okay=False)] = None,
    mask: Annotated[Optional[Path], typer.Option(help="Inpainting mask of --image.", exists=True,
                                                 dir_okay=False)] = None,
    shed_if_late: Annotated[bool, typer.Option(
        help="Under overload, end the job once it cannot meet its deadline (default: finish "
             "late, behind work that still can).")] = False,
    exact: Annotated[Optional[bool], typer.Option(
        "--exact/--batchable", help="Never batch the job with others (bit-identical to a lone "
        "run), or let it batch; default: exact for realtime only.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait; non-zero exit unless DONE. A text job's "
                                       "generated text is printed at the end.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Wait, then print only JSON: the "
                                          "result document of a text (or simulated) job, "
                                          "else the job's record.")] = False,
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Submit a job."""
    from app.client import ApiUnreachable  # deferred: httpx
    from app.schemas import JobSpec  # deferred: pydantic models of the API

    _setup(run_dir, config)

    params: dict[str, Any] = {}
    if kind == "simulated":
        params.update({k: v for k, v in (("steps", steps), ("step_ms", step_ms)) if v is not None})
    elif kind in ("image", "video"):
        params.update({k: v for k, v in (("prompt", prompt), ("num_inference_steps", steps))
                       if v is not None})
    elif kind == "text" and inputs is not None:
        params["inputs"] = inputs
    params.update(_parse_params(param or []))
    if adapter:
        params["adapters"] = _parse_adapters(adapter)
    for role, path in (("image", image), ("mask", mask)):
        if path is not None:  # base64 in the JSON; the API stores it by digest
            params[role] = base64.b64encode(path.read_bytes()).decode("ascii")

    try:
        spec = JobSpec(kind=kind, slo=slo, params=params, deadline_s=deadline_s,  # type: ignore[arg-type]
                       shed_if_late=shed_if_late, exact=exact)
        job_id = _client().submit(spec).id
    except ApiUnreachable:
        raise
    except (SteplineError, ValueError) as exc:
        console().print(f"[red]rejected:[/red] {exc}")
        raise typer.Exit(2) from exc
    if as_json:
        raise typer.Exit(_print_json_result(job_id))
    console().print(job_id)
    if wait:
        code = _watch(job_id)
        if code == 0 and kind == "text":
            typer.echo(_generated_text(_client().result(job_id)))
        raise typer.Exit(code)


def _print_json_result(job_id: str) -> int:
    """Wait for the job, then print its JSON result document (or, for a job whose result is
    not JSON or that did not finish, its record); 0 only when it is DONE."""
    import json

    client = _client()
    view = client.wait(job_id)
    done = view.state is JobState.DONE
    document = view.model_dump(mode="json")
    if done and view.media_type == "application/json":
        document = json.loads(client.result(job_id))
    typer.echo(json.dumps(document, indent=2))
    return 0 if done else 1


def _generated_text(result: bytes) -> str:
    """The text a text job generated, from its JSON result document."""
    import json

    return str(json.loads(result).get("output", ""))


def _parse_adapters(choices: list[str]) -> list[dict[str, Any]]:
    """``NAME`` or ``NAME:SCALE`` options as a job's adapters (scale 1 unless given)."""
    adapters = []
    for choice in choices:
        name, _, scale = choice.rpartition(":") if ":" in choice else (choice, "", "1")
        try:
            adapters.append({"name": name, "scale": float(scale)})
        except ValueError:
            raise typer.BadParameter(f"{choice!r}: the scale after ':' must be a number, e.g. "
                                     f"{name}:0.8", param_hint="--adapter") from None
    return adapters


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
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    client = _client()
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console(), transient=True) as progress:
        bar = progress.add_task(job_id, total=None)
        while True:
            job = client.get(job_id)
            progress.update(bar, total=job.total, completed=job.progress,
                            description=f"{job_id} {job.slo.value} {job.state.value}"
                            + (" ★" if job.origin else ""))
            if job.state.is_terminal:
                break
            time.sleep(0.1)
    latency = f"{job.latency_s:.2f}s" if job.latency_s is not None else "-"
    console().print(f"{job_id} {job.state.value} in {latency}"
                  + (f" artifact={job.artifact}" if job.artifact else "")
                  + (f" error={job.error}" if job.error else ""))
    return 0 if job.state is JobState.DONE else 1


@cli.command()
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


@cli.command()
def bench(
    policy: Annotated[str, typer.Option(help="Comma-separated: fifo, priority, stepline.")] = (
        "fifo,priority,stepline"
    ),
    workload: Annotated[str, typer.Option(help="A name in configs/workloads or a file.")] = "mixed",
    load: Annotated[Optional[float], typer.Option(min=0.05, max=2.0, help="Target load ρ.")] = None,
    workers: Annotated[int, typer.Option(min=1, max=64)] = 2,
    duration_s: Annotated[Optional[float], typer.Option(min=1, help="Trace length.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Replay this JSONL trace.")] = None,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    gentd26: Annotated[Optional[Path], typer.Option(
        help="Trace mode: a directory with the GenTD26 request and latency files; its windows "
             "run in the simulator and on the live stack; writes gentd26.json.")] = None,
    windows: Annotated[int, typer.Option(min=1, max=50, help="Trace mode: windows per pool.")] = 4,
    window_jobs: Annotated[int, typer.Option(min=20, max=20000,
                                             help="Trace mode: requests per window.")] = 240,
    sim_workers: Annotated[str, typer.Option(
        help="Trace mode: comma-separated simulated pool sizes.")] = "2,3,4,8,32",
    jobs_per_worker: Annotated[int, typer.Option(
        min=1, help="Trace mode: a larger pool's windows hold at least this many per worker.")
    ] = 30,
    scale_scheduler: Annotated[bool, typer.Option(
        help="Trace mode: the scheduler's quanta and aging bound scaled to the window's median "
             "job (else the defaults, set for second-long jobs).")] = True,
    live: Annotated[bool, typer.Option(help="Trace mode: also run the live stack.")] = True,
    live_windows: Annotated[int, typer.Option(min=1, max=20)] = 1,
    held_out: Annotated[bool, typer.Option(
        help="Trace mode: evaluate on the held-out requests (from 2024-12-01).")] = False,
    overload: Annotated[bool, typer.Option(
        help="Overload mode (simulated, 8 workers, 600 jobs a trace): sweep effective loads "
             "0.8, 1.0, 1.3 with model loads counted against compute-only admission; writes "
             "overload.json.")] = False,
    seeds: Annotated[int, typer.Option(min=1, max=50, help="Overload mode: traces per point.")
    ] = 3,
    fairness: Annotated[bool, typer.Option(
        help="Fairness mode (simulated): --tenants of one tier, one flooding at 10x; writes "
             "fairness.json.")] = False,
    tenants: Annotated[int, typer.Option(min=2, max=8, help="Fairness mode: tenants.")] = 4,
    degradation: Annotated[bool, typer.Option(
        help="Degradation mode (simulated, 8 workers, 600 jobs a trace): sweep effective loads "
             "0.8-1.6 with and without quality floors; writes degradation.json.")] = False,
    run_dir: RunDir = None,
) -> None:
    """Replay one trace under each policy on the same real workers; write report.json + plots.
    With --gentd26: the production-trace benchmark (simulated and live), gentd26.json. With
    --overload: the effective-load sweep in the simulator, overload.json; --degradation: the
    same with and without degradation, degradation.json."""
    if overload or degradation:
        _overload_bench(out, seeds=seeds, degradation=degradation)
        return
    if fairness:
        from app.bench.fairness_cli import fairness_bench  # deferred: the bench

        fairness_bench(out, tenants=tenants, seeds=seeds, print_=console().print)
        return
    from app.bench.run import check_policies as check_bench_policies  # deferred: heavy
    from app.bench.run import run_bench, summary_table  # deferred: heavy

    _setup(run_dir or Path(".stepline-bench"), None)
    if gentd26 is not None:
        _trace_bench(gentd26, out, windows=windows, jobs=window_jobs, sim_workers=sim_workers,
                     jobs_per_worker=jobs_per_worker, scale_scheduler=scale_scheduler,
                     load=0.8 if load is None else load, live=live, live_workers=workers,
                     live_windows=live_windows, held_out=held_out)
        return

    policies = [p.strip() for p in policy.split(",") if p.strip()]
    try:
        check_bench_policies(policies)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_bench(policies=policies, workload_name=workload, load=load, workers=workers,
                       out_dir=out, duration_s=duration_s, trace_file=trace,
                       run_dir=Path(os.environ["STEPLINE_RUN_DIR"]))
    console().print(summary_table(report))
    console().print(f"report: {out / 'report.json'}; plots: {', '.join(report['plots'])}")


def _overload_bench(out: Path, *, seeds: int, degradation: bool = False) -> None:
    """``stepline bench --overload`` (app.bench.overload_bench) or ``--degradation``
    (app.bench.degradation_bench), printed and written."""
    import json  # deferred with the bench

    from app.bench.degradation_bench import run_degradation_bench  # deferred: the bench
    from app.bench.overload_bench import run_overload_bench  # deferred: the bench

    run = run_degradation_bench if degradation else run_overload_bench
    report = run(seeds=seeds, progress=console().print)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("degradation.json" if degradation else "overload.json")
    path.write_text(json.dumps(report, indent=1))
    console().print(f"report: {path} ({report['wall_s']:.0f} s)")


def _trace_bench(trace_dir: Path, out: Path, *, windows: int, jobs: int, sim_workers: str,
                 jobs_per_worker: int, scale_scheduler: bool, load: float, live: bool,
                 live_workers: int, live_windows: int, held_out: bool) -> None:
    """``stepline bench --gentd26 DIR``: app.bench.trace_bench, printed and written."""
    import json  # deferred with the bench

    from app.bench.gentd26 import TraceError  # deferred: the bench
    from app.bench.trace_bench import run_trace_bench  # deferred: the bench

    try:
        pools = [int(x) for x in sim_workers.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{sim_workers!r} is not a comma-separated list of pool "
                                 "sizes", param_hint="--sim-workers") from None
    if not pools or min(pools) < 1:
        raise typer.BadParameter("give at least one pool size of 1 or more",
                                 param_hint="--sim-workers")
    try:
        report = run_trace_bench(trace_dir, windows=windows, jobs=jobs, workers=pools,
                                 jobs_per_worker=jobs_per_worker, load=load,
                                 held_out=held_out, scale_scheduler=scale_scheduler, live=live,
                                 live_workers=live_workers, live_windows=live_windows,
                                 run_dir=Path(os.environ["STEPLINE_RUN_DIR"]),
                                 progress=console().print)
    except TraceError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gentd26") from exc
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gentd26.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    console().print(f"report: {path} ({report['wall_s']:.0f} s); figures from {report['citation']}")


@cli.command()
def watch(job_id: str, run_dir: RunDir = None) -> None:
    """Follow a job with a progress bar until it ends."""
    _use_run_dir(run_dir)
    raise typer.Exit(_watch(job_id))


@cli.command()
def cancel(job_id: str, run_dir: RunDir = None) -> None:
    """Cancel a job (a running one stops at its next chunk boundary)."""
    from app.client import JobMissing  # deferred: httpx

    _use_run_dir(run_dir)

    try:
        state = _client().cancel(job_id).state
    except JobMissing as exc:
        console().print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    console().print(f"{job_id} {state.value}")


@cli.command()
def result(
    job_id: str,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write; "
                                                   "default: the artifact's own name (a text "
                                                   "job's text is printed instead).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole JSON result "
                                          "document instead of writing a file.")] = False,
    run_dir: RunDir = None,
) -> None:
    """Download a finished job's artifact (PNG, MP4, JSON ...); print a text job's text."""
    from app.client import JobMissing, NotReady  # deferred: httpx

    _use_run_dir(run_dir)

    client = _client()
    try:
        view = client.get(job_id)
        data = client.result(job_id)
    except (JobMissing, NotReady) as exc:
        console().print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    if as_json or (output is None and view.kind == "text"):
        raise typer.Exit(_print_document(job_id, view.media_type, data, as_json))
    target = output or Path(view.artifact or f"{job_id}.bin")
    target.write_bytes(data)
    console().print(f"{target} ({len(data)} bytes, {view.media_type})")


def _print_document(job_id: str, media_type: str | None, data: bytes, as_json: bool) -> int:
    """Print a JSON result: whole, or only a text job's generated text."""
    import json

    if media_type != "application/json":
        console().print(f"[red]job {job_id}'s result is {media_type}, not JSON; write it to a "
                      "file with -o[/red]")
        return 2
    typer.echo(json.dumps(json.loads(data), indent=2) if as_json else _generated_text(data))
    return 0


def _detail(job_id: str) -> None:
    from rich.table import Table

    r = _client().get(job_id)
    table = Table(show_header=False)
    deadline = "met" if r.deadline_met else ("missed" if r.deadline_met is False else "")
    for name, value in (
        ("job", r.id + (" ★ origin" if r.origin else "")), ("kind", r.kind),
        ("class", r.slo.value), ("state", r.state.value),
        ("progress", f"{r.progress}/{r.total}"), ("preemptions", str(r.preemptions)),
        ("queue", r.queue or ""), ("turnaround", f"{r.turnaround_s:.3f}s {deadline}"
                                   if r.turnaround_s is not None else ""),
        ("error", r.error or ""), ("result", r.result_url or ""),
    ):
        table.add_row(name, value)
    console().print(table)


@cli.command(name="status")
def status(
    job_id: Annotated[Optional[str], typer.Argument(help="A job; none: the recent jobs.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 30,
    run_dir: RunDir = None,
) -> None:
    """One job in detail, or a table of recent jobs."""
    if job_id is None:
        jobs(limit=limit, run_dir=run_dir)
        return
    _use_run_dir(run_dir)
    _detail(job_id)


@cli.command()
def jobs(
    limit: Annotated[int, typer.Option(min=1, max=500)] = 30,
    state: Annotated[Optional[JobState], typer.Option(help="Only this state.")] = None,
    slo: Annotated[Optional[SloClass], typer.Option("--class", help="Only this class.")] = None,
    run_dir: RunDir = None,
) -> None:
    """A table of recent jobs with progress bars."""
    from rich.table import Column, Table

    _use_run_dir(run_dir)
    listed = _client().list(state=state, slo=slo, limit=limit).jobs
    table = Table(Column("job", no_wrap=True, min_width=18), "kind", "class", "state", "progress",
                  "latency", "preempt")
    for r in listed:
        filled = int(20 * r.progress / max(r.total, 1))
        bar = "█" * filled + "░" * (20 - filled)
        latency = f"{r.latency_s:.2f}s" if r.latency_s is not None else ""
        table.add_row(r.id + (" ★" if r.origin else ""), r.kind, r.slo.value, r.state.value,
                      f"{bar} {r.progress}/{r.total}", latency, str(r.preemptions))
    console().print(table)


@cli.command()
def simulate(
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts.")] = "16,64,256",
    rate: Annotated[str, typer.Option(help="Comma-separated arrival rates, jobs/s.")] = (
        "10,100,1000"),
    duration_s: Annotated[float, typer.Option(min=1, help="Virtual seconds of arrivals.")] = 60,
    policies: Annotated[str, typer.Option(help="Comma-separated: fifo, priority, edf, srpt, "
                                          "least_slack, stepline, oracle-edf, oracle-srpt.")] = (
        "fifo,priority,stepline,oracle-edf,oracle-srpt"),
    stress: Annotated[bool, typer.Option(help="Inject urgent (< 100 ms SLO) jobs and fail a "
                                         "worker mid-run.")] = False,
    overhead_ms: Annotated[float, typer.Option(min=0, help="Dispatch overhead per hop.")] = 3.0,
    seed: Annotated[int, typer.Option()] = 1,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    suite: Annotated[bool, typer.Option(help="Run the policy evaluation suite instead (its own "
                                        "rows and every policy; uses --overhead-ms, --seed, "
                                        "--out); writes suite.json.")] = False,
) -> None:
    """SIMULATED: the live tick's planner on a virtual clock at scale; writes simulation.json (with
    --suite: every policy on the evaluation suite's rows, with a verdict each; suite.json)."""
    import json

    from app.bench.simulate import check_policies, grid_configs, run_simulation  # deferred: heavy
    from app.bench.simulate import summary_table as simulation_table  # deferred: heavy

    if suite:
        _simulate_suite(overhead_ms / 1e3, seed, out)
        return
    names = [p.strip() for p in policies.split(",") if p.strip()]
    try:
        check_policies(names)
        configs = grid_configs([int(w) for w in workers.split(",")],
                               [float(r) for r in rate.split(",")], duration_s, stress, seed,
                               dispatch_overhead_s=overhead_ms / 1e3)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_simulation(configs, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(report, indent=2))
    for run in report["runs"]:
        console().print(simulation_table(run))
    console().print(f"report: {out / 'simulation.json'} (simulated)")


def _simulate_suite(dispatch_overhead_s: float, seed: int, out: Path) -> None:
    """Every row of the suite, one at a time with progress, then suite.json and one table."""
    import json
    from dataclasses import replace

    from app.bench.suite import SUITE_ROWS, run_row, suite_report, suite_table  # deferred: heavy

    started = time.perf_counter()
    outcomes = []
    for k, row in enumerate(SUITE_ROWS, start=1):
        outcome = run_row(replace(row, seed=seed), dispatch_overhead_s=dispatch_overhead_s)
        outcomes.append(outcome)
        verdict = "pass" if outcome.passed else "FAIL"
        console().print(f"[{k}/{len(SUITE_ROWS)}] {row.name}: {outcome.jobs} jobs, stepline "
                      f"{verdict} ({time.perf_counter() - started:.0f}s)")
    report = suite_report(outcomes, wall_s=time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(report, indent=2))
    console().print(suite_table(outcomes))
    console().print(f"stepline met every goal on {report['rows_passed']} of "
                  f"{report['rows_judged']} rows; report: {out / 'suite.json'} (simulated)")


@cli.command()
def reliability(
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("reliability-out"),
    burst_s: Annotated[float, typer.Option(min=0, max=60, help="API burst length (0: none).")] = (
        10.0
    ),
    cpu_hogs: Annotated[int, typer.Option(min=0, max=64, help="Busy processes competing for "
                                          "the cores for the whole drill.")] = 0,
    hosts: Annotated[int, typer.Option(min=0, max=16, help="Run the drill across this many "
                                       "simulated hosts (network namespaces; needs root) "
                                       "instead: Redis with Sentinel and S3 on a bridge.")] = 0,
    faults: Annotated[Optional[str], typer.Option(help="With --hosts: comma-separated faults "
                                                  "(default: all).")] = None,
) -> None:
    """Start a private stack, inject each fault under a mixed load, try bad inputs; write
    reliability.json and exit non-zero if any accepted job was lost or ran twice."""
    if hosts:
        from app.drills.hosts import (  # deferred: the drill, its namespaces and stack
            FAULTS,
            HostsUnavailable,
            run_hosts_drill,
        )

        chosen = tuple(f for f in (faults or ",".join(FAULTS)).split(",") if f)
        try:
            code = run_hosts_drill(out.resolve(), hosts, chosen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        except HostsUnavailable as exc:
            typer.echo(f"stepline: {exc}", err=True)
            code = 2
        raise typer.Exit(code)
    from app.drills.reliability import run_reliability  # deferred: the stack and the bench

    raise typer.Exit(run_reliability(out.resolve(), burst_s=burst_s, cpu_hogs=cpu_hogs))


experts_cli = typer.Typer(help="MoE experts: hot updates (canary with rollback), routing "
                          "traces and cache replay.",
                          no_args_is_help=True)
cli.add_typer(experts_cli, name="experts")


def _expert_updates() -> Any:
    from tasks.expert_updates import ExpertUpdates, update_policy  # deferred: loads torch
    from tasks.runtime import current_settings, store_client  # deferred: the store

    settings = current_settings()
    return ExpertUpdates(store_client(settings), update_policy(settings.moe.versions))


@experts_cli.command("update")
def experts_update(
    model: Annotated[str, typer.Option(help="Model recipe name (configs/models).")],
    from_file: Annotated[Path, typer.Option("--from", help="Safetensors file of expert tensors "
                                            "(layers.<i>.gate_up_proj / down_proj), readable "
                                            "at this path by every worker.")],
    name: Annotated[Optional[str], typer.Option(help="Version name (default: file stem).")] = None,
    run_dir: RunDir = None,
) -> None:
    """Load a new expert version beside the live one on every worker and shift traffic to it in
    steps (moe.versions), rolling back automatically if latency or errors degrade."""
    _setup(run_dir, None)
    from safetensors import safe_open

    from workers.moe.recipes import MODELS_DIR, load_recipe  # deferred: loads torch

    load_recipe(model, MODELS_DIR)  # an unknown model fails here, naming the known ones
    path = from_file.resolve()
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as exc:
        raise typer.BadParameter(f"{path} is not a readable safetensors file: {exc}") from exc
    if not keys or not all(k.startswith("layers.") for k in keys):
        raise typer.BadParameter(f"{path} holds no layers.<i>.gate_up_proj/down_proj tensors")
    record = _expert_updates().begin(model, name or path.stem, path, time.time())
    state = record.state
    console().print(f"{model}: {state['candidate']} takes {state['share']:.0%} of new jobs "
                  f"(live {state['live']}); follow with `stepline experts status --model {model}`")


@experts_cli.command("status")
def experts_status(
    model: Annotated[str, typer.Option(help="Model recipe name.")], run_dir: RunDir = None
) -> None:
    """Live and candidate versions, traffic share, kept versions and the recent decisions."""
    _setup(run_dir, None)
    record = _expert_updates().record(model)
    if record is None:
        console().print(f"{model}: never updated; live version base")
        return
    s = record.state
    console().print(f"{model}: live {s['live']}, candidate {s.get('candidate') or '-'} at "
                  f"{s.get('share', 0.0):.0%}, kept {', '.join(s.get('kept', []))}")
    for item in record.history[-10:]:
        console().print(f"  {item['decision']:<16} {item.get('version', '')} "
                      f"{item.get('share', 0.0):.0%} {item.get('reason', '')}")


@experts_cli.command("rollback")
def experts_rollback(
    model: Annotated[str, typer.Option(help="Model recipe name.")], run_dir: RunDir = None
) -> None:
    """Stop the update in progress, or else make the previous kept version live again."""
    _setup(run_dir, None)
    record = _expert_updates().roll_back(model, time.time())
    console().print(f"{model}: live {record.state['live']}")


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from None


@experts_cli.command("record")
def experts_record(
    model: Annotated[str, typer.Option(help="MoE model recipe name (configs/models).")],
    inputs: Annotated[Path, typer.Option(help="Prompts: JSON Lines of {\"prompt\", "
                                         "\"max_new_tokens\"} or one prompt per line.")],
    out: Annotated[Path, typer.Option(help="Trace file to write (JSON Lines).")],
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens per prompt "
                                                "when the input line does not say.")] = 64,
    config: ConfigFile = None,
) -> None:
    """Run the prompts through the model (greedy, its own routing) and write the routing trace:
    per request, per step, per MoE layer, the chosen experts and the lookahead's prediction."""
    _setup(None, config)
    from workers.moe.record import read_inputs, record_trace  # deferred: loads torch
    from workers.moe.traces import top_k_overlap, write_trace  # deferred: loads torch

    trace = record_trace(model, read_inputs(inputs, max_new_tokens))
    write_trace(trace, out)
    accuracy = top_k_overlap(trace)
    console().print(f"{out}: {len(trace.requests)} requests, {trace.tokens()} steps, "
                  f"{len(trace.moe_layers())} MoE layers x {trace.experts()} experts; lookahead "
                  f"top-k accuracy {'-' if accuracy is None else format(accuracy, '.3f')}")


@experts_cli.command("synth")
def experts_synth(
    out: Annotated[Path, typer.Option(help="Trace file to write (JSON Lines).")],
    layers: Annotated[int, typer.Option(min=1, max=256)] = 24,
    experts: Annotated[int, typer.Option(min=2, max=4096)] = 128,
    top_k: Annotated[int, typer.Option(min=1, max=64)] = 1,
    requests: Annotated[int, typer.Option(min=1, max=10_000)] = 30,
    decode_tokens: Annotated[int, typer.Option(min=1, max=100_000)] = 128,
    skew: Annotated[str, typer.Option(help="Zipf exponent range per layer, LO,HI.")] = "0.6,1.4",
    locality: Annotated[float, typer.Option(min=0, max=1)] = 0.5,
    layer_correlation: Annotated[float, typer.Option(min=0, max=1)] = 0.5,
    lookahead_accuracy: Annotated[float, typer.Option(
        min=0, max=1, help="Share of routed experts the recorded lookahead names.")] = 0.9,
    seed: int = 0,
) -> None:
    """Write a synthetic routing trace with tunable skew, locality and lookahead accuracy."""
    from workers.moe.traces import synthetic_trace, write_trace  # deferred: loads torch

    try:
        lo, hi = (float(x) for x in skew.split(","))
    except ValueError:
        raise typer.BadParameter(f"--skew takes LO,HI, got {skew!r}") from None
    if not 0 < lo <= hi <= 4:
        raise typer.BadParameter(f"--skew needs 0 < LO <= HI <= 4, got {skew!r}")
    if top_k > experts:
        raise typer.BadParameter(f"--top-k {top_k} exceeds --experts {experts}")
    trace = synthetic_trace(layers=layers, experts=experts, top_k=top_k, requests=requests,
                            decode_tokens=decode_tokens, skew=(lo, hi), locality=locality,
                            layer_correlation=layer_correlation,
                            lookahead_accuracy=lookahead_accuracy, seed=seed)
    write_trace(trace, out)
    console().print(f"{out}: {len(trace.requests)} requests, {trace.tokens()} steps")


@experts_cli.command("replay")
def experts_replay(
    trace_file: Annotated[Path, typer.Argument(metavar="TRACE", help="Routing trace (JSON "
                                               "Lines, one list of steps per request).")],
    slots: Annotated[str, typer.Option(help="Slots per layer to compare.")] = "4,8,16,32",
    policy: Annotated[Optional[str], typer.Option(help="Policies to compare (default all).")]
    = None,
    prefetch: Annotated[Optional[int], typer.Option(help="Experts prefetched per layer "
                                                    "(default moe.cache.prefetch_experts).")]
    = None,
    allocation: Annotated[Optional[str], typer.Option(help="uniform or reuse (default "
                                                      "moe.cache.allocation).")] = None,
    copy_cost: Annotated[float, typer.Option(help="One expert copy, in layers of compute.")]
    = 0.5,
    min_confidence: Annotated[Optional[float], typer.Option(help="Least confidence of a "
                                                            "prefetch.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Also write the figures as JSON.")] = None,
    config: ConfigFile = None,
) -> None:
    """Per slots-per-layer size: each policy's demand hit rate, Belady's optimum, the configured
    cache's ratio to it, and with prefetch the stall-free share, prefetches used / late / wasted
    and bytes moved against demand paging."""
    _setup(None, config)
    import dataclasses
    import json

    from pydantic import ValidationError

    from app.replay_options import ReplayOptions  # deferred: pydantic models
    from tasks.runtime import current_settings  # deferred: the settings tree, for commands only
    from tasks.settings.moe import cache_config  # deferred: with the replay
    from workers.moe.policy import POLICY_NAMES  # deferred: loads torch
    from workers.moe.replay import format_table, replay_table  # deferred: loads torch
    from workers.moe.traces import TraceError, read_trace, top_k_overlap  # deferred: loads torch

    base = cache_config(current_settings().moe, "cpu")
    try:
        options = ReplayOptions.model_validate({
            "slots": _int_list(slots, "--slots"),
            "policies": policy.split(",") if policy else list(POLICY_NAMES),
            "prefetch": base.prefetch_experts if prefetch is None else prefetch,
            "copy_cost": copy_cost,
            "min_confidence": base.prefetch_min_confidence if min_confidence is None
            else min_confidence,
            "allocation": allocation or base.allocation,
        })
    except ValidationError as exc:
        raise typer.BadParameter(_validation_message(exc)) from None
    unknown = [p for p in options.policies if p not in POLICY_NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {', '.join(unknown)}; choose from "
                                 f"{', '.join(POLICY_NAMES)}")
    policies = [p for p in POLICY_NAMES if p in options.policies]
    try:
        trace = read_trace(trace_file)
    except (TraceError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    settings = dataclasses.replace(base, prefetch_experts=options.prefetch,
                                   allocation=options.allocation,
                                   prefetch_min_confidence=options.min_confidence)
    rows = replay_table(trace, options.slots, settings, policies, options.copy_cost)
    accuracy = top_k_overlap(trace)
    console().print(f"{trace_file}: {len(trace.requests)} requests, {trace.tokens()} steps, "
                  f"{len(trace.moe_layers())} MoE layers x {trace.experts()} experts; default "
                  f"{settings.policy} + {settings.allocation} slots; copy cost {copy_cost} "
                  f"layer(s); recorded lookahead accuracy "
                  f"{'-' if accuracy is None else format(accuracy, '.3f')}")
    console().print(format_table(rows, policies), highlight=False, soft_wrap=True)
    if out is not None:
        report = {"trace": str(trace_file), "copy_cost": copy_cost, "policy": settings.policy,
                  "allocation": settings.allocation, "prefetch": settings.prefetch_experts,
                  "lookahead_accuracy": accuracy, "rows": [r.as_dict() for r in rows]}
        out.write_text(json.dumps(report, indent=2))
        console().print(f"wrote {out}")


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


adapter_cli = typer.Typer(help="LoRA adapters of the diffusion models: list, make (random, "
                          "for trying the feature).", no_args_is_help=True)
cli.add_typer(adapter_cli, name="adapter")


def _adapter_folder() -> Path:
    from tasks.runtime import current_settings  # deferred: the settings tree
    from workers.diffusion.adapters import DEFAULT_ADAPTERS_DIR  # deferred: pydantic models

    return current_settings().diffusion.adapters_dir or DEFAULT_ADAPTERS_DIR


@adapter_cli.command("list")
def adapter_list(run_dir: RunDir = None, config: ConfigFile = None) -> None:
    """The adapters in the configured folder (diffusion.adapters_dir), with the model each fits."""
    from rich.table import Table

    from workers.diffusion.adapters import adapter_registry  # deferred: pydantic models

    _setup(run_dir, config)
    folder = _adapter_folder()
    table = Table("name", "model", "rank", "alpha", "target modules", title=str(folder))
    for spec in adapter_registry(folder).all():
        table.add_row(spec.name, spec.base, str(spec.rank), f"{spec.alpha:g}",
                      ", ".join(spec.target_modules))
    console().print(table)


@adapter_cli.command("make")
def adapter_make(
    name: Annotated[str, typer.Argument(help="Adapter name (letters, digits, . _ -).")],
    model: Annotated[str, typer.Option(help="The diffusion model (recipe) it fits.")],
    rank: Annotated[int, typer.Option(min=1, max=256, help="LoRA rank.")] = 4,
    alpha: Annotated[Optional[float], typer.Option(help="LoRA alpha (default: the rank).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of its random weights.")] = 0,
    folder: Annotated[Optional[Path], typer.Option(
        "--dir", help="Where to register it (default: diffusion.adapters_dir).")] = None,
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Make a LoRA adapter of random weights for MODEL with PEFT and register it (its
    safetensors file and NAME.yaml): to try adapters without a trained one. Nothing is
    downloaded; a trained adapter is registered the same way, by its own NAME.yaml."""
    from workers.diffusion.adapters import AdapterSpec  # deferred: pydantic models
    from workers.diffusion.recipes import diffusion_recipe  # deferred: the recipes
    from workers.errors import ModelConfigError  # deferred: with the recipes

    _setup(run_dir, config)
    target = folder or _adapter_folder()
    try:
        AdapterSpec(name=name, base=model, weights="-", rank=rank, alpha=alpha or rank,
                    target_modules=["-"])
        recipe = diffusion_recipe(model)
    except (ModelConfigError, ValueError) as exc:
        console().print(f"[red]rejected:[/red] {exc}")
        raise typer.Exit(2) from exc
    from workers.diffusion.lora import make_random_adapter  # deferred: loads torch and peft

    spec = make_random_adapter(recipe, name, target, rank=rank, alpha=alpha, seed=seed)
    console().print(f"registered adapter {spec.name!r} for model {spec.base!r} in {target}")


def main() -> None:
    # The command line never runs under trio, but httpcore imports it whenever it is installed
    # (a test dependency brings it): a tenth of a second of every API command's start.
    sys.modules.setdefault("trio", None)  # type: ignore[arg-type]
    logging.basicConfig(level=os.environ.get("STEPLINE_LOG_LEVEL", "WARNING"))
    try:
        cli()
    except SteplineError as exc:
        console().print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
