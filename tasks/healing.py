"""Self-healing the lease watchdog cannot do: a chunk whose worker still heartbeats but which is
stuck, and a QUEUED job whose chunk message was never published. Both are requeued from the
job's checkpoint under a new epoch, so whatever the old attempt does later is fenced.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable, Mapping

from app.settings import Settings
from app.store import JobStore
from scheduler.cost import CostModel
from scheduler.lifecycle import JobState
from tasks.dispatch import requeue_from_checkpoint

log = logging.getLogger(__name__)

StepEstimate = Callable[[Mapping[str, str], int], "float | None"]
"""Expected seconds of chunk ``index`` of a job (its hash fields), or None when unknown —
e.g. the scheduler's cost model: ``units[index] * cost.seconds_per_unit(cost_key)``."""

MIN_SAMPLES = 3
"""Commits a job needs before its own median chunk time is trusted as the expected time."""


def heal(
    store: JobStore, jobs: list[dict[str, str]], now_s: float, settings: Settings,
    estimate_s: StepEstimate | None = None,
) -> list[str]:
    """Requeue stuck chunks and unpublished chunks of ``jobs`` (hash fields of active jobs);
    returns the ids of the jobs healed. Call once per tick, after the lease watchdog."""
    healed = []
    for fields in jobs:
        if fields.get("state") == JobState.RUNNING.value:
            reason = stuck_reason(store, fields, now_s, settings, estimate_s)
            if reason is not None and _requeue(store, fields, "RUNNING", reason, stuck=True):
                healed.append(fields["id"])
        elif fields.get("state") == JobState.QUEUED.value and _unpublished(fields, now_s,
                                                                          settings):
            reason = f"chunk {fields['next_chunk']} epoch {fields['epoch']} was never published"
            if _requeue(store, fields, "QUEUED", reason, stuck=False):
                healed.append(fields["id"])
    return healed


def cost_model_estimate(model: CostModel, min_samples: int = MIN_SAMPLES) -> StepEstimate:
    """Expected chunk time from the scheduler's cost model, only where it has measured the
    job's cost key (a prior can be far off, and a wrong estimate would requeue healthy work)."""

    def estimate(fields: Mapping[str, str], index: int) -> float | None:
        learned = model.learned.get(fields.get("cost_key", ""), {})
        units = json.loads(fields.get("cost_units") or "[]")
        if sum(e.samples for e in learned.values()) < min_samples or index >= len(units):
            return None
        return float(units[index]) * model.seconds_per_unit(fields["cost_key"])

    return estimate


def chunk_running_s(fields: Mapping[str, str], now_s: float) -> float | None:
    """How long the running chunk has run: since its claim or the last commit, whichever is
    later (an atomic job commits several chunks under one claim)."""
    starts = [float(fields[k]) for k in ("chunk_started_at", "updated_at") if fields.get(k)]
    return now_s - max(starts) if starts else None


def stuck_reason(
    store: JobStore, fields: Mapping[str, str], now_s: float, settings: Settings,
    estimate_s: StepEstimate | None = None,
) -> str | None:
    """Why the running chunk is stuck, or None. A lapsed lease is the watchdog's case; a chunk
    with no expected time (no estimate, too few commits) is never judged stuck."""
    lease_until = float(fields.get("lease_until") or "inf")
    running_s = chunk_running_s(fields, now_s)
    if lease_until < now_s or running_s is None:
        return None
    broker = settings.broker
    backoff = 2 ** int(fields.get("stuck", "0"))  # each stuck requeue doubles the allowance
    floor_s = broker.stuck_min_s * backoff
    if running_s <= floor_s:
        return None  # cheap exit before any estimate: most chunks end here
    chunk = int(fields["next_chunk"])
    expected_s = estimate_s(fields, chunk) if estimate_s is not None else None
    source = "cost model"
    if expected_s is None:
        expected_s, source = own_median_chunk_s(store, fields, chunk), "own median"
    if expected_s is None:
        return None
    limit_s = max(broker.stuck_factor * expected_s * backoff, floor_s)
    if running_s <= limit_s:
        return None
    return (f"chunk {chunk} on {fields.get('running_on') or '?'} ran {running_s:.1f}s with a live "
            f"heartbeat, over {limit_s:.1f}s ({broker.stuck_factor:g} x {expected_s:.3f}s "
            f"expected, {source}); requeued from checkpoint")


def own_median_chunk_s(store: JobStore, fields: Mapping[str, str], chunk: int) -> float | None:
    """Chunk ``chunk``'s expected time from the job's own commits: their median seconds per
    cost unit times the chunk's units (None with fewer than :data:`MIN_SAMPLES` commits)."""
    units = json.loads(fields.get("cost_units") or "[]")
    rates = []
    for event in store.events(fields["id"]):
        index = int(event.get("chunk", -1))
        if event.get("kind") == "commit" and 0 <= index < len(units) and units[index] > 0:
            rates.append(float(event["service_s"]) / units[index])
    if len(rates) < MIN_SAMPLES or chunk >= len(units):
        return None
    return float(statistics.median(rates)) * max(float(units[chunk]), 1e-9)


def _unpublished(fields: Mapping[str, str], now_s: float, settings: Settings) -> bool:
    """QUEUED means a message is on a queue; if the last one published names another chunk or
    epoch, the publisher died (or Redis went away) between the transition and the publish."""
    queued_at = float(fields.get("queued_at") or fields.get("updated_at") or now_s)
    if now_s - queued_at < settings.broker.chunk_lease:
        return False
    parts = fields.get("last_task_id", "").split(".")
    published = parts[1:3] if len(parts) >= 3 else []
    return published != [fields["next_chunk"], fields["epoch"]]


def _requeue(
    store: JobStore, fields: Mapping[str, str], state: str, reason: str, *, stuck: bool
) -> bool:
    """Requeue the job's next chunk under a new epoch, only if nothing moved since ``fields``."""
    # the same attempt, not a newer one
    expect = {"state": state, **{name: fields[name] for name in ("last_task_id",
                                                                  "chunk_started_at")
                                 if name in fields}}
    updates = {"stuck": str(int(fields.get("stuck", "0")) + 1)} if stuck else {}
    if requeue_from_checkpoint(store, fields, by="healer", reason=reason, expect=expect,
                               updates=updates) is None:
        return False
    log.warning("job %s: %s", fields["id"], reason)
    return True
