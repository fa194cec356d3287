"""Reading the world for the tick: live job records, worker heartbeats, the learned cost model
(new chunk timings folded in and written back) and the policy's memory, turned into the pure
policy's ``ClusterSnapshot``: facts only, every ``JobView`` field the planner reads written here.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler import (
    ClusterSnapshot,
    CostModel,
    JobKind,
    JobView,
    PolicyConfig,
    PolicyState,
    WorkerView,
)
from scheduler.errors import SchedulerError
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.errors import JobNotFound
from tasks.record import JobRecord, UnreadableRecord
from tasks.routing import CONTROL, affinity_worker, class_queue_of
from tasks.settings.diffusion import DiffusionSettings
from tasks.store import JobStore

log = logging.getLogger(__name__)

OWN_MEDIAN_MIN_COMMITS = 3
"""Commits a job needs before its own median chunk time is trusted as the expected time."""

DIFFUSION_BLOCK_GROUPS: int = DiffusionSettings.model_fields["block_groups"].default
"""The settings' default ``diffusion.block_groups``, for callers that plan without settings."""


@dataclass(frozen=True, slots=True)
class Seen:
    """One tick's snapshot, and the records it was read from: every action the tick applies is
    conditioned on the record it saw (state, epoch, sequence number)."""

    snapshot: ClusterSnapshot
    records: Mapping[str, JobRecord]


def read_snapshot(store: JobStore, cost: CostModel, policy: PolicyConfig, now_s: float,
                  diffusion_block_groups: int = DIFFUSION_BLOCK_GROUPS) -> Seen:
    """Everything ``plan_tick`` reads: the live records, heartbeats and policy state in a
    handful of round trips, plus one per dependency of a waiting job and one event-stream read
    per long-running job. ``diffusion_block_groups``: the workers' ``diffusion.block_groups``."""
    records: dict[str, JobRecord] = {}
    unreadable: list[tuple[str, str]] = []
    for item in store.records(store.active_ids()):
        if isinstance(item, UnreadableRecord):
            log.error("job %s: %s", item.job_id, item)
            unreadable.append((item.job_id, item.problem))
        else:
            records[item.job_id] = item
    failed_deps = failed_dependencies(store, records.values())
    long_running = _long_running(records.values(), policy.recovery.stuck_min_s, now_s)
    own = {job_id: own_s_per_unit(store, records[job_id]) for job_id in long_running}
    views = tuple(job_view(r, failed_deps.get(r.job_id), own.get(r.job_id),
                           diffusion_block_groups) for r in records.values())
    snapshot = ClusterSnapshot(jobs=views, workers=worker_views(store), cost=cost,
                               state=load_policy_state(store), unreadable=tuple(unreadable))
    return Seen(snapshot, records)


def job_view(r: JobRecord, failed_dependency: str | None = None,
             own_s_per_unit: float | None = None,
             diffusion_block_groups: int = DIFFUSION_BLOCK_GROUPS) -> JobView:
    """A job's view for the policy. A job parked in a worker's affinity queue shows its class
    queue (the policy plans classes) and names the worker in ``parked_on``."""
    published = _published(r)
    return JobView(
        job_id=r.job_id, tenant=r.tenant, tier=r.tier, slo_class=r.slo, kind=r.kind,
        state=r.state, submitted_at_s=r.submitted_at_s, deadline_s=r.deadline_at_s,
        cost_key=r.cost_key, num_chunks=r.num_chunks, next_chunk=r.next_chunk,
        remaining_cost_units=r.remaining_cost_units,
        remaining_units_by_key=r.remaining_units_by_key,
        block_groups=block_groups(r, diffusion_block_groups),
        queue=class_queue_of(r.queue) or None, running_on=r.running_on,
        service_s=r.service_s,
        waiting_since_s=r.queued_at_s or r.preempted_at_s or r.submitted_at_s,
        preemptions=r.preemptions, resource_profile=r.resource_profile,
        depends_on=r.depends_on, level=r.level, level_service_s=r.level_mark_s,
        preempt_requested=r.preempt, epoch=r.epoch, lease_until_s=r.lease_until_s,
        chunk_running_since_s=r.chunk_running_since_s,
        stuck_requeues=r.stuck,
        next_chunk_cost_units=(r.cost_units[r.next_chunk] if r.next_chunk < r.num_chunks
                               else 0.0),
        own_s_per_unit=own_s_per_unit, parked_on=affinity_worker(r.queue),
        published=published, failed_dependency=failed_dependency,
        shed_if_late=r.shed_if_late, estimated=r.first_estimate_s is not None,
        batch_group=r.batch_group, batch_id=r.batch, batch_growth=r.batch_growth,
    )


