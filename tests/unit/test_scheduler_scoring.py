"""Origin scoring and origin selection."""

from __future__ import annotations

from dataclasses import astuple

import pytest
from hypothesis import given, settings

from scheduler import JobState, PolicyConfig, PolicyState, SloClass, Tier, plan_tick
from scheduler.scoring import (
    score_dimensions,
    score_job,
    score_jobs,
    select_origin,
    weighted_score,
)
from tests.unit.test_scheduler_support import NOW_S, make_job, make_snapshot, running, snapshots

pytestmark = pytest.mark.timeout(30)
POLICY = PolicyConfig()


@settings(max_examples=100, deadline=None)
@given(snapshot=snapshots())
def test_fast_scores_equal_the_readable_definition_and_stay_in_unit_range(snapshot) -> None:  # type: ignore[no-untyped-def]
    jobs = [j for j in snapshot.jobs if not j.state.is_terminal]
    remaining = [j.remaining_cost_units * 0.01 for j in jobs]
    fast = score_jobs(jobs, remaining, POLICY, NOW_S)
    for job, rem, score in zip(jobs, remaining, fast, strict=True):
        dims = score_dimensions(job, rem, POLICY, NOW_S)
        assert all(0.0 <= d <= 1.0 for d in astuple(dims))
        assert score == pytest.approx(weighted_score(dims, POLICY), abs=1e-9)
        assert 0.0 <= score <= 1.0 + 1e-9


def test_gold_tenant_scores_above_an_otherwise_identical_standard_one() -> None:
    gold = make_job("g", tier=Tier.GOLD)
    standard = make_job("s", tier=Tier.STANDARD)
    assert score_job(gold, 0.5, POLICY, NOW_S) > score_job(standard, 0.5, POLICY, NOW_S)


def test_a_job_closer_to_its_deadline_scores_higher() -> None:
    relaxed = make_job("r", deadline_s=NOW_S + 100)
    tight = make_job("t", deadline_s=NOW_S + 1)
    assert score_job(tight, 0.5, POLICY, NOW_S) > score_job(relaxed, 0.5, POLICY, NOW_S)


def test_there_are_at_least_eight_score_dimensions() -> None:
    dims = score_dimensions(make_job("a"), 0.5, POLICY, NOW_S)
    assert len(astuple(dims)) >= 8


def test_challenger_must_beat_the_incumbent_origin_by_the_margin() -> None:
    # given an incumbent at 0.70 and a margin of 0.05
    incumbent = ("old", 0.70)
    # when a challenger scores 0.74, then 0.76
    held = select_origin([("new", 0.74)], incumbent, threshold=0.5, margin=0.05)
    taken = select_origin([("new", 0.76)], incumbent, threshold=0.5, margin=0.05)
    # then the first does not take over and the second does
    assert held == incumbent
    assert taken == ("new", 0.76)


def test_no_origin_when_every_score_is_below_the_threshold() -> None:
    assert select_origin([("a", 0.3)], None, threshold=0.5, margin=0.05) is None


def test_origin_threshold_falls_as_load_rises() -> None:
    assert POLICY.origin_threshold(0.0) > POLICY.origin_threshold(1.0)
    assert POLICY.origin_threshold(5.0) == POLICY.origin_threshold(1.0)


def test_tick_keeps_the_previous_origin_when_a_challenger_is_only_slightly_better() -> None:
    # given last tick's origin "a", and "b" scoring a hair higher now
    a = make_job("a", slo_class=SloClass.REALTIME, tier=Tier.GOLD, deadline_s=NOW_S + 0.5)
    b = make_job("b", slo_class=SloClass.REALTIME, tier=Tier.GOLD, deadline_s=NOW_S + 0.49)
    snapshot = make_snapshot([a, b], state=PolicyState(origin_id="a", origin_since_s=NOW_S - 1))
    # when the tick runs
    plan = plan_tick(snapshot, POLICY, NOW_S)
    # then the origin stays "a" and keeps its start time
    assert plan.origin_id == "a"
    assert plan.state.origin_since_s == NOW_S - 1


def test_running_job_can_be_the_origin() -> None:
    job = running("r", "w0", slo_class=SloClass.REALTIME, queue="realtime", level=0,
                  tier=Tier.GOLD, deadline_s=NOW_S + 0.3)
    plan = plan_tick(make_snapshot([job]), POLICY, NOW_S)
    assert plan.origin_id == "r"
    assert plan.top_scores[0][0] == "r"
    assert job.state is JobState.RUNNING


@settings(max_examples=100, deadline=None)
@given(snapshot=snapshots())
def test_survey_scores_equal_score_jobs(snapshot) -> None:  # type: ignore[no-untyped-def]
    # given the tick's one fused pass over the jobs
    from scheduler.survey import survey_jobs

    alive = [w for w in snapshot.workers if w.alive]
    sv = survey_jobs(snapshot, alive, POLICY, NOW_S)
    # then its inline scores are exactly score_jobs' (the same floats, not just close)
    assert list(sv.scores) == score_jobs(sv.live, sv.remaining_s, POLICY, NOW_S)
