"""Builders, hypothesis strategies and a virtual-clock cluster for the scheduler tests.

No tests here: the other ``test_scheduler_*`` modules import from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import strategies as st

from scheduler import (
    AdmissionState,
    ClusterSnapshot,
    JobKind,
    JobState,
    JobView,
    PolicyConfig,
    PolicyState,
    ResourceProfile,
    SloClass,
    TickPlan,
    Tier,
    WorkerView,
    plan_tick,
)
from scheduler.queues import NORMAL_WORKER_QUEUES, REALTIME_QUEUE, STANDBY_QUEUE

NOW_S = 1000.0
SIM_RATE_S_PER_UNIT = PolicyConfig().cost_priors_s_per_unit["simulated"]
"""The ``simulated`` prior: a simulated job's cost units are seconds of work."""
TARGET_S = {SloClass.REALTIME: 1.0, SloClass.INTERACTIVE: 5.0, SloClass.BATCH: 60.0}


def make_job(job_id: str, *, slo_class: SloClass = SloClass.BATCH,
             state: JobState = JobState.PENDING, work_s: float = 0.5,
             submitted_at_s: float = NOW_S - 0.1, deadline_s: float | None = None,
             **overrides: Any) -> JobView:
    """A simulated job of ``work_s`` seconds of remaining work; overrides any JobView field."""
    fields: dict[str, object] = {
        "job_id": job_id, "tenant": "acme", "tier": Tier.STANDARD, "slo_class": slo_class,
        "kind": JobKind.SIMULATED, "state": state, "submitted_at_s": submitted_at_s,
        "deadline_s": submitted_at_s + TARGET_S[slo_class] if deadline_s is None else deadline_s,
        "cost_key": "simulated", "num_chunks": 10, "next_chunk": 0,
        "remaining_cost_units": work_s / SIM_RATE_S_PER_UNIT,
        "waiting_since_s": submitted_at_s,
    }
    fields.update(overrides)
    return JobView(**fields)  # type: ignore[arg-type]


def running(job_id: str, worker: str, *, slo_class: SloClass = SloClass.BATCH,
            queue: str = "batch", level: int = 2, **overrides: Any) -> JobView:
    return make_job(job_id, slo_class=slo_class, state=JobState.RUNNING, running_on=worker,
                    queue=queue, level=level, **overrides)


def make_workers(count: int, busy: dict[str, str] | None = None) -> tuple[WorkerView, ...]:
    busy = busy or {}
    return tuple(WorkerView(f"w{k}", True, busy.get(f"w{k}"), NORMAL_WORKER_QUEUES, "cpu")
                 for k in range(count))


def make_snapshot(jobs: Iterable[JobView], workers: int | tuple[WorkerView, ...] = 4,
                  state: PolicyState | None = None,
                  policy: PolicyConfig | None = None, measured: int = 0) -> ClusterSnapshot:
    """``measured``: chunks of the simulated cost key timed on the cpu (at the prior's rate),
    so estimates are trusted once it reaches ``policy.cost_min_samples``."""
    jobs = tuple(jobs)
    if isinstance(workers, int):
        busy = {j.running_on: j.job_id for j in jobs if j.running_on}
        workers = make_workers(workers, busy)
    cost = (policy or PolicyConfig()).new_cost_model()
    for _ in range(measured):
        cost = cost.observe("simulated", "cpu", 1.0, SIM_RATE_S_PER_UNIT)
    return ClusterSnapshot(jobs, workers, cost, state or PolicyState())


# -- hypothesis strategies -----------------------------------------------------------------------

_WAITING_STATES = (JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED)
_ALL_STATES = tuple(JobState)


@st.composite
def snapshots(draw: st.DrawFn, max_jobs: int = 24) -> ClusterSnapshot:
    """Random but consistent snapshots: each RUNNING job on its own alive worker."""
    n_workers = draw(st.integers(0, 8))
    alive = [draw(st.booleans()) or k == 0 for k in range(n_workers)]
    n_jobs = draw(st.integers(0, max_jobs))
    free = [k for k in range(n_workers) if alive[k]]
    jobs = []
    for k in range(n_jobs):
        state = draw(st.sampled_from(_ALL_STATES))
        worker = None
        if state is JobState.RUNNING:
            if not free:
                state = JobState.QUEUED
            else:
                worker = f"w{free.pop()}"
        jobs.append(draw(_job(f"j{k}", state, worker, n_jobs)))
    busy = {j.running_on: j.job_id for j in jobs if j.running_on}
    workers = tuple(WorkerView(f"w{k}", alive[k], busy.get(f"w{k}"), NORMAL_WORKER_QUEUES, "cpu")
                    for k in range(n_workers))
    origin = draw(st.one_of(st.none(), st.sampled_from([j.job_id for j in jobs] or ["gone"])))
    policy_state = PolicyState(origin_id=origin,
        admission=draw(st.sampled_from(tuple(AdmissionState))),
        reserve_until_s=draw(st.one_of(st.none(), st.floats(NOW_S - 5, NOW_S + 5))),
        reserved_workers=tuple(f"w{k}" for k in range(min(n_workers, 2))))
    return ClusterSnapshot(tuple(jobs), workers, PolicyConfig().new_cost_model(), policy_state)


