"""The one adapter between the pure policy and the world: snapshot, plan, invariants, apply.

``run_tick`` reads the live records, the worker heartbeats, the learned cost model and the
policy's memory (``tasks.snapshot``); calls :func:`scheduler.plan_tick`; checks the plan's
invariants; and applies it — every job action conditioned on the record the snapshot saw, so a
job that committed, finished or moved since is left alone and planned again next tick.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

from scheduler import (
    AdmissionStatus,
    IncrementalPlanner,
    PolicyConfig,
    PolicyKind,
    TickPlan,
    check_plan_invariants,
    plan_tick,
)
from scheduler.errors import SchedulerError
from scheduler.lifecycle import JobState
from scheduler.model import ClusterSnapshot
from scheduler.placement import ModelNeed, PlacementPolicy
from scheduler.plan import LevelMark, Release
from scheduler.recovery import Failure, Recovery, RecoveryCause, RecoveryConfig
from scheduler.state import AdmissionState
from tasks import keys
from tasks.admission import PublishedAdmission
from tasks.affinity import (
    PlacementView,
    WorkerDirectory,
    common_prefix,
    expand_worker_queues,
    keeps_model,
    kept_queue,
    needs_directory,
    placement_policy,
    placement_rates,
    publish_placement_view,
    queued_demand,
    release_queue,
)
from tasks.apply import apply_plan
from tasks.context import WorkerContext
from tasks.dispatch import (
    direct_publish,
    publish_chunks,
    queue_release,
    release,
    release_batch,
    requeue_from_checkpoint,
)
from tasks.fair_share import read_ledger, save_joined
from tasks.heartbeat import Heartbeat
from tasks.holdings import held_models, push_stage_requests
from tasks.load_estimates import ExpectedLoads, LearnedLoads
from tasks.record import JobRecord, encode
from tasks.routing import STANDBY, affinity_worker, class_queue_of
from tasks.runtime import celery
from tasks.script_batch import ScriptBatch
from tasks.settings import Settings
from tasks.snapshot import SnapshotCache, learned_cost_model, read_snapshot
from tasks.store import JobStore
from tasks.store_calls import Written

log = logging.getLogger(__name__)


def policy_config(settings: Settings, store: JobStore) -> PolicyConfig:
    """The settings' policy, with the run-time policy switch applied and the recovery knobs of
    the broker and affinity settings."""
    return configured_policy(settings, store.active_policy(settings.scheduler.policy))


def configured_policy(settings: Settings, active: str) -> PolicyConfig:
    """:func:`policy_config` with the policy in force, ``active``, read already."""
    config = settings.scheduler.to_policy()
    broker, affinity = settings.broker, settings.affinity
    recovery = RecoveryConfig(
        stuck_min_s=broker.stuck_min_s, stuck_factor=broker.stuck_factor,
        unpublished_after_s=broker.chunk_lease, unclaimed_after_s=broker.chunk_lease,
        affinity_max_wait_s=affinity.max_wait if affinity.enabled else None,
        wait_within_slack=affinity.enabled
        and placement_policy(settings) is PlacementPolicy.STEPLINE,
    )
    return replace(config, policy=PolicyKind(active), recovery=recovery)


@dataclass(slots=True)
class TickPhases:
    """Where one tick's time went, and how much it read: each phase's seconds (None: the tick
    ended before it), the live jobs planned and the records read for them."""

    read_s: float | None = None
    plan_s: float | None = None
    check_s: float | None = None
    apply_s: float | None = None
    jobs: int = 0
    reread: int = 0

    def stream_fields(self) -> dict[str, str]:
        """The tick's stats entry fields: ``read_ms`` ... for the phases it ran, the counts."""
        fields = {f"{name}_ms": f"{seconds * 1000:.3f}" for name, seconds in (
            ("read", self.read_s), ("plan", self.plan_s), ("check", self.check_s),
            ("apply", self.apply_s)) if seconds is not None}
        return {**fields, "jobs": str(self.jobs), "reread": str(self.reread)}


