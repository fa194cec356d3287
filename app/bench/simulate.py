"""Discrete-event simulation of Stepline at scale: the live tick's planner on a virtual clock.

No Celery, no Redis, no devices: N simulated workers consume simulated queues the way the real
ones do (strict queue order, the reserve's realtime-only workers, one chunk at a time, a
dispatch overhead per hop), and every ``tick_s`` the planner the live tick holds
(:class:`scheduler.IncrementalPlanner`, held across ticks as ``tasks.tick`` holds it; its
plans equal ``plan_tick``'s) plans the cluster; its plan goes through the live tick's own
apply loop (``tasks.apply.apply_plan``) with the simulated cluster as the target, recoveries
included. Chunk durations are the published GPU step figures of the cost model's priors, with
jitter. Everything it reports is labelled as simulation.

This module is the cluster and its event loop (:class:`ClusterSim`); the workload and its trace
are ``app.bench.sim_workload``, the records ``app.bench.sim_records``, model residency and
placement ``app.bench.sim_placement`` (worker memory: ``app.bench.sim_residency``), and the
runs over policies with their report ``app.bench.sim_report``.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from app.bench.sim_placement import SimPlacement
from app.bench.sim_records import SimJob, SimResult, SimWorker
from app.bench.sim_workload import SimArrival, SimConfig
from scheduler import (
    AdmissionStatus,
    ClusterSnapshot,
    IncrementalPlanner,
    JobState,
    LevelMark,
    PolicyConfig,
    PolicyState,
    SubmitAction,
    SubmitDecision,
    TickPlan,
    WorkerView,
    check_plan_invariants,
    decide_submit,
)
from scheduler.degradation import Degradation, QualityLadder, choose_level
from scheduler.fairness import ServiceLedger
from scheduler.placement import place, slack_s
from scheduler.plan import Release
from scheduler.queues import CLASS_QUEUE, NORMAL_WORKER_QUEUES, STANDBY_QUEUE
from scheduler.recovery import Failure, Recovery, RecoveryCause
from tasks.apply import apply_plan
from tasks.routing import AFFINITY_CLASSES, affinity_queue, placed_queue, with_affinity

_ARRIVE, _TICK, _WAKE, _END, _FAIL, _STAGED = range(6)


class ClusterSim(SimPlacement):
    """The adapter, the queues and the workers on a virtual clock (one policy, one trace)."""

    def __init__(self, config: SimConfig, trace: Sequence[SimArrival], policy: PolicyConfig,
                 check_invariants: bool = False, degrade_queued_load: float | None = None
                 ) -> None:
        self.config, self.trace, self.policy = config, trace, policy
        self.degrade_queued_load = degrade_queued_load
        """Past this load each tick also degrades the waiting jobs that allow it and have not
        started, once full quality is predicted late (None: only admission degrades)."""
        self.check_invariants = check_invariants
        self.kind = policy.policy
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.workers = [SimWorker(f"w{k:03d}") for k in range(config.workers)]
        self.by_name = {w.name: w for w in self.workers}
        self.idle: dict[str, SimWorker] = {w.name: w for w in self.workers}
        self.queues: dict[str, deque[tuple[SimJob, int]]] = {
            q: deque() for q in NORMAL_WORKER_QUEUES}
        self.jobs = [SimJob(a) for a in trace]
        self.live: dict[str, SimJob] = {}
        self.state = PolicyState()
        self.admission: AdmissionStatus | None = None
        self.cost = policy.new_cost_model()
        self.status = ["unfinished"] * len(trace)
        self.lost_s = 0.0
        self.ticks = 0
        self.ledger = ServiceLedger()
        """The tenants' fair-share counters (``scheduler.fairness``): each chunk's measured
        seconds charged as it ends, the join rule applied each tick (what Redis keeps live)."""
        self.planner = IncrementalPlanner()
        """The live tick's planner, held across ticks (it reads only the views that changed:
        a job's view is rebuilt only when what it shows changes, as the live cache does)."""
        self.result = SimResult([None] * len(trace), self.status, 0.0, 0.0, 0.0, 0.0)
        self.moves = {"flag_preempt": 0, "preempted": 0, "standby": 0, "requeue": 0,
                      "release": 0, "suspend": 0, "expire": 0}
        """How the plans moved jobs: each target call, and the preemptions taking effect."""
        self.ended = 0
        self._start_residency(config.residency, trace)

    # -- event loop -------------------------------------------------------------------------

    def _push(self, at_s: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at_s, self.seq, kind, payload))

    def run(self) -> SimResult:
        started = time.perf_counter()
        for job in self.jobs:
            self._push(job.arrival.arrival_s, _ARRIVE, job)
        self._push(0.0, _TICK, None)
        if self.config.fail_at_s is not None:
            self._push(self.config.fail_at_s, _FAIL, None)
        end_s = self.config.end_s
        handlers = (self.arrive, self._tick, self._wake, self._end, self._fail, self._staged)
        while self.events:
            at_s, _, kind, payload = heapq.heappop(self.events)
            if at_s > end_s:
                break
            self.now = at_s
            handlers[kind](payload)
            if self.res is not None and self.ended == len(self.jobs):
                # with residency (a models trace) the run ends with its last job: the drain
                # is set by the longest deadline, and ticks of an empty cluster change nothing
                end_s = self.now
                break
        self.now = end_s
        return self._finish(time.perf_counter() - started)

    def _finish(self, wall_s: float) -> SimResult:
        r = self.result
        for w in self.workers:
            if w.job is not None and w.alive:  # count the part of the chunk run by the end
                w.busy_s += max(self.now - w.run_start_s, 0.0)
                w.load_s -= max(w.run_start_s - self.now, 0.0)  # a load under way at the end
        r.busy_s = sum(w.busy_s for w in self.workers)
        r.overhead_s = sum(w.overhead_s for w in self.workers)
        r.lost_s = self.lost_s
        fail_s = self.config.fail_at_s
        lost_worker_s = self.now - fail_s if fail_s is not None and fail_s < self.now else 0.0
        r.capacity_s = len(self.workers) * self.now - lost_worker_s
        r.preemptions = sum(j.preemptions for j in self.jobs)
        r.first_estimates_s = [j.first_estimate_s for j in self.jobs]
        r.wall_s = wall_s
        r.moves = dict(self.moves)
        if self.res is not None:
            r.residency = {
                **self.counts, "load_s": sum(w.load_s for w in self.workers),
                "evictions": sum(w.mem.evictions for w in self.workers if w.mem),
                "peak_device_bytes": max(w.mem.peak_device_bytes for w in self.workers
                                         if w.mem),
                "device_budget_bytes": self.res.device_budget_bytes,
                "per_job": {**self.per_job, "started_warm": [j.started_warm for j in self.jobs]},
            }
        return r

    # -- submission (JobService.submit) -----------------------------------------------------

    def arrive(self, job: SimJob) -> SubmitDecision:
        """The job is submitted now: the live submit path's own decision
        (:func:`scheduler.decide_submit`), applied to the simulated store."""
        self.live[job.id] = job
        degraded = self._degrade(job)
        decision = decide_submit(job.job_view(), self.policy, self.admission, self.now, degraded)
        job.atomic = decision.atomic
        if decision.action is SubmitAction.SHED:
            self.result.reasons[job.arrival.index] = decision.reason
            self._end_job(job, JobState.EXPIRED, "shed")
        elif decision.action is SubmitAction.SUSPEND:
            self.result.reasons[job.arrival.index] = decision.reason
            self._set_state(job, JobState.SUSPENDED)
        elif decision.action is SubmitAction.RELEASE:
            self._place(job, decision.queue)
        return decision

    def _degrade(self, job: SimJob) -> Degradation | None:
        """The live submit path's degradation (:func:`scheduler.degradation.choose_level` on a
        fresh admission status, the job priced by the cost model): its arrival cut to the
        chosen level, its reason kept as its first event's."""
        a, status = job.arrival, self.admission
        if a.min_steps is None or status is None \
                or self.now - status.measured_at_s > self.policy.admission_status_ttl_s:
            return None
        chosen = choose_level(self._ladder(a), a.deadline_s - self.now, status.load, self.policy)
        if chosen is not None:
            self._apply_level(job, chosen)
        return chosen

    def _degrade_queued(self) -> None:
        """Past ``degrade_queued_load``, each waiting job that allows it, has not started and
        was not degraded yet, at the level :func:`choose_level` picks for the time it has left
        (a job whose deadline became unreachable while it waited)."""
        status = self.admission
        if self.degrade_queued_load is None or status is None:
            return
        policy = replace(self.policy, degrade_load=self.degrade_queued_load)
        for job in self.live.values():
            a = job.arrival
            if a.min_steps is None or a.index in self.result.degraded or job.next_chunk \
                    or job.state not in (JobState.QUEUED, JobState.SUSPENDED):
                continue
            chosen = choose_level(self._ladder(a), a.deadline_s - self.now, status.load, policy)
            if chosen is not None:
                self._apply_level(job, chosen)

    def _ladder(self, a: SimArrival) -> QualityLadder:
        """The levels of a job with a floor (a 64 px square when it allows smaller sizes)."""
        shape = a.shape
        step_s = shape.units_per_chunk * self.cost.seconds_per_unit(shape.cost_key, "cuda")
        sizes: tuple[tuple[int, int], ...] = ()
        if a.min_pixel_share is not None:
            low = max(8, math.ceil(64 * math.sqrt(a.min_pixel_share) / 8) * 8)
            sizes = tuple((side, side) for side in range(56, low - 1, -8))
        return QualityLadder(full_steps=shape.chunks, min_steps=min(a.min_steps or 1, shape.chunks),
                             step_s=step_s, cache=None if a.cache_share is None else "first_block",
                             cache_fraction=a.cache_share or 1.0, full_size=(64, 64), sizes=sizes)

    def _apply_level(self, job: SimJob, chosen: Degradation) -> None:
        """The job's arrival cut to ``chosen``: its steps, each scaled by the cache's share and
        the size's pixels."""
        a = job.arrival
        shape = a.shape
        scale = (a.cache_share or 1.0) if chosen.cache is not None else 1.0
        if chosen.size is not None:
            scale *= chosen.size[0] * chosen.size[1] / 64 ** 2
        job.arrival = replace(a, shape=replace(shape, chunks=chosen.steps,
                                               units_per_chunk=shape.units_per_chunk * scale),
                              chunk_s=tuple(c * scale for c in a.chunk_s[:chosen.steps]))
        job.units_left = chosen.steps * shape.units_per_chunk * scale
        job.view = None
        self.result.degraded[a.index] = chosen.steps
        self.result.level_share[a.index] = chosen.work_share
        self.result.reasons[a.index] = chosen.reason

    # -- queues and workers -----------------------------------------------------------------

    def _set_state(self, job: SimJob, state: JobState) -> None:
        job.state = state
        job.view = None

    def _publish(self, job: SimJob, queue: str) -> None:
        self.queues[queue].append((job, job.epoch))
        for w in self.idle.values():
            if queue in w.consumes:
                del self.idle[w.name]
                self._wake(w)
                return

    def _release(self, job: SimJob, queue: str, bump_epoch: bool = False,
                 parked_on: str | None = None, placed: bool = False) -> None:
        """``tasks.dispatch.release``: QUEUED on ``queue`` (or on ``parked_on``'s own queue
        for that class; ``placed``: its placement queue), flag cleared, chunk published."""
        job.epoch += 1 if bump_epoch else 0
        job.state, job.queue, job.preempt = JobState.QUEUED, queue, False
        job.parked_on = parked_on
        job.parked_q = None if parked_on is None else placed_queue(parked_on, queue) \
            if placed else affinity_queue(parked_on, queue)
        job.waiting_since_s = self.now
        job.view = None
        self._publish(job, job.parked_q or queue)

    def _place(self, job: SimJob, queue: str, bump_epoch: bool = False) -> None:
        """A release: with residency, :func:`scheduler.placement.place` chooses the worker whose
        own queue takes the chunk (None: the class queue), as the live release path does."""
        model = job.arrival.model
        if self.res is None or model is None or queue not in AFFINITY_CLASSES:
            self._release(job, queue, bump_epoch)
            return
        need = self._need(job)
        workers = self._holdings(queue, need)
        placement = place(need, workers, self.estimates, self.res.placement, self.demand,
                          slack_s(job.arrival.deadline_s, self.now, self._remaining_est_s(job)))
        if placement.worker is not None:
            self.counts["placed_on_worker"] += 1
        self._release(job, queue, bump_epoch, parked_on=placement.worker, placed=True)

    def _wake(self, w: SimWorker) -> None:
        """The worker takes the first message its queues offer, in their order."""
        if not w.alive or w.job is not None:
            return
        for q in w.consumes:
            pending = self.queues[q]
            if pending:
                job, epoch = pending.popleft()
                if epoch == job.epoch and job.state is JobState.QUEUED \
                        and q == (job.parked_q or job.queue):
                    self._claim(w, job)
                else:  # a fenced (stale) message: one hop's overhead for nothing
                    w.overhead_s += self.config.dispatch_overhead_s
                    self._push(self.now + self.config.dispatch_overhead_s, _WAKE, w)
                return
        self.idle[w.name] = w

    def _claim(self, w: SimWorker, job: SimJob) -> None:
        overhead_s = self.config.dispatch_overhead_s
        w.overhead_s += overhead_s
        start_s = self.now + overhead_s
        if job.preempt:  # flagged while queued: yields at claim, having run nothing
            self._push(start_s, _WAKE, w)
            self._preempted(job, start_s)
            return
        job.state, job.running_on, job.parked_on = JobState.RUNNING, w.name, None
        job.parked_q = None
        job.view = None
        if w.mem is not None and job.arrival.model is not None:
            load_s = self._load(w, job)
            if load_s > 0.0:
                w.loads.append((start_s + load_s, load_s))
            start_s += load_s
        w.job, w.run_start_s, w.start_groups = job, start_s, job.groups_done
        w.token += 1
        if job.atomic:
            end_s = start_s + sum(job.arrival.chunk_s[job.next_chunk:]) - self._group_s(
                job) * job.groups_done
            w.stop_groups = -1
        else:
            w.stop_groups = job.arrival.shape.block_groups
            end_s = start_s + self._group_s(job) * (w.stop_groups - job.groups_done)
        self._push(end_s, _END, (w, w.token))

    def _group_s(self, job: SimJob) -> float:
        shape = job.arrival.shape
        return job.arrival.chunk_s[job.next_chunk] / shape.block_groups

    def _end(self, payload: tuple[SimWorker, int]) -> None:
        w, token = payload
        if token != w.token or w.job is None or not w.alive:
            return
        job = w.job
        ran_s = self.now - w.run_start_s
        w.busy_s += ran_s
        w.job = None
        if job.state is JobState.RUNNING and job.running_on == w.name:
            job.service_s += ran_s
            self._charge(job, ran_s)
            job.running_on = None
            if w.stop_groups < 0:
                self._chunks_done(job, job.arrival.shape.chunks - job.next_chunk, w)
            elif w.stop_groups < job.arrival.shape.block_groups:
                job.groups_done = w.stop_groups
                self._preempted(job, self.now)
            else:
                if w.start_groups == 0:  # the chunk ran whole: the worker reports its time
                    shape = job.arrival.shape
                    self.cost = self.cost.observe(shape.cost_key, "cuda",
                                                  shape.units_per_chunk, ran_s)
                self._chunks_done(job, 1, w)
        self._wake(w)

    def _charge(self, job: SimJob, seconds: float) -> None:
        """The commit's charge: measured seconds to the job's tenant in its class's band
        (and, while arrivals last, to its tenant's served seconds the report counts)."""
        view = job.job_view()
        if self.now <= self.config.duration_s:
            served = self.result.served_s
            served[view.tenant] = served.get(view.tenant, 0.0) + seconds
        if self.policy.fair_share.enabled:
            self.ledger = self.ledger.charged(view.slo_class.value, view.tenant,
                                              view.tier.value, seconds)

    def _chunks_done(self, job: SimJob, count: int, w: SimWorker | None = None) -> None:
        shape = job.arrival.shape
        job.next_chunk += count
        job.groups_done = 0
        job.units_left = (shape.chunks - job.next_chunk) * shape.units_per_chunk
        job.view = None
        if job.next_chunk >= shape.chunks:
            self._end_job(job, JobState.DONE, "done")
        elif job.preempt:
            self._preempted(job, self.now)
        else:  # hop: the next chunk goes to the back of the job's current queue
            job.state = JobState.QUEUED
            job.waiting_since_s = self.now
            queue = job.queue or CLASS_QUEUE[shape.slo]
            if w is not None and w.mem is not None and job.arrival.model is not None \
                    and affinity_queue(w.name, queue) in w.consumes:
                # with residency the next chunk stays where its model is: the worker's own queue
                job.parked_on = w.name
                queue = job.parked_q = affinity_queue(w.name, queue)
            self._publish(job, queue)

    def _preempted(self, job: SimJob, at_s: float) -> None:
        job.state, job.preempt, job.running_on = JobState.PREEMPTED, False, None
        job.preemptions += 1
        self.moves["preempted"] += 1
        job.waiting_since_s = at_s
        job.view = None

    def _end_job(self, job: SimJob, state: JobState, status: str) -> None:
        job.state, job.finished_s = state, self.now
        job.view = None
        if self.live.pop(job.id, None) is not None:
            self.ended += 1
        self.status[job.arrival.index] = status
        if state is JobState.DONE:
            self.result.finished_s[job.arrival.index] = self.now

    # -- failure and the lease watchdog -----------------------------------------------------

    def _fail(self, _: object) -> None:
        busy = [w for w in self.workers if w.alive and w.job is not None] or [
            w for w in self.workers if w.alive]
        if not busy:
            return
        w = random.Random(self.config.seed).choice(busy)
        w.alive = False
        w.dead_until_s = self.now + self.config.lease_s
        self.idle.pop(w.name, None)
        job = w.job
        if job is None:
            return
        ran_s = max(self.now - w.run_start_s, 0.0)
        if w.stop_groups < 0:  # atomic: the chunks it finished were checkpointed one by one
            kept = self._checkpointed_chunks(job, ran_s)
            job.service_s += kept
            self._charge(job, kept)
            ran_s -= kept
        w.busy_s += ran_s
        self.lost_s += ran_s
        job.lease_until_s, job.view = w.dead_until_s, None
        self.result.lost_jobs.append(job.arrival.index)

    def _checkpointed_chunks(self, job: SimJob, ran_s: float) -> float:
        kept_s, chunks = 0.0, job.arrival.chunk_s
        while job.next_chunk < len(chunks) and kept_s + chunks[job.next_chunk] <= ran_s:
            kept_s += chunks[job.next_chunk]
            job.next_chunk += 1
        job.units_left = (len(chunks) - job.next_chunk) * job.arrival.shape.units_per_chunk
        job.view = None
        return kept_s

    # -- the tick (tasks/adapter.run_tick) --------------------------------------------------

    def _tick(self, _: object) -> None:
        self.ticks += 1
        self._push(self.ticks * self.config.tick_s, _TICK, None)
        if self.res is not None:
            for at_s, w, model in self._residency_tick(self.res):
                self._push(at_s, _STAGED, (w, model))
        self._degrade_queued()
        snapshot = ClusterSnapshot(tuple(j.job_view() for j in self.live.values()),
                                   self._worker_views(), self.cost, self.state)
        started = time.perf_counter()
        if self.policy.fair_share.enabled:
            snapshot = replace(snapshot, service=self.ledger)
        plan = self.planner.plan(snapshot, self.policy, self.now)
        if plan.fair_share is not None:  # the join's lifts, active set and floors
            self.ledger = plan.fair_share.ledger
        self.result.tick_ms.append((time.perf_counter() - started) * 1e3)
        self.result.tick_jobs.append(len(snapshot.jobs))
        if self.check_invariants:
            check_plan_invariants(plan, snapshot, self.policy)
        apply_plan(plan, self)

    def _worker_views(self) -> tuple[WorkerView, ...]:
        """The workers whose heartbeat is fresh, each with the loads of the policy's window."""
        since_s = self.now - self.policy.load_window_s
        for w in self.workers:
            while w.loads and w.loads[0][0] <= since_s:
                w.loads.popleft()
        return tuple(WorkerView(w.name, True, w.job.id if w.job is not None else None,
                                w.queues, "cuda", loads=tuple(w.loads))
                     for w in self.workers if w.alive or self.now < w.dead_until_s)

    # -- the plan's target (tasks.apply.TickTarget): the live tick's apply loop, in memory --

    def fail(self, failure: Failure) -> bool:
        job = self.live.get(failure.job_id)
        if job is not None:
            self._end_job(job, JobState.FAILED, "failed")
        return job is not None

    def recover(self, recovery: Recovery) -> bool:
        """A lapsed lease: the dead worker's job is requeued from its checkpoint."""
        job = self.live[recovery.job_id]
        dead = self.by_name.get(job.running_on or "")
        if dead is not None and dead.job is job:
            dead.job = None
        job.running_on, job.lease_until_s = None, None
        queue = CLASS_QUEUE[job.arrival.shape.slo] if job.queue is None else job.queue
        if recovery.cause in (RecoveryCause.MODEL_LEFT, RecoveryCause.IDLE_HOLDER):
            self.counts[recovery.cause.value] += 1  # placed anew, as a release
            job.model_left = job.idle_holder = False
            self._place(job, queue, bump_epoch=True)
            return True
        if job.parked_on is not None:
            self.counts["parked_recovered"] += 1
        self._release(job, queue, bump_epoch=True)
        return True

    def mark_level(self, job_id: str, mark: LevelMark) -> None:
        job = self.live[job_id]
        job.level, job.level_service_s, job.view = mark.level, mark.service_mark_s, None

    def expire(self, job_id: str, reason: str) -> bool:
        self.moves["expire"] += 1
        job = self.live[job_id]
        self.result.reasons[job.arrival.index] = reason
        self._end_job(job, JobState.EXPIRED, "expired")
        return True

    def suspend(self, job_id: str, reason: str) -> bool:
        self.moves["suspend"] += 1
        job = self.live[job_id]
        self.result.reasons[job.arrival.index] = reason
        self._set_state(job, JobState.SUSPENDED)
        return True

    def flag_preempt(self, job_id: str) -> bool:
        self.moves["flag_preempt"] += 1
        self._flag(self.live[job_id])
        return True

    def requeue(self, job_id: str, to_queue: str, reason: str) -> bool:
        """A queued chunk moved to ``to_queue`` (``tasks.affinity.requeue_queue``): it stays on
        the worker it is parked on, else it is placed like a release."""
        self.moves["requeue"] += 1
        job = self.live[job_id]
        keeps = self._keeps(job, to_queue)
        if keeps is None:
            self._place(job, to_queue, bump_epoch=True)
        else:
            self._release(job, to_queue, bump_epoch=True, parked_on=keeps,
                          placed=job.service_s == 0 and to_queue in AFFINITY_CLASSES)
        return True

    def retarget(self, job_id: str, to_queue: str) -> bool:
        job = self.live[job_id]
        job.queue, job.view = to_queue, None
        return True

    def standby(self, job_id: str) -> bool:
        self.moves["standby"] += 1
        job = self.live[job_id]
        if job.state is JobState.QUEUED:
            self._release(job, STANDBY_QUEUE, bump_epoch=True,
                          parked_on=self._keeps(job, STANDBY_QUEUE))
        else:
            job.queue, job.view = STANDBY_QUEUE, None
        return True

    def release(self, job_id: str, queue: str, atomic: bool,
                estimate_s: float | None = None) -> bool:
        self.moves["release"] += 1
        job = self.live[job_id]
        job.atomic = job.atomic or atomic
        self._place(job, queue)
        return True

    def release_batch(self, batch_id: str, releases: Sequence[Release], join: bool) -> None:
        # The simulated cluster runs every job alone (its jobs carry no batch group, so the
        # policy forms no batch): a batch release is each job's own release.
        for rel in releases:
            self.release(rel.job_id, rel.queue, False, rel.estimate_s)

    def record_estimate(self, job_id: str, estimate_s: float) -> None:
        job = self.live[job_id]
        if job.first_estimate_s is None:
            job.first_estimate_s, job.view = estimate_s, None

    def set_worker_queues(self, wanted: Mapping[str, tuple[str, ...]]) -> None:
        for name, queues in wanted.items():
            w = self.by_name[name]
            if w.queues != queues:
                w.queues = queues
                w.consumes = queues if w.mem is None else with_affinity(name, queues)
                if w.alive and w.job is None:
                    self.idle.pop(name, None)
                    self._wake(w)

    def publish_decisions(self, plan: TickPlan) -> None:
        self.state, self.admission = plan.state, plan.admission

    def _flag(self, job: SimJob) -> None:
        """Preempt flag: a running chunk stops at its next block-group boundary."""
        job.preempt, job.view = True, None
        w = self.by_name.get(job.running_on or "")
        if w is None or not w.alive or w.job is not job or w.stop_groups < 0:
            return
        group_s = self._group_s(job)
        # It checks the flag before each group but the first; the group under way completes.
        groups_run = max(math.ceil((self.now - w.run_start_s) / group_s - 1e-9), 1)
        stop = min(w.start_groups + groups_run, job.arrival.shape.block_groups)
        if stop < w.stop_groups:
            w.stop_groups = stop
            w.token += 1
            self._push(w.run_start_s + group_s * (stop - w.start_groups), _END, (w, w.token))