def block_groups(r: JobRecord, diffusion_block_groups: int) -> int:
    """Block groups of the job's next chunk, where a preempted chunk stops (its worker is free
    within one group's time), as the runners ask ``should_yield``: a simulated step sleeps in
    its ``block_groups`` slices; a denoise step runs its transformer in the workers'
    ``diffusion.block_groups`` groups; a text decode chunk asks before each of its
    ``chunk_tokens`` tokens; any other chunk (encode, prefill, VAE decode) runs whole."""
    if r.kind is JobKind.SIMULATED:
        return int(r.params.get("block_groups", 1))
    name = r.chunk_name
    if r.kind is JobKind.TEXT:
        return int(r.params.get("chunk_tokens", 1)) if name.startswith("decode") else 1
    return diffusion_block_groups if name.startswith("denoise") else 1


def _published(r: JobRecord) -> tuple[int, int]:
    """(chunk, epoch) of the last published message, from its task id ``job.chunk.epoch.x``;
    (-1, -1) when nothing (readable) was published."""
    parts = (r.last_task_id or "").split(".")
    try:
        return (int(parts[1]), int(parts[2])) if len(parts) >= 3 else (-1, -1)
    except ValueError:
        return (-1, -1)


def failed_dependencies(store: JobStore, records: Iterable[JobRecord]) -> dict[str, str]:
    """Why each waiting job with dependencies can never run, for those that cannot: one of its
    dependencies failed, was cancelled, expired, or does not exist."""
    waiting = [r for r in records if r.depends_on and r.state is JobState.PENDING]
    reasons: dict[str, str] = {}
    for r in waiting:
        for dep in r.depends_on:
            try:
                state = store.state(dep)
            except JobNotFound:
                state = JobState.FAILED
            if state.is_terminal and state is not JobState.DONE:
                reasons[r.job_id] = f"dependency {dep} ended {state.value}"
                break
    return reasons


def _long_running(records: Iterable[JobRecord], floor_s: float, now_s: float) -> list[str]:
    """RUNNING jobs whose chunk has run past the stuck floor: only those may need their own
    median chunk time (most chunks end long before)."""
    return [r.job_id for r in records
            if (since_s := r.chunk_running_since_s) is not None and now_s - since_s > floor_s]


def own_s_per_unit(store: JobStore, r: JobRecord) -> float | None:
    """The job's own median seconds per cost unit over its commits (None with fewer than
    :data:`OWN_MEDIAN_MIN_COMMITS`)."""
    rates = []
    for event in store.events(r.job_id):
        index = int(event.get("chunk", -1))
        if (event.get("kind") == "commit" and 0 <= index < r.num_chunks
                and r.cost_units[index] > 0):
            rates.append(float(event["service_s"]) / r.cost_units[index])
    return float(statistics.median(rates)) if len(rates) >= OWN_MEDIAN_MIN_COMMITS else None


def worker_views(store: JobStore) -> tuple[WorkerView, ...]:
    """Chunk workers from their heartbeats (scheduler workers, on ``control``, run ticks)."""
    views = []
    for beat in store.heartbeats().values():
        if CONTROL in beat.queues:
            continue
        views.append(WorkerView(name=beat.name, alive=True, busy_job=beat.busy_job,
                                queues=beat.queues, device=beat.device))
    return tuple(views)


def learned_cost_model(store: JobStore, policy: PolicyConfig) -> CostModel:
    """The stored cost model, updated with every chunk timing recorded since the last tick."""
    raw = store.redis.get(keys.COST)
    model, last_id = policy.new_cost_model(), "0-0"
    if raw is not None:
        stored = json.loads(raw)
        model = CostModel.from_json(stored["model"]).with_priors(
            policy.cost_priors_s_per_unit, policy.default_s_per_unit, policy.cost_ewma_alpha,
            policy.cost_prior_samples,
        ) if "model" in stored else model
        last_id = stored.get("last_id", "0-0")
    entries = store.read_stream(keys.TIMINGS, after_id=last_id, count=5000)
    for entry_id, fields in entries:
        model = model.observe(fields["cost_key"], fields["device"], 1.0,
                              float(fields["s_per_unit"]))
        last_id = entry_id
    if entries:
        store.redis.set(keys.COST, json.dumps({"model": model.to_json(), "last_id": last_id}))
    return model


def load_policy_state(store: JobStore) -> PolicyState:
    raw = store.redis.get(keys.POLICY_STATE)
    if raw is None:
        return PolicyState()
    try:
        return PolicyState.from_json(json.loads(raw))
    except (SchedulerError, ValueError):
        log.warning("stored policy state unreadable; starting afresh")
        return PolicyState()