def run_tick(ctx: WorkerContext, now_s: float, cache: SnapshotCache | None = None,
             planner: IncrementalPlanner | None = None,
             phases: TickPhases | None = None,
             loads: ExpectedLoads | None = None,
             holds: Callable[[], bool] | None = None) -> TickPlan:
    """One tick: read (from ``cache`` when given, folding in what changed; else every record),
    plan (with ``planner`` when given: it keeps per-job columns across ticks, found by the
    identity of the cache's unchanged views; its plans equal ``plan_tick``'s), check, apply in
    pipelined batches. ``phases``, when given, gets each phase's seconds and what it read;
    ``loads`` keeps the waiting model jobs' expected loads between ticks (:class:`ExpectedLoads`,
    under the Stepline placement). ``holds``, when given, says after planning whether this
    process still holds the tick lease: a scheduler that hung (SIGSTOP) between its read and
    its apply, while another took the tick over, applies nothing of its stale plan."""
    store, settings = ctx.store, ctx.settings
    took = phases if phases is not None else TickPhases()
    started = time.perf_counter()
    policy = policy_config(settings, store)
    cost = learned_cost_model(store, policy)
    block_groups = settings.diffusion.block_groups
    read_at_s = time.time()  # placements after this are not in the snapshot's free times
    expected = loads if loads is not None else ExpectedLoads()
    learned = expected.learned
    seen = (cache.read(cost, policy, now_s, block_groups, learned) if cache is not None
            else read_snapshot(store, cost, policy, now_s, block_groups, learned))
    snapshot = expected.apply(settings, seen.snapshot, seen.records, seen.heartbeats)
    if policy.fair_share.enabled:  # the counters as stored; the plan carries the join
        snapshot = replace(snapshot, service=read_ledger(store.redis))
    read = time.perf_counter()
    took.read_s, took.jobs = read - started, len(snapshot.jobs)
    took.reread = cache.changed if cache is not None else took.jobs
    plan = (planner.plan(snapshot, policy, now_s) if planner is not None
            else plan_tick(snapshot, policy, now_s))
    planned = time.perf_counter()
    took.plan_s = planned - read
    try:
        check_plan_invariants(plan, snapshot)
    except SchedulerError:
        log.exception("the plan broke an invariant; applying nothing this tick")
        return plan
    checked = time.perf_counter()
    took.check_s = checked - planned
    if holds is not None and not holds():
        log.warning("the tick lease changed hands while this tick planned (a hung scheduler "
                    "woke): applying nothing of its plan")
        return plan
    free_in_s = functools.cache(
        lambda: busy_free_in_s(snapshot, now_s, seen.heartbeats, learned))
    target = LiveTarget(store, seen.records, settings, buffered=True, busy_free_in_s=free_in_s,
                        counted_until_s=read_at_s, rate=snapshot.cost.seconds_per_unit,
                        converging=plan.admission.state is AdmissionState.CONVERGING,
                        built=expected.built, learned=learned)
    if plan.fair_share is not None:
        save_joined(store.redis, plan.fair_share)
    try:
        apply_plan(plan, target)
        target.flush()
    finally:
        if cache is not None:  # its own writes, folded: next tick reads none of them again
            cache.fold_written(target.written)
    if settings.affinity.enabled and placement_policy(settings) is PlacementPolicy.STEPLINE:
        # what a submit before the next tick places by (a few ticks' life: then heartbeats)
        publish_placement_view(store, PlacementView(
            read_at_s, free_in_s(), target.demand(),
            placement_rates(seen.records.values(), snapshot.cost.seconds_per_unit),
            expected.built),
            ttl_s=max(5 * settings.scheduler.origin_detection_interval, 1.0))
        target.stage_models(settings.residency.stage_min_queued, seen.heartbeats.values())
    advance_expert_updates(store, settings, now_s)
    took.apply_s = time.perf_counter() - checked
    return plan


def busy_free_in_s(snapshot: ClusterSnapshot, now_s: float,
                   beats: Mapping[str, Heartbeat] | None = None,
                   learned: LearnedLoads | None = None) -> dict[str, float]:
    """Per worker with work of its own, the seconds until it is expected free: the remaining
    work (the cost model's estimate) of the job it runs, less what its running chunk has run,
    plus that of every job parked on its own queues (their next chunks stay on it too). A
    worker whose heartbeat (in ``beats``) says its chunk waits for a load adds the rest of the
    load, and counts the chunk's work as run only from the load's end (a load the worker
    could not size, by the load times ``learned`` from every worker:
    :meth:`~tasks.load_estimates.LearnedLoads.window_estimate`; None: by the priors)."""
    free: dict[str, float] = {}
    beats = beats or {}
    estimate = functools.cache((LearnedLoads() if learned is None else learned).window_estimate)
    for job in snapshot.jobs:
        rate = snapshot.cost.seconds_per_unit(job.cost_key)
        if job.state is JobState.RUNNING and job.running_on is not None:
            since = job.chunk_running_since_s
            load_s, began = 0.0, since
            beat = beats.get(job.running_on)
            if beat is not None and since is not None and beat.busy_job == job.job_id:
                load_s, began = beat.load_phase(since, now_s, estimate) or (load_s, began)
            ran = 0.0 if began is None else max(now_s - began, 0.0)
            left = load_s + max(0.0, job.remaining_cost_units * rate - ran)
            free[job.running_on] = free.get(job.running_on, 0.0) + left
        elif job.state is JobState.QUEUED and job.parked_on is not None:
            free[job.parked_on] = free.get(job.parked_on, 0.0) + job.remaining_cost_units * rate
    return free