@st.composite
def _job(draw: st.DrawFn, job_id: str, state: JobState, worker: str | None,
         n_jobs: int) -> JobView:
    slo_class = draw(st.sampled_from(tuple(SloClass)))
    num_chunks = draw(st.integers(1, 50))
    submitted = NOW_S - draw(st.floats(0, 120))
    in_flight = state in (JobState.QUEUED, JobState.RUNNING)
    queue = draw(st.sampled_from(("realtime", "interactive", "batch", STANDBY_QUEUE))) \
        if in_flight else None
    deps = draw(st.lists(st.integers(0, max(n_jobs - 1, 0)), max_size=2)) if n_jobs else []
    group = draw(st.one_of(st.none(), st.sampled_from(("g1", "g2"))))
    batch = draw(st.one_of(st.none(), st.sampled_from(("b1", "b2", "b3")))) \
        if in_flight and group is not None else None
    # a queued chunk may wait on a worker's own queue (alive or not), its model perhaps gone
    parked = draw(st.one_of(st.none(), st.sampled_from(("w0", "w1", "w9")))) \
        if state is JobState.QUEUED else None
    return JobView(
        job_id=job_id, tenant=draw(st.sampled_from(("a", "b"))),
        tier=draw(st.sampled_from(tuple(Tier))), slo_class=slo_class,
        kind=draw(st.sampled_from(tuple(JobKind))), state=state, submitted_at_s=submitted,
        deadline_s=submitted + draw(st.floats(0.1, 200)), cost_key=draw(st.sampled_from(
            ("simulated", "image-256", "video-480p", "text-x", "unknown"))),
        num_chunks=num_chunks, next_chunk=draw(st.integers(0, num_chunks)),
        remaining_cost_units=draw(st.floats(0, 500)), queue=queue, running_on=worker,
        service_s=draw(st.floats(0, 30)), waiting_since_s=submitted + draw(st.floats(0, 5)),
        preemptions=draw(st.integers(0, 5)),
        resource_profile=draw(st.sampled_from(tuple(ResourceProfile))),
        depends_on=tuple(f"j{d}" for d in deps if f"j{d}" != job_id),
        level=draw(st.one_of(st.none(), st.integers(0, 2))),
        level_service_s=0.0,
        preempt_requested=state is JobState.RUNNING and draw(st.booleans()),
        batch_group=group, batch_id=batch,
        parked_on=parked, model_left=parked is not None and draw(st.booleans()),
        idle_holder=parked is not None and draw(st.booleans()),
    )


# -- a virtual-clock cluster ---------------------------------------------------------------------

_QUEUE_ORDER = {name: rank for rank, name in enumerate(NORMAL_WORKER_QUEUES)}


