"""The one adapter between the pure policy and the world: snapshot Redis, plan, apply.

``run_tick`` reads every live job, the worker heartbeats, the learned cost model and the policy's
memory; calls :func:`scheduler.plan_tick`; checks the plan's invariants; and applies it —
publishing chunks, bumping epochs, setting preempt flags, moving queue consumers for the reserve,
and publishing the origin and the admission status for the submit path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import cast

from app.celery import app
from app.errors import JobNotFound
from app.settings import Settings
from app.store import EXPERT_UPDATES_KEY, PREFIX, TIMINGS_KEY, JobStore
from scheduler import (
    AdmissionState,
    AdmissionStatus,
    ClusterSnapshot,
    CostModel,
    JobKind,
    JobView,
    PolicyConfig,
    PolicyKind,
    PolicyState,
    ResourceProfile,
    TickPlan,
    Tier,
    WorkerView,
    check_plan_invariants,
    plan_tick,
)
from scheduler.errors import SchedulerError
from scheduler.lifecycle import JobState, SloClass
from tasks.affinity import (
    WorkerDirectory,
    common_prefix,
    expand_worker_queues,
    release_queue,
    requeue_parked,
)
from tasks.context import WORKER_KEY, WorkerContext
from tasks.dispatch import release, requeue_from_checkpoint
from tasks.healing import cost_model_estimate, heal
from tasks.routing import STANDBY, class_queue_of

log = logging.getLogger(__name__)

ORIGIN_KEY = PREFIX + "origin"
ADMISSION_KEY = PREFIX + "admission"
STATE_KEY = PREFIX + "policy:state"
COST_KEY = PREFIX + "cost"
SCORES_KEY = PREFIX + "scores"
APPLIED_QUEUES_KEY = PREFIX + "worker:queues"
"""What the adapter last told each worker to consume (so consumers are not churned)."""


def policy_config(settings: Settings, store: JobStore) -> PolicyConfig:
    """The settings' policy, with the run-time policy switch applied."""
    config = settings.scheduler.to_policy()
    active = store.active_policy(settings.scheduler.policy)
    return config if active == config.policy.value else replace(config, policy=PolicyKind(active))


def run_tick(ctx: WorkerContext, now_s: float) -> TickPlan:
    store, settings = ctx.store, ctx.settings
    policy = policy_config(settings, store)
    jobs = store.many_fields(store.active_ids())
    requeue_lost_chunks(store, jobs, now_s)
    if settings.affinity.enabled:
        requeue_parked(store, jobs, now_s, settings.affinity.max_wait)
    cost = learned_cost_model(store, policy)
    heal(store, jobs, now_s, settings, estimate_s=cost_model_estimate(cost))
    jobs = [f for f in jobs if not fail_orphaned_dependent(store, f)]
    snapshot = build_snapshot(store, jobs, cost, now_s)
    plan = plan_tick(snapshot, policy, now_s)
    try:
        check_plan_invariants(plan, snapshot)
    except SchedulerError:
        log.exception("the plan broke an invariant; applying nothing this tick")
        return plan
    apply_plan(store, plan, snapshot, settings)
    advance_expert_updates(store, settings, now_s)
    return plan


def advance_expert_updates(store: JobStore, settings: Settings, now_s: float) -> None:
    """Judge every expert hot update in progress: step its traffic up, promote or roll back."""
    if not store.redis.exists(EXPERT_UPDATES_KEY):
        return
    from app.expert_updates import ExpertUpdates, update_policy  # loads torch: only when needed

    try:
        ExpertUpdates(store.redis, update_policy(settings.moe.versions)).advance_all(now_s)
    except Exception:  # an update's bookkeeping must never stop the scheduler
        log.exception("advancing the expert updates failed; retrying next tick")


# snapshot -------------------------------------------------------------------------------------
def build_snapshot(
    store: JobStore, jobs: list[dict[str, str]], cost: CostModel, now_s: float
) -> ClusterSnapshot:
    views = tuple(view for fields in jobs if (view := job_view(fields)) is not None)
    return ClusterSnapshot(jobs=views, workers=worker_views(store, now_s), cost=cost,
                           state=load_policy_state(store))