def advance_expert_updates(store: JobStore, settings: Settings, now_s: float) -> None:
    """Judge every expert hot update in progress: step its traffic up, promote or roll back."""
    if not store.redis.exists(keys.EXPERT_UPDATES):
        return
    from tasks.expert_updates import ExpertUpdates, update_policy  # loads torch: only if needed

    try:
        ExpertUpdates(store.redis, update_policy(settings.moe.versions)).advance_all(now_s)
    except Exception:  # an update's bookkeeping must never stop the scheduler
        log.exception("advancing the expert updates failed; retrying next tick")


def load_admission(store: JobStore) -> AdmissionStatus | None:
    """The last tick's admission status (None before the first tick); raises
    :class:`AdmissionStatusError` for one that cannot be read."""
    raw = store.redis.get(keys.ADMISSION)
    return None if raw is None else PublishedAdmission.decode(raw).status


# apply ----------------------------------------------------------------------------------------
APPLY_BATCH = 500
"""Job actions a buffered :class:`LiveTarget` sends in one round trip."""


class LiveTarget:
    """Where a plan takes effect on a running stack: the store (Lua, every job action fenced on
    the record the snapshot saw) and Celery (publishes, remote control).

    ``buffered`` (the tick's): the job actions whose outcome the plan's loop does not read —
    levels, expiries, suspensions, preempt flags, requeues, retargets, standbys, releases,
    estimates — are queued and sent in pipelined batches of ``APPLY_BATCH``, each still the
    fenced script it would be alone, in the plan's order; what follows a move (the next chunk's
    publish, the old message's revoke, a log line) follows from the batch's replies. Those
    methods then return True for "sent": whether each job moved is in :attr:`moved`. Any other
    call (a failure, a recovery, a batch release, the worker queues, the decisions) sends the
    queue first, so the order holds. Unbuffered, every action is its own round trip."""

    def __init__(self, store: JobStore, seen: Mapping[str, JobRecord],
                 settings: Settings, *, buffered: bool = False,
                 busy_free_in_s: Callable[[], Mapping[str, float]] | None = None,
                 counted_until_s: float | None = None,
                 rate: Callable[[str], float] | None = None,
                 converging: bool = False,
                 built: Sequence[tuple[str, ModelNeed]] = (),
                 learned: LearnedLoads | None = None) -> None:
        self.store, self.seen, self.settings = store, seen, settings
        self.standby_reason = ("moved to standby: overload convergence, or in flight outside "
                               "the top" if converging else
                               "moved to standby: in flight outside the top")
        """What a job's events say of a standby move: the plan's standby list holds both the
        lowest level's in-flight work under overload convergence and the in-flight work that
        fell out of the top (its next chunk runs only where nothing else is wanted)."""
        self._directory: WorkerDirectory | None = None
        self._busy_free_in_s = busy_free_in_s
        """When the busy workers free up (the tick's snapshot knows), read for a placement."""
        self._counted_until_s = counted_until_s
        """When the snapshot ``busy_free_in_s`` comes from was read."""
        self._rate = rate
        """Seconds per cost unit by cost key (the tick's cost model)."""
        self._built = built
        """Chunks run since their worker's heartbeat (:attr:`ExpectedLoads.built`)."""
        self._learned = learned
        """The load times the tick's placements count (:attr:`ExpectedLoads.learned`)."""
        self.demand = functools.cache(lambda: queued_demand(self.seen.values()))
        """The queued jobs per model among the records seen, counted once when first read."""
        self.buffered = buffered
        self._direct = direct_publish(settings)
        self._batch = ScriptBatch(store)
        self._then: list[Callable[[bool], None]] = []
        self._publish: list[tuple[JobRecord, int, int, str]] = []
        self._revoke: list[str] = []
        self.moved: dict[str, bool] = {}
        """Buffered: whether each job's queued action took effect (after :meth:`flush`)."""

    # buffering ----------------------------------------------------------------------------
    def _queue(self, job_id: str, then: Callable[[bool], None] | None = None) -> bool:
        def record(moved: bool) -> None:
            self.moved[job_id] = moved
            if then is not None:
                then(moved)
        self._then.append(record)
        if len(self._batch) >= APPLY_BATCH:
            self.flush()
        return True

    def flush(self) -> None:
        """Send the queued job actions, then what follows from their outcomes."""
        if not self._then:
            return
        for then, moved in zip(self._then, self._batch.execute(), strict=True):
            then(moved)
        self._then = []
        publish, self._publish = self._publish, []
        revoke, self._revoke = self._revoke, []
        if publish:
            publish_chunks(self.store, publish)
        if revoke:
            celery().control.revoke(revoke)  # hygiene only: the epochs fence

    @property
    def written(self) -> list[Written]:
        """Buffered: the job writes that took effect so far, with the revision each left
        (what the tick's snapshot cache folds in without reading the records again)."""
        return self._batch.written

    def _release_queued(self, job: JobRecord, queue: str, *, reason: str, bump_epoch: bool,
                        atomic: bool | None = None, estimate_s: float | None = None) -> bool:
        """The move to QUEUED, and with it (direct publish, a plain chunk) the chunk's message
        and the record's note of it, in one script; else the publish follows the move."""
        epoch, pushed = queue_release(self._batch, job, queue, by="scheduler", reason=reason,
                                      direct=self._direct, bump_epoch=bump_epoch,
                                      atomic=atomic, estimate_s=estimate_s)

        def then(moved: bool) -> None:
            if moved:
                if not pushed:
                    self._publish.append((job, job.next_chunk, epoch, queue))
                if bump_epoch and job.last_task_id:
                    self._revoke.append(job.last_task_id)
        return self._queue(job.job_id, then)

    # the plan's actions -------------------------------------------------------------------
    def fail(self, failure: Failure) -> bool:
        self.flush()
        job = self.seen.get(failure.job_id)
        if job is None:  # unreadable: no record to condition on
            return self.store.fail_unreadable(failure.job_id, failure.reason)
        return self.store.transition_as_seen(job, JobState.FAILED, by="scheduler",
                                             reason=failure.reason,
                                             updates=encode(error=failure.reason))

    def recover(self, recovery: Recovery) -> bool:
        self.flush()
        job = self.seen[recovery.job_id]
        if recovery.cause is RecoveryCause.PARKED:
            moved = release(self.store, job, queue=class_queue_of(job.queue), by="scheduler",
                            bump_epoch=True, reason=recovery.reason)
        elif recovery.cause is RecoveryCause.UNCLAIMED:  # the held message is fenced off
            moved = release(self.store, job, queue=class_queue_of(job.queue), by="watchdog",
                            bump_epoch=True, reason=recovery.reason)
        elif recovery.cause in (RecoveryCause.MODEL_LEFT, RecoveryCause.IDLE_HOLDER):
            # placed anew, as a release: a placement's move, not a fault
            moved = release(self.store, job, queue=self._placed(job, class_queue_of(job.queue)),
                            by="scheduler", bump_epoch=True, reason=recovery.reason)
            if moved:
                log.info("job %s: %s", job.job_id, recovery.reason)
            return moved
        else:
            by = "watchdog" if recovery.cause is RecoveryCause.LOST else "healer"
            moved = requeue_from_checkpoint(
                self.store, job, by=by, reason=recovery.reason,
                stuck=recovery.cause is RecoveryCause.STUCK) is not None
        if moved:
            log.warning("job %s: %s", job.job_id, recovery.reason)
        return moved

    def record_estimate(self, job_id: str, estimate_s: float) -> None:
        if self.buffered:
            self._batch.keep_first_estimate(job_id, estimate_s)
            self._queue(job_id)
        else:
            self.store.keep_first_estimate(job_id, estimate_s)

    def mark_level(self, job_id: str, mark: LevelMark) -> None:
        if self.buffered:
            self._batch.set_fields(job_id, level=mark.level, level_mark_s=mark.service_mark_s)
            self._queue(job_id)
        else:
            self.store.set_fields(job_id, level=mark.level, level_mark_s=mark.service_mark_s)

    def _end_as_seen(self, job_id: str, target: JobState, reason: str,
                     updates: Mapping[str, str] | None = None) -> bool:
        if self.buffered:
            self._batch.transition_as_seen(self.seen[job_id], target, by="scheduler",
                                           reason=reason, updates=updates)
            return self._queue(job_id)
        return self.store.transition_as_seen(self.seen[job_id], target, by="scheduler",
                                             reason=reason, updates=updates)

    def expire(self, job_id: str, reason: str) -> bool:
        return self._end_as_seen(job_id, JobState.EXPIRED, reason, encode(error=reason))

    def suspend(self, job_id: str, reason: str) -> bool:
        return self._end_as_seen(job_id, JobState.SUSPENDED, reason)

    def flag_preempt(self, job_id: str) -> bool:
        job = self.seen[job_id]
        if self.buffered:
            self._batch.request_preempt(job_id, state=job.state, epoch=job.epoch)
            return self._queue(job_id)
        return self.store.request_preempt(job_id, state=job.state, epoch=job.epoch)

    def requeue(self, job_id: str, to_queue: str, reason: str) -> bool:
        to_queue = self._requeued(self.seen[job_id], to_queue)
        if self.buffered:
            return self._release_queued(self.seen[job_id], to_queue, reason=reason,
                                        bump_epoch=True)
        return release(self.store, self.seen[job_id], queue=to_queue, by="scheduler",
                       bump_epoch=True, reason=reason)

    def _update(self, job: JobRecord, queue: str) -> bool:
        if self.buffered:
            self._batch.update_as_seen(job, queue=queue)
            return self._queue(job.job_id)
        return self.store.update_as_seen(job, queue=queue)

    def retarget(self, job_id: str, to_queue: str) -> bool:
        return self._update(self.seen[job_id], to_queue)

    def standby(self, job_id: str) -> bool:
        job = self.seen[job_id]
        if job.state is not JobState.QUEUED:
            return self._update(job, STANDBY)
        reason = self.standby_reason
        queue = self._kept(job, STANDBY) or STANDBY
        if self.buffered:
            return self._release_queued(job, queue, reason=reason, bump_epoch=True)
        return release(self.store, job, queue=queue, by="scheduler", bump_epoch=True,
                       reason=reason)

    def release(self, job_id: str, queue: str, atomic: bool,
                estimate_s: float | None = None) -> bool:
        job = self.seen[job_id]
        queue = self._placed(job, queue)
        if self.buffered:
            return self._release_queued(job, queue, reason=f"released to {queue}",
                                        bump_epoch=False, atomic=True if atomic else None,
                                        estimate_s=estimate_s)
        return release(self.store, job, queue=queue, by="scheduler",
                       reason=f"released to {queue}", atomic=True if atomic else None,
                       estimate_s=estimate_s)

    def _requeued(self, job: JobRecord, queue: str) -> str:
        """The queue a queued chunk moved to ``queue`` goes to: the same worker's own queue for
        it where the job is parked on a worker holding its model, else placed like a
        release."""
        return self._kept(job, queue) or self._placed(job, queue)

    def _kept(self, job: JobRecord, queue: str) -> str | None:
        """``job``'s worker's own queue for ``queue`` (:func:`~tasks.affinity.kept_queue`)."""
        if affinity_worker(job.queue) is None or not keeps_model(self.settings, job.kind,
                                                                 job.params):
            return None
        return kept_queue(job, queue, self._worker_directory(job))

    def _worker_directory(self, job: JobRecord) -> WorkerDirectory | None:
        if self._directory is None and needs_directory(self.settings, job):
            self._directory = self._read_directory()
        return self._directory

    def _read_directory(self) -> WorkerDirectory:
        busy = self._busy_free_in_s() if self._busy_free_in_s is not None else None
        return WorkerDirectory.read(
            self.store, busy_free_in_s=busy,
            demand=self.demand, mark_ttl_s=self.settings.broker.chunk_lease,
            counted_until_s=self._counted_until_s, rate=self._rate, built=self._built,
            learned=self._learned)

    def stage_models(self, min_queued: int, beats: Iterable[Heartbeat] = ()
                     ) -> list[tuple[str, str]]:
        """Ask workers with host room to read the models whose queue builds (``min_queued``
        or more jobs waiting) and that no worker holds into host memory ahead of their jobs
        (:meth:`~tasks.affinity.WorkerDirectory.stage_models`, after this tick's placements);
        returns the (worker, model) pairs asked. Only when some such model is held by none of
        ``beats`` (the tick's heartbeats) does a tick read the workers again: a busy pool's
        queues are mostly of models some worker holds."""
        if min_queued <= 0:
            return []
        held = held_models(beats)
        if not any(n >= min_queued and m not in held for m, n in self.demand().items()):
            return []
        if self._directory is None:
            self._directory = self._read_directory()
        waiting = (r for r in self.seen.values()
                   if r.state in (JobState.PENDING, JobState.QUEUED))
        asked = self._directory.stage_models(waiting, min_queued)
        push_stage_requests(self.store, asked, ttl_s=self.settings.broker.chunk_lease)
        for worker, model, _ in asked:
            log.info("asked %s to stage %s into host memory (%d jobs wait for it)", worker,
                     model, self.demand().get(model, 0))
        return [(worker, model) for worker, model, _ in asked]

    def _placed(self, job: JobRecord, queue: str) -> str:
        """The queue a release or requeue of ``job`` to ``queue`` goes to
        (:func:`~tasks.affinity.release_queue`: a worker's own queue where placement puts it);
        the workers' heartbeats are read once per tick, when first needed."""
        return release_queue(self.settings, job, queue, self._worker_directory(job))

    def release_batch(self, batch_id: str, releases: Sequence[Release], join: bool) -> None:
        self.flush()
        queue = releases[0].queue
        estimates = {r.job_id: r.estimate_s for r in releases if r.estimate_s is not None}
        release_batch(self.store, batch_id, [self.seen[r.job_id] for r in releases],
                      queue=queue, join=join, by="scheduler", estimates=estimates,
                      lease_s=self.settings.broker.chunk_lease)

    def set_worker_queues(self, wanted: Mapping[str, tuple[str, ...]]) -> None:
        self.flush()
        apply_worker_queues(self.store, expand_worker_queues(self.settings, wanted))

    def publish_decisions(self, plan: TickPlan) -> None:
        self.flush()
        _publish_decisions(self.store, plan)


