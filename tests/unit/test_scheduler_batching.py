"""Step-level batching in the plan: compatible jobs share a slot, deadlines and the origin come
first, exact work runs alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import (
    JobState,
    JobView,
    PolicyConfig,
    PolicyState,
    SloClass,
    TickPlan,
    Tier,
    check_plan_invariants,
    plan_tick,
)
from scheduler.batching import (
    BatchingConfig,
    SlotPacker,
    batch_cost_key,
    batch_slowdown,
    learned_growth,
)
from scheduler.cost import CostModel
from scheduler.errors import InvalidPolicy
from scheduler.plan import Retarget
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running

pytestmark = pytest.mark.timeout(30)

POLICY = PolicyConfig()


def _waiting(job_id: str, work_s: float = 20.0, group: str | None = "g",
             **kw: object) -> JobView:
    return make_job(job_id, slo_class=SloClass.INTERACTIVE, work_s=work_s, batch_group=group,
                    deadline_s=NOW_S + 600, **kw)


def _batches(plan: TickPlan) -> dict[str | None, list[str]]:
    found: dict[str | None, list[str]] = {}
    for rel in plan.releases:
        found.setdefault(rel.batch, []).append(rel.job_id)
    return found


def test_compatible_waiting_jobs_fill_one_slot_as_one_new_batch() -> None:
    # given one worker and four waiting jobs of one batch group
    snapshot = make_snapshot([_waiting(f"j{k}") for k in range(4)], workers=1)
    # when the tick plans
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then all four are released into one new batch, and the plan keeps its invariants
    batches = _batches(plan)
    assert len(batches) == 1 and None not in batches
    assert sorted(next(iter(batches.values()))) == ["j0", "j1", "j2", "j3"]
    assert not any(rel.join for rel in plan.releases)
    check_plan_invariants(plan, snapshot, POLICY)


def test_work_queued_on_standby_is_restored_alone_never_into_a_new_batch() -> None:
    # given one worker, a waiting job, and a compatible one queued on standby (overload put it
    # there): a restore is a move of its queued message, which carries it alone
    parked = _waiting("s0", state=JobState.QUEUED, queue="standby", level=2)
    snapshot = make_snapshot([_waiting("j0"), parked], workers=1)
    # when the tick plans
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then whatever it restores or releases fits the one slot: the parked job is never a
    # member of a released batch (found by the property test: 5 slots for capacity 4)
    check_plan_invariants(plan, snapshot, POLICY)
    restored = {r.job_id for r in plan.requeues if r.from_queue == "standby"}
    released = {r.job_id for r in plan.releases}
    assert len(restored) + len({r.batch or r.job_id for r in plan.releases}) <= 1
    assert "s0" not in released


def test_a_batch_never_exceeds_max_batch() -> None:
    policy = replace(POLICY, batching=BatchingConfig(max_batch=4, growth={"simulated": 0.2}))
    snapshot = make_snapshot([_waiting(f"j{k}") for k in range(10)], workers=2)
    plan = plan_tick(snapshot, policy, NOW_S)
    sizes = sorted(len(members) for members in _batches(plan).values())
    assert sizes == [4, 4]


def test_a_waiting_job_joins_a_compatible_batch_in_flight() -> None:
    # given a batch of two running on the only worker
    members = [running(f"b{k}", "w0", queue="interactive", level=1, batch_group="g",
                       batch_id="batch-1", slo_class=SloClass.INTERACTIVE,
                       deadline_s=NOW_S + 600) for k in range(2)]
    snapshot = make_snapshot([*members, _waiting("new", level=1)], workers=1)
    # when a compatible job waits
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then it joins the batch in flight rather than waiting for the worker
    (rel,) = plan.releases
    assert (rel.job_id, rel.batch, rel.join) == ("new", "batch-1", True)
    check_plan_invariants(plan, snapshot, POLICY)


def test_a_job_whose_deadline_cannot_absorb_the_longer_step_runs_alone() -> None:
    # given a batch in flight on w0 and a free w1; a job with 0.05 s of slack over 1 s of work
    members = [running(f"b{k}", "w0", queue="interactive", level=1, batch_group="g",
                       batch_id="batch-1", slo_class=SloClass.INTERACTIVE, work_s=30.0,
                       deadline_s=NOW_S + 600) for k in range(3)]
    tight = make_job("tight", slo_class=SloClass.INTERACTIVE, work_s=1.0, batch_group="g",
                     deadline_s=NOW_S + 1.2)
    snapshot = make_snapshot([*members, tight], workers=2)
    # when the tick plans (a batch of 4 steps 1.6x slower: 0.6 s more than alone)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then the job runs in a batch of its own, on the free worker
    (rel,) = plan.releases
    assert rel.job_id == "tight" and rel.batch != "batch-1" and not rel.join


def test_the_origin_runs_alone_and_nothing_joins_it() -> None:
    jobs = [_waiting(f"j{k}") for k in range(3)]
    snapshot = make_snapshot(jobs, workers=2, state=PolicyState(origin_id="j0"))
    plan = plan_tick(snapshot, POLICY, NOW_S)
    if plan.origin_id == "j0":
        origin = next(r for r in plan.releases if r.job_id == "j0")
        assert origin.batch is None
        assert sorted(_batches(plan).get(None, [])) == ["j0"]


def test_exact_jobs_and_models_where_batching_does_not_pay_run_alone() -> None:
    exact = [_waiting(f"e{k}", group=None) for k in range(2)]
    video = [_waiting(f"v{k}", cost_key="video-480p") for k in range(2)]
    snapshot = make_snapshot([*exact, *video], workers=4)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    assert all(rel.batch is None for rel in plan.releases)
    assert len(plan.releases) == 4


def test_batching_off_releases_one_job_per_slot() -> None:
    policy = replace(POLICY, batching=BatchingConfig(enabled=False))
    snapshot = make_snapshot([_waiting(f"j{k}") for k in range(4)], workers=1)
    plan = plan_tick(snapshot, policy, NOW_S)
    assert [rel.batch for rel in plan.releases] == [None]


def test_a_running_job_of_another_batch_is_never_merged() -> None:
    # given two batches of one group in flight on two workers
    a = running("a", "w0", queue="interactive", level=1, batch_group="g", batch_id="A",
                slo_class=SloClass.INTERACTIVE, deadline_s=NOW_S + 600)
    b = running("b", "w1", queue="interactive", level=1, batch_group="g", batch_id="B",
                slo_class=SloClass.INTERACTIVE, deadline_s=NOW_S + 600)
    plan = plan_tick(make_snapshot([a, b], workers=2), POLICY, NOW_S)
    # then both stay where they are: no release, no preemption
    assert not plan.releases and not plan.preempt and not plan.standby


def test_the_packer_checks_every_member_against_the_longer_step() -> None:
    config = BatchingConfig(max_batch=8, growth={"m": 0.5})
    slack = {0: 10.0, 1: 0.4, 2: 10.0, 3: 0.1}
    remaining = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    packer = SlotPacker(config, cap=2, slack_s=slack.__getitem__,
                        remaining_s=remaining.__getitem__)
    group = ("g", "interactive")
    first = packer.add(0, group, 0.5)
    # member 1 has 0.4 s of slack: a batch of 2 costs it 0.5 s more, so it opens its own slot
    second = packer.add(1, group, 0.5)
    third = packer.add(2, group, 0.5)
    assert first is not None and second is not None and first is not second
    assert third is first  # the first slot still fits a second member
    # a job with 0.1 s of slack fits no batch, and all slots are taken
    assert packer.add(3, group, 0.5) is None
    assert packer.slots == [first, second] and first.members == [0, 2]


def test_batch_slowdown_and_config_bounds() -> None:
    assert batch_slowdown(0.25, 1) == 1.0
    assert batch_slowdown(0.25, 5) == 2.0
    assert BatchingConfig(growth={"a": 0.1, "ab": 0.3}).growth_of("abc:1") == 0.3
    assert not BatchingConfig().pays(1.0) and BatchingConfig().pays(0.5)
    assert not BatchingConfig(enabled=False).pays(0.5)
    with pytest.raises(InvalidPolicy):
        BatchingConfig(max_batch=0)
    with pytest.raises(InvalidPolicy):
        BatchingConfig(growth={"a": -1.0})


def test_jobs_in_flight_with_a_preempt_flag_leave_their_batch() -> None:
    leaving = running("x", "w0", queue="interactive", level=1, batch_group="g", batch_id="A",
                      slo_class=SloClass.INTERACTIVE, deadline_s=NOW_S + 600,
                      preempt_requested=True)
    staying = running("y", "w0", queue="interactive", level=1, batch_group="g", batch_id="A",
                      slo_class=SloClass.INTERACTIVE, deadline_s=NOW_S + 600)
    snapshot = make_snapshot([leaving, staying, _waiting("z", level=1)], workers=1)
    plan = plan_tick(snapshot, POLICY, NOW_S)
    check_plan_invariants(plan, snapshot, POLICY)
    assert all(r.job_id != "x" for r in plan.releases)
    assert JobState.RUNNING is staying.state


def test_an_origin_inside_a_shared_batch_leaves_it_for_the_realtime_queue() -> None:
    # given a running batch of three; one member, a gold realtime job, is close to its deadline
    members = [running(f"b{k}", "w0", queue="interactive", level=1, batch_group="g",
                       batch_id="A",
                       slo_class=SloClass.REALTIME if k == 0 else SloClass.INTERACTIVE,
                       tier=Tier.GOLD if k == 0 else Tier.STANDARD,
                       deadline_s=NOW_S + (1.2 if k == 0 else 600), work_s=1.0 if k == 0 else 5.0)
               for k in range(3)]
    snapshot = make_snapshot(members, workers=1, state=PolicyState(origin_id="b0"))
    # when the tick plans it as the origin
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then its next chunk leaves the batch for the realtime queue, and the others stay
    assert plan.origin_id == "b0"
    assert plan.retargets == (Retarget("b0", "interactive", "realtime"),)
    assert not plan.preempt
    check_plan_invariants(plan, snapshot, POLICY)


def _measured(lone_s: float, batched: dict[int, float], samples: int = 30) -> CostModel:
    """A cost model that timed ``m:1#denoise`` alone and in batches of each size given (often
    enough for the prior to have washed out)."""
    cost = POLICY.new_cost_model()
    for _ in range(samples):
        cost = cost.observe("m:1#denoise", "cpu", 1.0, lone_s)
        for size, step_s in batched.items():
            cost = cost.observe(batch_cost_key("m:1#denoise", size), "cpu", 1.0, step_s)
    return cost


def test_the_growth_is_learned_from_batched_and_lone_steps_of_one_chunk_kind() -> None:
    # batches of 4 take 1.6x a lone step and batches of 8 2.4x: growth 0.2 from both
    cost = _measured(0.01, {4: 0.016, 8: 0.024})
    assert learned_growth(cost, "m:1#denoise", 8, 3) == pytest.approx(0.2, rel=0.02)
    # too few samples, or no batch size timed: nothing learned
    assert learned_growth(_measured(0.01, {4: 0.016}, samples=2), "m:1#denoise", 8, 3) is None
    assert learned_growth(_measured(0.01, {}), "m:1#denoise", 8, 3) is None


def test_a_model_the_table_does_not_know_batches_once_its_growth_is_measured() -> None:
    # given jobs of a model with no growth entry (batching assumed to gain nothing)
    jobs = [_waiting(f"j{k}", cost_key="m:1", remaining_units_by_key=(("m:1#denoise", 20.0),))
            for k in range(4)]
    unmeasured = replace(make_snapshot(jobs, workers=1), cost=_measured(0.01, {}))
    measured = replace(unmeasured, cost=_measured(0.01, {4: 0.016}))
    # when the tick plans before and after batched steps were timed
    before = plan_tick(unmeasured, POLICY, NOW_S)
    after = plan_tick(measured, POLICY, NOW_S)
    # then one job runs alone at first; once measured (growth 0.2), all four share the slot
    assert [r.batch for r in before.releases] == [None]
    assert len(after.releases) == 4 and len({r.batch for r in after.releases}) == 1
    assert None not in {r.batch for r in after.releases}
    # and with learning off, the table still rules
    off = replace(POLICY, batching=BatchingConfig(learn=False))
    assert [r.batch for r in plan_tick(measured, off, NOW_S).releases] == [None]
