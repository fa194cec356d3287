"""The planner held across ticks plans what ``plan_tick`` plans, tick after tick.

A Hypothesis state machine plays a history: jobs arrive, change state, make progress, finish,
are re-read unchanged (a new view object with equal fields) or reordered; the clock advances,
the cost model learns, workers die and come back, the policy changes. At every tick the plan of
one :class:`IncrementalPlanner` kept across the whole history equals the plan ``plan_tick``
makes from scratch — every field, floats to the bit, dicts in their order.
"""

from __future__ import annotations

import math
import random
from dataclasses import fields, is_dataclass, replace
from enum import Enum

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler import (
    ClusterSnapshot,
    JobState,
    JobView,
    PolicyConfig,
    PolicyState,
    WorkerView,
    plan_tick,
)
from scheduler.batching import BatchingConfig
from scheduler.fair_walk import lexsort3, repaired_walk
from scheduler.fairness import FairShareConfig, ServiceLedger
from scheduler.incremental import IncrementalPlanner
from scheduler.plan import TickPlan
from scheduler.policy import OverloadMeasure
from scheduler.queues import NORMAL_WORKER_QUEUES, STANDBY_QUEUE
from tests.bench.bench_tick import build_snapshot, changed, served_ledger
from tests.unit.test_scheduler_support import NOW_S, _job, make_job, make_snapshot

_POLICIES = (
    PolicyConfig(),
    PolicyConfig(aging_bound_s=2.0, late_penalty=3.0, top_scores=3, resume_per_tick=1,
                 convergence_threshold=0.5, convergence_hysteresis=0.1),
    PolicyConfig(batching=BatchingConfig(max_batch=3)),
    PolicyConfig(overload_measure=OverloadMeasure.COMPUTE, load_window_s=10.0),
    PolicyConfig(fair_share=FairShareConfig(enabled=True)),
    PolicyConfig(fair_share=FairShareConfig(enabled=True, weights={"gold": 3.0}),
                 batching=BatchingConfig(max_batch=3)),
)
_STATES = tuple(JobState)


