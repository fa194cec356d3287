"""``stepline experts``: hot expert updates, routing traces and cache replay."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from app.cli.common import ConfigFile, RunDir, _setup, console

if TYPE_CHECKING:
    from pydantic import ValidationError

experts_cli = typer.Typer(help="MoE experts: hot updates (canary with rollback), routing "
                          "traces and cache replay.",
                          no_args_is_help=True)


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