@dataclass
class VirtualCluster:
    """Applies plans the way the adapter will, on a virtual clock; a chunk is one tick of work.

    Each tick: plan → apply → every worker takes the first chunk its queues offer (strict queue
    order, FIFO inside a queue) → one tick of work → chunks end (done, preempted or hop).
    """

    policy: PolicyConfig
    workers: int
    tick_s: float = 0.1
    now_s: float = NOW_S
    jobs: dict[str, JobView] = field(default_factory=dict)
    state: PolicyState = field(default_factory=PolicyState)
    enqueued_at: dict[str, float] = field(default_factory=dict)
    waits_s: list[tuple[str, float]] = field(default_factory=list)
    busy_s: dict[SloClass, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    reserved: frozenset[str] = frozenset()
    plans: list[TickPlan] = field(default_factory=list)

    def submit(self, job: JobView) -> None:
        budget_s = job.deadline_s - job.submitted_at_s
        self.jobs[job.job_id] = replace(job, submitted_at_s=self.now_s,
                                        waiting_since_s=self.now_s,
                                        deadline_s=self.now_s + budget_s)

    def step(self) -> TickPlan:
        snapshot = ClusterSnapshot(tuple(self.jobs.values()), self._worker_views(),
                                   self.policy.new_cost_model(), self.state)
        plan = plan_tick(snapshot, self.policy, self.now_s)
        self.plans.append(plan)
        self._apply(plan)
        self._dispatch()
        self._work()
        self.now_s += self.tick_s
        return plan

    def _worker_views(self) -> tuple[WorkerView, ...]:
        busy = {j.running_on: j.job_id for j in self.jobs.values() if j.running_on}
        return tuple(WorkerView(f"w{k}", True, busy.get(f"w{k}"), NORMAL_WORKER_QUEUES, "cpu")
                     for k in range(self.workers))

    def _set(self, job_id: str, **changes: object) -> None:
        self.jobs[job_id] = replace(self.jobs[job_id], **changes)  # type: ignore[arg-type]

    def _apply(self, plan: TickPlan) -> None:
        for expiry in plan.expire:
            del self.jobs[expiry.job_id]
        for job_id in plan.suspend:
            self._set(job_id, state=JobState.SUSPENDED)
        for job_id in plan.standby:
            self._set(job_id, queue=STANDBY_QUEUE)
        for job_id in plan.preempt:
            self._set(job_id, preempt_requested=True)
        for job_id, mark in plan.levels.items():
            self._set(job_id, level=mark.level, level_service_s=mark.service_mark_s)
        for release in plan.releases:
            self._record_wait(release.job_id)
            self._set(release.job_id, state=JobState.QUEUED, queue=release.queue)
            self.enqueued_at[release.job_id] = self.now_s
        for requeue in plan.requeues:
            self._set(requeue.job_id, queue=requeue.to_queue)
        for retarget in plan.retargets:
            self._set(retarget.job_id, queue=retarget.to_queue)
        self.state = plan.state
        self.reserved = plan.reserved_workers

    def _record_wait(self, job_id: str) -> None:
        job = self.jobs[job_id]
        if job.state is not JobState.SUSPENDED:
            self.waits_s.append((job_id, self.now_s - job.waiting_since_s))

    def _dispatch(self) -> None:
        queued = sorted((j for j in self.jobs.values() if j.state is JobState.QUEUED),
                        key=lambda j: (_QUEUE_ORDER[j.queue or "batch"],
                                       self.enqueued_at.get(j.job_id, 0.0)))
        busy = {j.running_on for j in self.jobs.values() if j.running_on}
        for k in range(self.workers):
            name = f"w{k}"
            if name in busy:
                continue
            pick = next((j for j in queued if name not in self.reserved
                         or j.queue == REALTIME_QUEUE), None)
            if pick is None:
                continue
            queued.remove(pick)
            self._set(pick.job_id, state=JobState.RUNNING, running_on=name)

    def _work(self) -> None:
        for job in [j for j in self.jobs.values() if j.state is JobState.RUNNING]:
            self.busy_s[job.slo_class] = self.busy_s.get(job.slo_class, 0.0) + self.tick_s
            units = job.remaining_cost_units / max(job.num_chunks - job.next_chunk, 1)
            left = job.remaining_cost_units - units
            end_s = self.now_s + self.tick_s
            if job.next_chunk + 1 >= job.num_chunks:
                del self.jobs[job.job_id]
                self.done.append(job.job_id)
            elif job.preempt_requested:
                self._set(job.job_id, state=JobState.PREEMPTED, running_on=None, queue=None,
                          preempt_requested=False, preemptions=job.preemptions + 1,
                          next_chunk=job.next_chunk + 1, remaining_cost_units=left,
                          service_s=job.service_s + self.tick_s, waiting_since_s=end_s)
            else:
                self._set(job.job_id, state=JobState.QUEUED, running_on=None,
                          next_chunk=job.next_chunk + 1, remaining_cost_units=left,
                          service_s=job.service_s + self.tick_s, waiting_since_s=end_s)
                self.enqueued_at[job.job_id] = end_s


def sim_job(job_id: str, slo_class: SloClass, chunks: int, **overrides: Any) -> JobView:
    """A job of ``chunks`` chunks, one tick (0.1 s) of work each."""
    return make_job(job_id, slo_class=slo_class, num_chunks=chunks,
                    work_s=chunks * 0.1, **overrides)