def exact(value: object) -> object:
    """Every field of a plan, floats as their bits and dicts as ordered pairs."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return value.hex()
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,
                tuple((f.name, exact(getattr(value, f.name))) for f in fields(value)))
    if isinstance(value, tuple | list):
        return tuple(exact(v) for v in value)
    if isinstance(value, frozenset):
        return ("frozenset", tuple(sorted(value)))
    if isinstance(value, dict):
        return ("dict", tuple((exact(k), exact(v)) for k, v in value.items()))
    return value


class History(RuleBasedStateMachine):
    """One cluster's ticks, planned both ways."""

    def __init__(self) -> None:
        super().__init__()
        self.planner = IncrementalPlanner()
        self.jobs: list[JobView] = []
        self.workers: list[WorkerView] = []
        self.cost = PolicyConfig().new_cost_model()
        self.state = PolicyState()
        self.ledger = ServiceLedger()
        self.policy = _POLICIES[0]
        self.now_s = NOW_S
        self.serial = 0
        self.ticks = 0

    @initialize(workers=st.integers(0, 6), jobs=st.integers(0, 20), data=st.data())
    def start(self, workers: int, jobs: int, data: st.DataObject) -> None:
        self.workers = [WorkerView(f"w{k}", True, None, NORMAL_WORKER_QUEUES,
                                   "cpu" if k % 3 else "cuda") for k in range(workers)]
        self._arrive(jobs, data)

    def _arrive(self, count: int, data: st.DataObject) -> None:
        for _ in range(count):
            state = data.draw(st.sampled_from(_STATES))
            worker = data.draw(st.sampled_from([w.name for w in self.workers])) \
                if state is JobState.RUNNING and self.workers else None
            if state is JobState.RUNNING and worker is None:
                state = JobState.QUEUED
            job = data.draw(_job(f"j{self.serial}", state, worker, self.serial + 1))
            self.serial += 1
            # submitted around the current clock, not the first tick's
            job = replace(job, submitted_at_s=job.submitted_at_s + self.now_s - NOW_S,
                          deadline_s=job.deadline_s + self.now_s - NOW_S,
                          waiting_since_s=job.waiting_since_s + self.now_s - NOW_S)
            at = data.draw(st.integers(0, len(self.jobs)))
            self.jobs.insert(at, job)

    @rule(count=st.integers(1, 5), data=st.data())
    def arrive(self, count: int, data: st.DataObject) -> None:
        self._arrive(count, data)

    @rule(data=st.data())
    def change(self, data: st.DataObject) -> None:
        """A job's record changes: a new view of it."""
        if not self.jobs:
            return
        k = data.draw(st.integers(0, len(self.jobs) - 1))
        job = self.jobs[k]
        state = data.draw(st.sampled_from(_STATES))
        in_flight = state in (JobState.QUEUED, JobState.RUNNING)
        self.jobs[k] = replace(
            job, state=state,
            next_chunk=data.draw(st.integers(job.next_chunk, job.num_chunks)),
            remaining_cost_units=data.draw(st.floats(0.0, job.remaining_cost_units)),
            waiting_since_s=data.draw(st.sampled_from((job.waiting_since_s, self.now_s))),
            service_s=job.service_s + data.draw(st.floats(0.0, 5.0)),
            level=data.draw(st.one_of(st.none(), st.integers(0, 2))),
            level_service_s=data.draw(st.sampled_from((0.0, job.service_s))),
            queue=data.draw(st.sampled_from(("realtime", "interactive", "batch",
                                             STANDBY_QUEUE))) if in_flight else None,
            running_on=job.running_on if state is JobState.RUNNING else None,
            preempt_requested=state is JobState.RUNNING and data.draw(st.booleans()),
            preemptions=job.preemptions + data.draw(st.integers(0, 1)),
            estimated=data.draw(st.booleans()), shed_if_late=data.draw(st.booleans()),
            batch_id=job.batch_id if in_flight else None,
            load_s=data.draw(st.sampled_from((0.0, job.load_s, 8.454))))

    @rule(data=st.data())
    def reread(self, data: st.DataObject) -> None:
        """The store hands back an equal view as a new object."""
        if self.jobs:
            k = data.draw(st.integers(0, len(self.jobs) - 1))
            self.jobs[k] = replace(self.jobs[k])

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.jobs:
            k = data.draw(st.integers(0, len(self.jobs) - 1))
            if data.draw(st.booleans()):
                del self.jobs[k]
            else:
                self.jobs[k] = replace(self.jobs[k], state=JobState.DONE)

    @rule(permutation=st.permutations(range(8)))
    def reorder(self, permutation: list[int]) -> None:
        head = [self.jobs[k] for k in permutation if k < len(self.jobs)]
        self.jobs[:len(head)] = head

    @rule(dt=st.sampled_from((0.0, 0.1, 0.1, 1.0, 5.0, 30.0)))
    def advance(self, dt: float) -> None:
        self.now_s += dt

    @rule(key=st.sampled_from(("simulated", "image-256", "video-480p", "text-x")),
          device=st.sampled_from(("cpu", "cuda")), elapsed=st.floats(0.001, 10.0),
          times=st.integers(1, 4))
    def learn(self, key: str, device: str, elapsed: float, times: int) -> None:
        for _ in range(times):
            self.cost = self.cost.observe(key, device, 1.0, elapsed)

    @rule(data=st.data())
    def worker_flips(self, data: st.DataObject) -> None:
        if self.workers:
            k = data.draw(st.integers(0, len(self.workers) - 1))
            self.workers[k] = replace(self.workers[k], alive=not self.workers[k].alive)

    @rule(data=st.data(), ago=st.sampled_from((-2.0, 0.0, 5.0, 50.0, 500.0)),
          seconds=st.sampled_from((0.5, 8.454, 40.0)))
    def worker_loads(self, data: st.DataObject, ago: float, seconds: float) -> None:
        """A worker's heartbeat reports a load that ended ``ago`` seconds before now (< 0:
        under way), so the effective load counts the time the fleet pays loading."""
        if self.workers:
            k = data.draw(st.integers(0, len(self.workers) - 1))
            worker = self.workers[k]
            self.workers[k] = replace(worker, loads=(*worker.loads[-3:],
                                                     (self.now_s - ago, seconds)))

    @rule(band=st.sampled_from(("realtime", "interactive", "batch")),
          tenant=st.sampled_from(("a", "b")), tier=st.sampled_from(("gold", "standard")),
          seconds=st.sampled_from((0.1, 1.0, 7.3, 100.0)))
    def serve(self, band: str, tenant: str, tier: str, seconds: float) -> None:
        """A chunk commits: its measured seconds go to its tenant's fair-share counter."""
        self.ledger = self.ledger.charged(band, tenant, tier, seconds)

    @rule(policy=st.sampled_from(_POLICIES))
    def change_policy(self, policy: PolicyConfig) -> None:
        self.policy = policy

    @invariant()
    def plans_are_equal(self) -> None:
        snapshot = ClusterSnapshot(tuple(self.jobs), tuple(self.workers), self.cost, self.state,
                                   service=self.ledger)
        expected = plan_tick(snapshot, self.policy, self.now_s)
        got = self.planner.plan(snapshot, self.policy, self.now_s)
        assert exact(got) == exact(expected)
        self.state = _next_state(expected)
        self.ticks += 1


