"""The autoscaler's decision, pure: scenarios, then properties over random signal sequences
(never outside MIN..MAX, no change within a cooldown, up only on sustained pressure, down only on
sustained idleness, and both eventually)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.autoscale import (
    AutoscaleError,
    Cause,
    PoolView,
    ScaleAction,
    ScalingDecision,
    ScalingMemory,
    ScalingPolicy,
    ScalingSignals,
    WorkerRange,
    check_decision_invariants,
    choose_retirees,
    decide,
    idleness_of,
    pressure_of,
    signals_from,
)
from app.stack import Autoscaler
from scheduler import AdmissionState, AdmissionStatus
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind
from tasks.errors import SettingsError
from tasks.record import JobRecord
from tasks.settings import load_settings

pytestmark = pytest.mark.timeout(120)

POLICY = ScalingPolicy(min_workers=1, max_workers=4, backlog_per_worker=1.0, max_wait_s=2.0,
                       load_high=0.7, up_after_s=2.0, down_after_s=10.0, up_cooldown_s=5.0,
                       down_cooldown_s=10.0, up_step=2, down_step=1)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pool_of(active: int, draining: int = 0) -> PoolView:
    return PoolView(active=tuple(f"w{i}@h" for i in range(1, active + 1)),
                    draining=tuple(f"d{i}@h" for i in range(1, draining + 1)))


def signals(waiting: int = 0, oldest_s: float = 0.0, load: float | None = None,
            busy: tuple[str, ...] = ()) -> ScalingSignals:
    return ScalingSignals(waiting_jobs=waiting, oldest_wait_s=oldest_s, load=load,
                          busy_workers=frozenset(busy))


def busy_all(pool: PoolView) -> tuple[str, ...]:
    return pool.active + pool.draining


def run_constant(s: ScalingSignals, pool: PoolView, times_s: list[float],
                 policy: ScalingPolicy = POLICY) -> list[ScalingDecision]:
    """The same signals at each time, the pool left as it is; the decisions taken."""
    memory, out = ScalingMemory(), []
    for now_s in times_s:
        decision = decide(s, pool, policy, memory, now_s)
        check_decision_invariants(decision, pool, policy)
        memory = decision.memory
        out.append(decision)
    return out


# scenarios -------------------------------------------------------------------------------------
def test_a_backlog_held_for_up_after_adds_workers_up_to_the_step() -> None:
    # given one busy worker and five jobs waiting, from t=0
    pool = pool_of(1)
    # when the backlog holds at t=0, 1 and 2 s (up_after 2 s)
    decisions = run_constant(signals(waiting=5, busy=busy_all(pool)), pool, [0.0, 1.0, 2.0])
    # then nothing happens until it has held 2 s, and then two workers (the step) are added
    assert [d.action for d in decisions] == [ScaleAction.HOLD, ScaleAction.HOLD, ScaleAction.UP]
    assert decisions[0].cause is Cause.NOT_SUSTAINED
    up = decisions[-1]
    assert (up.cause, up.workers_from, up.workers_to) == (Cause.BACKLOG, 1, 3)
    assert "5 jobs waiting for 1 workers" in up.reason and "for 2.0s" in up.reason


def test_a_backlog_shorter_than_up_after_adds_nothing() -> None:
    # given a backlog at t=0 and 1 s that is gone at 1.5 s and back at 2.5 s
    pool, memory = pool_of(1), ScalingMemory()
    busy = busy_all(pool)
    sequence = [(0.0, 5), (1.0, 5), (1.5, 0), (2.5, 5), (3.5, 5)]
    actions = []
    for now_s, waiting in sequence:
        d = decide(signals(waiting=waiting, busy=busy), pool, POLICY, memory, now_s)
        memory = d.memory
        actions.append(d.action)
    # then the interruption restarted the clock: no worker was added
    assert set(actions) == {ScaleAction.HOLD}
    assert memory.pressure_since_s == 2.5


def test_an_old_wait_adds_one_worker_even_when_the_backlog_is_small() -> None:
    # given two busy workers and one job that has waited 3 s (max_wait 2 s)
    pool = pool_of(2)
    decisions = run_constant(signals(waiting=1, oldest_s=3.0, busy=busy_all(pool)), pool,
                             [0.0, 2.0])
    # then one worker is added, for the old wait
    assert (decisions[-1].action, decisions[-1].cause) == (ScaleAction.UP, Cause.OLD_WAIT)
    assert decisions[-1].workers_to == 3


def test_high_load_adds_workers_only_while_jobs_wait() -> None:
    # given two busy workers, load 1.5 (above load_high 0.7)
    pool = pool_of(2)
    busy = busy_all(pool)
    # when one job waits, briefly, the load decides; when none waits, more workers cannot help
    with_waiting = run_constant(signals(waiting=1, load=1.5, busy=busy), pool, [0.0, 2.0])
    without = run_constant(signals(waiting=0, load=1.5, busy=busy), pool, [0.0, 2.0, 60.0])
    assert (with_waiting[-1].action, with_waiting[-1].cause) == (ScaleAction.UP, Cause.HIGH_LOAD)
    assert {d.action for d in without} == {ScaleAction.HOLD}
    assert {d.cause for d in without} == {Cause.STEADY}


def test_pressure_at_max_holds_and_counts_draining_workers() -> None:
    # given three active workers and one still draining (MAX 4), all busy, with a backlog
    pool = pool_of(3, draining=1)
    decisions = run_constant(signals(waiting=9, busy=busy_all(pool)), pool, [0.0, 5.0])
    # then no worker is added: the draining one still holds the fourth slot
    assert decisions[-1].action is ScaleAction.HOLD and decisions[-1].cause is Cause.AT_MAX
    assert "1 draining" in decisions[-1].reason


def test_no_worker_is_added_within_the_up_cooldown() -> None:
    # given a worker added at t=2 under a lasting backlog (up_cooldown 5 s)
    pool, memory = pool_of(1), ScalingMemory()
    s = signals(waiting=20, busy=("w1@h",))
    actions = []
    for now_s in (0.0, 2.0, 3.0, 6.9, 7.0):
        d = decide(s, pool, POLICY, memory, now_s)
        check_decision_invariants(d, pool, POLICY)
        memory = d.memory
        if d.action is ScaleAction.UP:
            pool = pool_of(d.workers_to)
            s = replace(s, busy_workers=frozenset(busy_all(pool)))
        actions.append((d.action, d.cause))
    # then the next one comes only at t=7
    assert actions == [(ScaleAction.HOLD, Cause.NOT_SUSTAINED), (ScaleAction.UP, Cause.BACKLOG),
                       (ScaleAction.HOLD, Cause.COOLDOWN), (ScaleAction.HOLD, Cause.COOLDOWN),
                       (ScaleAction.UP, Cause.BACKLOG)]
    assert len(pool.active) == 4


def test_sustained_idleness_drains_the_newest_idle_worker() -> None:
    # given three workers, only the newest busy, nothing waiting, for 10 s (down_after)
    pool = pool_of(3)
    decisions = run_constant(signals(busy=("w3@h",)), pool, [0.0, 5.0, 10.0])
    # then one worker (the step) is drained: the newest of the idle ones
    down = decisions[-1]
    assert (down.action, down.cause, down.retire) == (ScaleAction.DOWN, Cause.IDLE, ("w2@h",))
    assert down.workers_to == 2 and "2 of 3 workers have no job to run" in down.reason


def test_idleness_never_drains_below_min_or_below_the_jobs_in_the_system() -> None:
    # given MIN 2 with three workers, two running jobs and one job waiting (between chunks)
    policy = replace(POLICY, min_workers=2, down_step=3)
    pool = pool_of(4)
    decisions = run_constant(signals(waiting=1, busy=("w1@h", "w2@h")), pool, [0.0, 10.0], policy)
    # then only the one worker without a job goes
    assert decisions[-1].action is ScaleAction.DOWN and decisions[-1].workers_to == 3
    # and at MIN an idle pool just holds
    at_min = run_constant(signals(), pool_of(2), [0.0, 30.0], policy)
    assert (at_min[-1].action, at_min[-1].cause) == (ScaleAction.HOLD, Cause.AT_MIN)


def test_a_chunk_between_two_workers_is_not_idleness() -> None:
    # given two workers, one running a job, the other job between chunks (QUEUED, waiting)
    pool = pool_of(2)
    s = signals(waiting=1, oldest_s=0.01, busy=("w1@h",))
    # then no worker counts as spare: both jobs need one
    assert idleness_of(s, pool) is None
    assert pressure_of(s, pool, POLICY) is None  # nor is it a backlog (1 < 1 per worker x 2)


def test_a_job_running_on_a_draining_worker_still_needs_a_worker() -> None:
    # given one active idle worker and one draining worker whose job will need a worker again
    pool = pool_of(1, draining=1)
    s = signals(busy=("d1@h",))
    # then the active worker is not spare
    assert idleness_of(s, pool) is None


def test_busy_workers_are_drained_last_and_the_oldest_kept() -> None:
    active = ("w1", "w2", "w3", "w4")
    assert choose_retirees(active, {"w4", "w2"}, 1) == ("w3",)
    assert choose_retirees(active, {"w4", "w2"}, 3) == ("w3", "w1", "w4")
    assert choose_retirees(active, set(), 2) == ("w4", "w3")


def test_a_pool_outside_the_bounds_is_repaired_at_once_despite_cooldowns() -> None:
    memory = ScalingMemory(last_change_at_s=99.0)
    below = decide(signals(), pool_of(0), replace(POLICY, min_workers=2), memory, 100.0)
    above = decide(signals(busy=("w5@h",)), pool_of(6), POLICY, memory, 100.0)
    assert (below.action, below.cause, below.workers_to) == (ScaleAction.UP, Cause.BELOW_MIN, 2)
    assert (above.action, above.cause, above.workers_to) == (ScaleAction.DOWN, Cause.ABOVE_MAX, 4)
    assert above.retire == ("w6@h", "w4@h")  # idle ones first, the busy w5 kept


def test_unreadable_signals_hold_and_restart_the_timers() -> None:
    memory = ScalingMemory(pressure_since_s=0.0, idle_since_s=None, last_change_at_s=-50.0)
    d = decide(None, pool_of(2), POLICY, memory, 10.0)
    assert (d.action, d.cause) == (ScaleAction.HOLD, Cause.NO_SIGNALS)
    assert d.memory == ScalingMemory(last_change_at_s=-50.0)


def test_a_decision_reads_as_one_line_with_its_reason() -> None:
    pool = pool_of(1)
    up = run_constant(signals(waiting=5, oldest_s=1.0, load=1.25, busy=busy_all(pool)), pool,
                      [0.0, 2.0])[-1]
    assert up.describe() == ("1 -> 3 workers (up, backlog): 5 jobs waiting for 1 workers "
                             "(>= 1 per worker), for 2.0s; load 1.25")


def test_an_invariant_breach_is_caught() -> None:
    bad = ScalingDecision(ScaleAction.UP, Cause.BACKLOG, 4, 5, "too many")
    with pytest.raises(AutoscaleError, match="outside 1:4"):
        check_decision_invariants(bad, pool_of(4), POLICY)


def test_decisions_come_every_interval_and_a_late_pass_is_skipped_not_made_up() -> None:
    loop = Autoscaler(POLICY, interval_s=1.0)
    due = [t for t in (0.0, 0.5, 1.0, 1.2, 2.0, 5.7, 5.9, 6.0, 6.7) if loop.due(t)]
    assert due == [0.0, 1.0, 2.0, 5.7, 6.7]  # after the stall at 2..5.7: no burst


def test_every_change_is_reported_and_a_hold_once_per_cause() -> None:
    loop = Autoscaler(POLICY, interval_s=1.0)
    hold = ScalingDecision(ScaleAction.HOLD, Cause.COOLDOWN, 2, 2, "cooling")
    up = ScalingDecision(ScaleAction.UP, Cause.BACKLOG, 2, 3, "backlog")
    reported = [loop.worth_reporting(d) for d in (hold, hold, up, up, hold, hold)]
    assert reported == [True, False, True, True, True, False]


# reading signals from records ------------------------------------------------------------------
def record(job_id: str, state: JobState, **fields: object) -> JobRecord:
    base: dict[str, object] = dict(
        job_id=job_id, kind=JobKind.SIMULATED, slo=SloClass.BATCH, tenant="t", params={},
        submitted_at_s=100.0, deadline_at_s=1000.0, num_chunks=4, cost_key="simulated",
        cost_units=(0.1,) * 4, state=state, next_chunk=0, seq=0, epoch=0, queue="batch",
        updated_at_s=100.0)
    return JobRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_signals_count_jobs_that_want_a_worker_and_age_them_as_the_scheduler_does() -> None:
    records = [
        record("a", JobState.PENDING, submitted_at_s=100.0),
        record("b", JobState.QUEUED, submitted_at_s=90.0, queued_at_s=108.0),
        record("c", JobState.PREEMPTED, preempted_at_s=104.0),
        record("d", JobState.RUNNING, running_on="w1@h"),
        record("e", JobState.PENDING, submitted_at_s=50.0, depends_on=("d",)),  # blocked
        record("f", JobState.PENDING, submitted_at_s=101.0, depends_on=("gone",)),
        record("g", JobState.SUSPENDED, submitted_at_s=102.0),
    ]
    status = AdmissionStatus(AdmissionState.OPEN, load=0.9, retry_after_s=0.0,
                             measured_at_s=109.5)
    s = signals_from(records, status, now_s=110.0, load_ttl_s=2.0)
    assert s.waiting_jobs == 5  # a, b, c, f, g (e waits on a live dependency)
    assert s.oldest_wait_s == pytest.approx(10.0)  # a, since its submission
    assert s.busy_workers == frozenset({"w1@h"}) and s.load == 0.9
    stale = signals_from(records, status, now_s=120.0, load_ttl_s=2.0)
    assert stale.load is None and signals_from([], None, 0.0, 2.0).oldest_wait_s == 0.0


# the command line and the settings ---------------------------------------------------------------
@pytest.mark.parametrize(("text", "low", "high"), [("3", 3, 3), ("1:4", 1, 4), (" 2:2 ", 2, 2)])
def test_workers_reads_a_count_or_a_range(text: str, low: int, high: int) -> None:
    parsed = WorkerRange.parse(text)
    assert (parsed.min_workers, parsed.max_workers) == (low, high)
    assert parsed.fixed is (low == high)


@pytest.mark.parametrize("text", ["0", "4:1", "1:65", "a", "1:", ":3", "1:2:3"])
def test_a_bad_workers_value_says_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match="MIN"):
        WorkerRange.parse(text)


def test_autoscale_settings_load_from_the_tree_and_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_SERVICE__AUTOSCALE__UP_COOLDOWN", "250ms")
    scaling = load_settings().service.autoscale
    policy = ScalingPolicy.from_settings(scaling, WorkerRange(1, 3))
    assert policy.up_cooldown_s == pytest.approx(0.25)
    assert (policy.down_after_s, policy.max_workers, policy.up_step) == (30.0, 3, 2)


def test_a_drain_timeout_not_above_the_yield_request_is_rejected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_SERVICE__AUTOSCALE__DRAIN_TIMEOUT", "5s")
    with pytest.raises(SettingsError, match=r"service\.autoscale.*drain_timeout"):
        load_settings()


def test_an_out_of_bound_autoscale_value_names_key_and_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_SERVICE__AUTOSCALE__UP_STEP", "0")
    with pytest.raises(SettingsError, match=r"service\.autoscale\.up_step.*1"):
        load_settings()


# properties --------------------------------------------------------------------------------------
@dataclass
class Trace:
    """A simulated run: the pool follows every decision; draining workers exit when told."""

    policy: ScalingPolicy
    active: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    memory: ScalingMemory = field(default_factory=ScalingMemory)
    spawned: int = 0
    log: list[tuple[float, ScalingDecision, bool, bool, int]] = field(default_factory=list)
    """(time, decision, pressure seen, idleness seen, jobs waiting)."""

    def __post_init__(self) -> None:
        for _ in range(self.policy.min_workers):
            self.start()

    def start(self) -> None:
        self.spawned += 1
        self.active.append(f"w{self.spawned}")

    def step(self, now_s: float, waiting: int, oldest_s: float, load: float | None,
             busy_share: float, drains_end: bool, readable: bool = True) -> ScalingDecision:
        if drains_end:
            self.draining.clear()
        everyone = self.active + self.draining
        busy = frozenset(everyone[:math.floor(busy_share * len(everyone))])
        s = ScalingSignals(waiting, oldest_s if waiting else 0.0, load, busy)
        pool = PoolView(tuple(self.active), tuple(self.draining))
        decision = decide(s if readable else None, pool, self.policy, self.memory, now_s)
        check_decision_invariants(decision, pool, self.policy)
        self.log.append((now_s, decision,
                         readable and pressure_of(s, pool, self.policy) is not None,
                         readable and idleness_of(s, pool) is not None, waiting))
        self.memory = decision.memory
        for _ in range(decision.workers_to - decision.workers_from):
            self.start()
        for name in decision.retire:
            self.active.remove(name)
            self.draining.append(name)
        return decision


policies = st.builds(
    lambda low, extra, up_after, down_after, up_cd, down_cd, up_step, down_step, per, wait: (
        ScalingPolicy(min_workers=low, max_workers=low + extra, backlog_per_worker=per,
                      max_wait_s=wait, up_after_s=up_after, down_after_s=down_after,
                      up_cooldown_s=up_cd, down_cooldown_s=down_cd, up_step=up_step,
                      down_step=down_step)),
    st.integers(1, 4), st.integers(0, 6), st.floats(0, 5), st.floats(0, 20), st.floats(0, 10),
    st.floats(0, 20), st.integers(1, 4), st.integers(1, 3), st.floats(0.25, 4), st.floats(0.1, 10),
)
Sample = tuple[float, int, float, float | None, float, bool, bool]
sample = st.tuples(
    st.floats(0.05, 4.0),  # time to the next sample
    st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 30)),  # jobs waiting
    st.floats(0, 20),  # oldest wait
    st.one_of(st.none(), st.floats(0, 3)),  # load
    st.floats(0, 1),  # share of workers busy
    st.booleans(),  # draining workers have exited
    st.sampled_from([True] * 9 + [False]),  # the signals could be read
)
# Phases: one sample repeated, so that pressure and idleness last long enough to act on.
phases = st.lists(st.tuples(sample, st.integers(1, 20)), min_size=1, max_size=12).map(
    lambda runs: [s for s, times in runs for _ in range(times)])


def _run(policy: ScalingPolicy, steps: list[Sample]) -> Trace:
    trace, now_s = Trace(policy), 1000.0
    for dt, waiting, oldest_s, load, busy_share, drains_end, readable in steps:
        now_s += dt
        trace.step(now_s, waiting, oldest_s, load, busy_share, drains_end, readable)
        assert policy.min_workers <= len(trace.active) <= policy.max_workers
        assert len(trace.active) + len(trace.draining) <= policy.max_workers
    return trace


@PROPS
@given(policy=policies, steps=phases)
def test_the_pool_stays_within_min_and_max_counting_draining_workers(
        policy: ScalingPolicy, steps: list[Sample]
) -> None:
    _run(policy, steps)  # the bounds are asserted after every step


@PROPS
@given(policy=policies, steps=phases)
def test_no_change_comes_within_the_cooldown_of_the_last(
        policy: ScalingPolicy, steps: list[Sample]
) -> None:
    changes = [(t, d.action) for t, d, *_ in _run(policy, steps).log
               if d.action is not ScaleAction.HOLD]
    for (before_s, _), (at_s, action) in pairwise(changes):
        cooldown_s = policy.up_cooldown_s if action is ScaleAction.UP else policy.down_cooldown_s
        assert at_s - before_s >= cooldown_s - 1e-9


@PROPS
@given(policy=policies, steps=phases)
def test_up_only_on_sustained_pressure_with_jobs_waiting_down_only_on_sustained_idleness(
        policy: ScalingPolicy, steps: list[Sample]
) -> None:
    log = _run(policy, steps).log
    for i, (at_s, decision, _, _, waiting) in enumerate(log):
        if decision.action is ScaleAction.HOLD:
            continue
        assert decision.action is ScaleAction.DOWN or waiting > 0, "up with no job waiting"
        seen = 2 if decision.action is ScaleAction.UP else 3
        needed_s = policy.up_after_s if decision.action is ScaleAction.UP else policy.down_after_s
        first = i
        while first > 0 and log[first - 1][seen]:
            first -= 1
        assert log[i][seen], "a change without the condition it answers"
        assert at_s - log[first][0] >= needed_s - 1e-9, "the condition did not hold long enough"


@PROPS
@given(policy=policies, interval_s=st.floats(0.1, 2.0))
def test_a_lasting_backlog_reaches_max_and_lasting_idleness_returns_to_min(
        policy: ScalingPolicy, interval_s: float) -> None:
    trace, now_s = Trace(policy), 0.0
    ups = math.ceil((policy.max_workers - policy.min_workers) / policy.up_step)
    up_by_s = policy.up_after_s + ups * (policy.up_cooldown_s + interval_s) + 2 * interval_s
    while now_s <= up_by_s:
        trace.step(now_s, 100, 30.0, 2.0, busy_share=1.0, drains_end=True)
        now_s += interval_s
    assert len(trace.active) == policy.max_workers

    downs = math.ceil((policy.max_workers - policy.min_workers) / policy.down_step)
    down_by_s = now_s + policy.down_after_s + downs * (policy.down_cooldown_s + interval_s) + (
        2 * interval_s)
    while now_s <= down_by_s:
        trace.step(now_s, 0, 0.0, 0.0, busy_share=0.0, drains_end=True)
        now_s += interval_s
    assert len(trace.active) == policy.min_workers