def job_view(f: Mapping[str, str]) -> JobView | None:
    """A job's view for the policy (None for a record it cannot read, which is logged). A job
    parked in a worker's affinity queue shows its class queue: the policy plans classes."""
    try:
        units = json.loads(f["cost_units"])
        next_chunk = int(f["next_chunk"])
        return JobView(
            job_id=f["id"], tenant=f["tenant"], tier=Tier(f.get("tier", "standard")),
            slo_class=SloClass(f["slo"]), kind=JobKind(f["kind"]), state=JobState(f["state"]),
            submitted_at_s=float(f["submitted_at"]), deadline_s=float(f["deadline_at"]),
            cost_key=f["cost_key"], num_chunks=int(f["num_chunks"]), next_chunk=next_chunk,
            remaining_cost_units=float(sum(units[next_chunk:])),
            queue=class_queue_of(f.get("queue", "")) or None,
            running_on=f.get("running_on") or None,
            service_s=float(f.get("service_s", 0)),
            waiting_since_s=float(f.get("queued_at") or f.get("preempted_at")
                                  or f["submitted_at"]),
            preemptions=int(f.get("preemptions", 0)),
            resource_profile=ResourceProfile(f.get("resource_profile", "compute")),
            depends_on=tuple(json.loads(f.get("depends_on", "[]"))),
            level=int(f["level"]) if f.get("level") else None,
            level_service_s=float(f.get("level_mark", 0)),
            preempt_requested=f.get("preempt") == "1",
        )
    except (KeyError, ValueError, SchedulerError) as exc:
        log.error("job %s: unreadable record skipped by the scheduler: %s", f.get("id"), exc)
        return None


def worker_views(store: JobStore, now_s: float) -> tuple[WorkerView, ...]:
    """Workers from their heartbeats (a heartbeat key expires when its worker stops renewing)."""
    keys = sorted(store.redis.scan_iter(WORKER_KEY + "*", count=1000))
    bodies = store.redis.mget(keys) if keys else []
    views = []
    for raw in bodies:
        if raw is None:
            continue
        body = json.loads(raw)
        queues = tuple(body.get("queues", ()))
        if "control" in queues:
            continue  # scheduler workers run ticks, not chunks
        views.append(WorkerView(name=body["name"], alive=True, busy_job=body.get("busy_job"),
                                queues=queues, device=body.get("device", "cpu")))
    return tuple(views)


def learned_cost_model(store: JobStore, policy: PolicyConfig) -> CostModel:
    """The stored cost model, updated with every chunk timing recorded since the last tick."""
    raw = store.redis.get(COST_KEY)
    model, last_id = policy.new_cost_model(), "0-0"
    if raw is not None:
        stored = json.loads(raw)
        model = CostModel.from_json(stored["model"]).with_priors(
            policy.cost_priors_s_per_unit, policy.default_s_per_unit, policy.cost_ewma_alpha,
            policy.cost_prior_samples,
        ) if "model" in stored else model
        last_id = stored.get("last_id", "0-0")
    entries = store.read_stream(TIMINGS_KEY, after_id=last_id, count=5000)
    for entry_id, fields in entries:
        model = model.observe(fields["cost_key"], fields["device"], 1.0,
                              float(fields["s_per_unit"]))
        last_id = entry_id
    if entries:
        store.redis.set(COST_KEY, json.dumps({"model": model.to_json(), "last_id": last_id}))
    return model


def load_policy_state(store: JobStore) -> PolicyState:
    raw = store.redis.get(STATE_KEY)
    if raw is None:
        return PolicyState()
    try:
        return PolicyState.from_json(json.loads(raw))
    except (SchedulerError, ValueError):
        log.warning("stored policy state unreadable; starting afresh")
        return PolicyState()


def load_admission(store: JobStore) -> AdmissionStatus | None:
    """The last tick's admission status (None before the first tick)."""
    raw = store.redis.get(ADMISSION_KEY)
    if raw is None:
        return None
    body = json.loads(raw)
    return AdmissionStatus(state=AdmissionState(body["state"]), load=float(body["load"]),
                           retry_after_s=float(body["retry_after_s"]),
                           measured_at_s=float(body["measured_at_s"]))


# apply ----------------------------------------------------------------------------------------
def apply_plan(store: JobStore, plan: TickPlan, snapshot: ClusterSnapshot,
               settings: Settings) -> None:
    states = {job.job_id: job.state for job in snapshot.jobs}
    for job_id, mark in plan.levels.items():
        store.set_fields(job_id, level=str(mark.level), level_mark=repr(mark.service_mark_s))
    for expiry in plan.expire:
        store.try_transition(expiry.job_id, JobState.EXPIRED, by="scheduler",
                             reason=expiry.reason, updates={"error": expiry.reason})
    for job_id in plan.suspend:
        store.try_transition(job_id, JobState.SUSPENDED, by="scheduler",
                             reason="overload convergence: held back")
    for job_id in plan.preempt:
        store.request_preempt(job_id)
    _move_queues(store, plan, states)
    directory = WorkerDirectory.read(store) if plan.releases else None
    for rel in plan.releases:
        if plan.atomic_release:
            store.set_fields(rel.job_id, atomic="1")
        queue = release_queue(settings, store.fields(rel.job_id), rel.queue, directory)
        release(store, rel.job_id, queue=queue, by="scheduler", reason=f"released to {queue}")
    apply_worker_queues(store, expand_worker_queues(settings, plan.worker_queues))
    _publish_decisions(store, plan)