def _next_state(plan: TickPlan) -> PolicyState:
    return plan.state if plan.state is not None else PolicyState()


History.TestCase.settings = settings(max_examples=30, stateful_step_count=12, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestIncrementalPlannerHistory = History.TestCase


@pytest.mark.parametrize("scenario", ["steady", "converged", "overload"])
def test_plans_at_bench_scale_are_equal(scenario: str) -> None:
    """Thousands of jobs: the deferral's long stretches that fit (summed a block at a time)
    between dense ones (walked job by job), the partial sorts of the pool and the top."""
    snapshot = build_snapshot(1500, 16, scenario, seed=5)
    planner = IncrementalPlanner()
    for now_s in (1000.0, 1000.1, 1030.0):
        expected = plan_tick(snapshot, PolicyConfig(), now_s)
        assert exact(planner.plan(snapshot, PolicyConfig(), now_s)) == exact(expected)
        snapshot = replace(snapshot, state=_next_state(expected))


@pytest.mark.parametrize("scenario", ["steady", "converged", "overload"])
def test_fair_share_plans_at_bench_scale_equal_the_readable_ones_join_included(
        scenario: str) -> None:
    """Thousands of jobs of 50 tenants with served counters: the fair keys over the columns
    (dense-rank walk, padded start-tag sums, the pool's partition on start tags) and the join
    on the contending rows give the readable plan, the join's lifts and floors included."""
    # given the bench snapshot, fair share on, counters already served
    policy = PolicyConfig(fair_share=FairShareConfig(enabled=True))
    snapshot = build_snapshot(1500, 16, scenario, seed=5)
    snapshot = replace(snapshot, service=served_ledger(snapshot, seed=3))
    planner = IncrementalPlanner()
    for now_s in (1000.0, 1000.1, 1030.0):
        # when both plan the same tick
        expected = plan_tick(snapshot, policy, now_s)
        # then the plans are equal, the join too
        assert expected.fair_share is not None
        assert exact(planner.plan(snapshot, policy, now_s)) == exact(expected)
        snapshot = replace(snapshot, state=_next_state(expected),
                           service=expected.fair_share.ledger)


def test_fair_share_plans_stay_equal_to_the_readable_ones_as_views_change_between_ticks(
        ) -> None:
    """The held planner reuses the last walk and start tags where they still hold: views
    changed, finished and arrived between ticks still give the readable plan."""
    # given the bench snapshot, fair share on, counters served, a held planner
    rng = random.Random(4)
    policy = PolicyConfig(fair_share=FairShareConfig(enabled=True))
    snapshot = build_snapshot(1500, 16, "steady", seed=5)
    snapshot = replace(snapshot, service=served_ledger(snapshot, seed=3))
    planner = IncrementalPlanner()
    jobs = list(snapshot.jobs)
    for t, changes in enumerate((0, 0, 30, 0, 200, 5, 0)):
        now_s = 1000.0 + 0.1 * t
        # when some views change before the tick
        for k in rng.sample(range(len(jobs)), changes):
            jobs[k] = changed(rng, jobs[k], (t + 1) * len(jobs) + k, now_s)
        snapshot = replace(snapshot, jobs=tuple(jobs))
        expected = plan_tick(snapshot, policy, now_s)
        # then each plan equals the readable one, the join too
        assert expected.fair_share is not None
        assert exact(planner.plan(snapshot, policy, now_s)) == exact(expected)
        snapshot = replace(snapshot, state=_next_state(expected),
                           service=expected.fair_share.ledger)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from((0.0, -0.0, 1.0, 2.5, 7.0)),
                          st.sampled_from((0.0, -0.0, 1.0, 3.0)), st.integers(0, 5)),
                max_size=60), st.randoms(use_true_random=False), st.integers(0, 20))