def _publish_decisions(store: JobStore, plan: TickPlan) -> None:
    pipe = store.redis.pipeline(transaction=False)
    if plan.origin_id is None:
        pipe.delete(keys.ORIGIN)
    else:
        pipe.set(keys.ORIGIN, plan.origin_id)
    pipe.set(keys.ADMISSION, PublishedAdmission.of_plan(plan).encode())
    pipe.set(keys.POLICY_STATE, json.dumps(plan.state.to_json()))
    pipe.set(keys.SCORES, json.dumps([[job_id, score] for job_id, score in plan.top_scores]))
    pipe.execute()


def apply_worker_queues(store: JobStore, wanted: Mapping[str, tuple[str, ...]]) -> None:
    """Reserve or restore workers with Celery's remote control, only where something changed
    (``wanted`` already holds each worker's affinity queues in place).

    ``add_consumer`` appends, so restoring strict order means re-adding the dropped queues in
    priority order; a worker's own heartbeat reports what it consumes now.
    """
    raw = cast(dict[bytes, bytes], store.redis.hgetall(keys.WORKER_QUEUES))
    applied = {k.decode(): tuple(json.loads(v)) for k, v in raw.items()}
    for worker, queues in wanted.items():
        current = applied.get(worker)
        if current == tuple(queues):
            continue
        if current is None:
            current = _heartbeat_queues(store, worker)
        _reconsume(worker, current, tuple(queues))
        store.redis.hset(keys.WORKER_QUEUES, worker, json.dumps(list(queues)))


def _heartbeat_queues(store: JobStore, worker: str) -> tuple[str, ...]:
    raw = store.redis.get(keys.worker(worker))
    return Heartbeat.decode(raw, worker).queues if raw else ()


def _reconsume(worker: str, current: Iterable[str], wanted: tuple[str, ...]) -> None:
    current = tuple(current)
    keep = common_prefix(current, wanted)
    for queue in current[len(keep):]:
        celery().control.cancel_consumer(queue, destination=[worker], reply=False)
    for queue in wanted[len(keep):]:
        celery().control.add_consumer(queue, destination=[worker], reply=False)
    log.info("worker %s: queues %s -> %s", worker, ",".join(current), ",".join(wanted))