def _move_queues(store: JobStore, plan: TickPlan, states: Mapping[str, JobState]) -> None:
    for req in plan.requeues:
        release(store, req.job_id, queue=req.to_queue, by="scheduler", bump_epoch=True,
                reason=f"requeued {req.from_queue} -> {req.to_queue}")
    for ret in plan.retargets:
        store.set_fields(ret.job_id, queue=ret.to_queue)
    for job_id in plan.standby:
        if states.get(job_id) is JobState.QUEUED:
            release(store, job_id, queue=STANDBY, by="scheduler", bump_epoch=True,
                    reason="overload convergence: moved to standby")
        else:
            store.set_fields(job_id, queue=STANDBY)


def _publish_decisions(store: JobStore, plan: TickPlan) -> None:
    a = plan.admission
    pipe = store.redis.pipeline(transaction=False)
    if plan.origin_id is None:
        pipe.delete(ORIGIN_KEY)
    else:
        pipe.set(ORIGIN_KEY, plan.origin_id)
    pipe.set(ADMISSION_KEY, json.dumps({
        "state": a.state.value, "load": a.load, "retry_after_s": a.retry_after_s,
        "measured_at_s": a.measured_at_s, "policy": plan.policy.value,
        "reserved_workers": sorted(plan.reserved_workers),
    }))
    pipe.set(STATE_KEY, json.dumps(plan.state.to_json()))
    pipe.set(SCORES_KEY, json.dumps([[job_id, score] for job_id, score in plan.top_scores]))
    pipe.execute()


def apply_worker_queues(store: JobStore, wanted: Mapping[str, tuple[str, ...]]) -> None:
    """Reserve or restore workers with Celery's remote control, only where something changed
    (``wanted`` already holds each worker's affinity queues in place).

    ``add_consumer`` appends, so restoring strict order means re-adding the dropped queues in
    priority order; a worker's own heartbeat reports what it consumes now.
    """
    raw = cast(dict[bytes, bytes], store.redis.hgetall(APPLIED_QUEUES_KEY))
    applied = {k.decode(): tuple(json.loads(v)) for k, v in raw.items()}
    for worker, queues in wanted.items():
        current = applied.get(worker)
        if current == tuple(queues):
            continue
        if current is None:
            current = _heartbeat_queues(store, worker)
        _reconsume(worker, current, tuple(queues))
        store.redis.hset(APPLIED_QUEUES_KEY, worker, json.dumps(list(queues)))


def _heartbeat_queues(store: JobStore, worker: str) -> tuple[str, ...]:
    raw = store.redis.get(WORKER_KEY + worker)
    return tuple(json.loads(raw).get("queues", ())) if raw else ()


def _reconsume(worker: str, current: Iterable[str], wanted: tuple[str, ...]) -> None:
    current = tuple(current)
    keep = common_prefix(current, wanted)
    for queue in current[len(keep):]:
        app.control.cancel_consumer(queue, destination=[worker], reply=False)
    for queue in wanted[len(keep):]:
        app.control.add_consumer(queue, destination=[worker], reply=False)
    log.info("worker %s: queues %s -> %s", worker, ",".join(current), ",".join(wanted))


def fail_orphaned_dependent(store: JobStore, fields: dict[str, str]) -> bool:
    """A waiting job whose dependency failed, was cancelled or expired can never run: fail it
    with that reason (the policy treats a dependency absent from the snapshot as finished)."""
    deps = json.loads(fields.get("depends_on", "[]"))
    if not deps or fields["state"] != JobState.PENDING.value:
        return False
    for dep in deps:
        try:
            state = store.state(dep)
        except JobNotFound:
            state = JobState.FAILED
        if state.is_terminal and state is not JobState.DONE:
            reason = f"dependency {dep} ended {state.value}"
            return store.try_transition(fields["id"], JobState.FAILED, by="scheduler",
                                        reason=reason, updates={"error": reason})
    return False


# healing --------------------------------------------------------------------------------------
def requeue_lost_chunks(store: JobStore, jobs: list[dict[str, str]], now_s: float) -> list[str]:
    """A RUNNING job whose chunk lease lapsed lost its worker: requeue it from its checkpoint
    under a new epoch (the dead worker's message, if redelivered, is then stale)."""
    healed = []
    for fields in jobs:
        lease_until = float(fields.get("lease_until") or "inf")
        if fields["state"] != JobState.RUNNING.value or lease_until >= now_s:
            continue
        queue = requeue_from_checkpoint(
            store, fields, by="watchdog",
            reason=f"lease of {fields.get('running_on')} lapsed; requeued from checkpoint",
        )
        if queue is not None:
            log.warning("job %s: worker %s lost; requeued chunk %s", fields["id"],
                        fields.get("running_on"), fields["next_chunk"])
            fields.update(state=JobState.QUEUED.value, epoch=str(int(fields["epoch"]) + 1),
                          running_on="", queue=queue)
            healed.append(fields["id"])
    return healed

