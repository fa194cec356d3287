"""The job commands, through the REST API: submit, watch, cancel, result, status, jobs
(registered by ``app.cli``)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from app.cli.common import ConfigFile, RunDir, _client, _setup, _use_run_dir, console
from scheduler.lifecycle import JobState, SloClass
from tasks.errors import SteplineError


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
                                                  "image, or the first frame of an image-to-video "
                                                  "model's video (kind video, which needs one).",
                                                  exists=True, dir_okay=False)] = None,
    mask: Annotated[Optional[Path], typer.Option(help="Inpainting mask of --image.", exists=True,
                                                 dir_okay=False)] = None,
    control_image: Annotated[Optional[Path], typer.Option(
        help="Control image of a ControlNet job (PNG, JPEG, WebP); name the ControlNet with "
             "-p controlnet=NAME (stepline's /v1/models lists each model's).", exists=True,
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
    for role, path in (("image", image), ("mask", mask), ("control_image", control_image)):
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


def watch(job_id: str, run_dir: RunDir = None) -> None:
    """Follow a job with a progress bar until it ends."""
    _use_run_dir(run_dir)
    raise typer.Exit(_watch(job_id))


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