def test_the_repaired_walk_is_the_lexsort_order(rows: list[tuple[float, float, int]],
                                               rng: random.Random, dropped: int) -> None:
    # given keys with ties and a last walk that holds some positions in any order
    k1 = np.array([r[0] for r in rows], np.float64)
    k2 = np.array([r[1] for r in rows], np.float64)
    code = np.array([r[2] for r in rows], np.int64)
    truth = np.lexsort((k2, k1, code))
    kept = [int(i) for i in truth if rng.random() > dropped / 20]
    for _ in range(rng.randrange(4)):
        if len(kept) > 1:
            a, b = rng.randrange(len(kept)), rng.randrange(len(kept))
            kept[a], kept[b] = kept[b], kept[a]
    # when the walk is repaired from it
    walk = repaired_walk(code, k1, k2, np.array(kept, np.int64))
    # then it is np.lexsort's stable order
    assert walk.tolist() == truth.tolist()


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from((0.0, -0.0, 1.0, 2.5, math.inf, 1e300)),
                          st.floats(allow_nan=False, width=16), st.integers(0, 40)),
                max_size=60))
def test_the_dense_rank_walk_is_the_lexsort_order(rows: list[tuple[float, float, int]]) -> None:
    # given keys with many ties, signed zeros and infinities
    k1 = np.array([r[0] for r in rows], np.float64)
    k2 = np.array([r[1] for r in rows], np.float64)
    code = np.array([r[2] for r in rows], np.int64)
    # when the walk is ordered by the fold of dense ranks
    walk = lexsort3(k2, k1, code)
    # then it is np.lexsort's stable order
    assert walk.tolist() == np.lexsort((k2, k1, code)).tolist()


def test_the_planner_reads_each_view_once() -> None:
    """Views seen at an earlier tick are not read again, in whatever order they come."""
    jobs = tuple(make_job(f"j{k}", submitted_at_s=NOW_S - k) for k in range(5))
    snapshot = make_snapshot(jobs, workers=2)
    planner = IncrementalPlanner()
    first = planner.plan(snapshot, PolicyConfig(), NOW_S)
    again = replace(snapshot, jobs=(*reversed(jobs), replace(jobs[0], job_id="j9")))
    second = planner.plan(again, PolicyConfig(), NOW_S + 0.1)
    assert planner.views_read == 6
    assert exact(first) == exact(plan_tick(snapshot, PolicyConfig(), NOW_S))
    assert exact(second) == exact(plan_tick(again, PolicyConfig(), NOW_S + 0.1))
