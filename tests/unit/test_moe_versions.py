"""Expert hot update: 5 % steps, rollback above 15 % degradation, three versions kept."""

from __future__ import annotations

import pytest

from workers.moe.versions import ExpertVersions, UpdateDecision, UpdatePolicy

pytestmark = pytest.mark.timeout(10)

POLICY = UpdatePolicy(traffic_step=0.05, step_interval_s=10.0, min_samples=5)


def _feed(versions: ExpertVersions, live_ms: float, cand_ms: float, cand_ok: bool = True) -> None:
    assert versions.candidate is not None
    for _ in range(5):
        versions.record(versions.live, live_ms, True)
        versions.record(versions.candidate, cand_ms, cand_ok)


def test_a_healthy_candidate_gains_five_percent_per_step_until_promoted() -> None:
    versions = ExpertVersions(live="v1", policy=POLICY)
    versions.begin_update("v2", now_s=0.0)
    now_s, decisions = 0.0, []
    while versions.candidate is not None:
        now_s += 10.0
        _feed(versions, 100.0, 105.0)
        decisions.append(versions.advance(now_s))
    assert decisions.count(UpdateDecision.STEP_UP) == 18  # 5 % -> 95 %
    assert decisions[-1] is UpdateDecision.PROMOTED and versions.live == "v2"


def test_a_step_is_held_until_enough_time_and_samples() -> None:
    versions = ExpertVersions(live="v1", policy=POLICY)
    versions.begin_update("v2", now_s=0.0)
    assert versions.advance(now_s=20.0) is UpdateDecision.HOLD  # no samples
    _feed(versions, 100.0, 100.0)
    assert versions.advance(now_s=5.0) is UpdateDecision.HOLD  # too early
    assert versions.advance(now_s=10.0) is UpdateDecision.STEP_UP
    assert versions.share == pytest.approx(0.10)


def test_latency_degraded_more_than_fifteen_percent_rolls_back() -> None:
    versions = ExpertVersions(live="v1", policy=POLICY)
    versions.begin_update("v2", now_s=0.0)
    _feed(versions, 100.0, 116.0)
    assert versions.advance(now_s=1.0) is UpdateDecision.HOLD  # judged on the whole step
    assert versions.advance(now_s=10.0) is UpdateDecision.ROLLED_BACK
    assert versions.live == "v1" and versions.route("any-job") == "v1"
    assert "latency" in versions.last_reason


def test_errors_on_the_candidate_roll_back() -> None:
    versions = ExpertVersions(live="v1", policy=POLICY)
    versions.begin_update("v2", now_s=0.0)
    _feed(versions, 100.0, 100.0, cand_ok=False)
    assert versions.advance(now_s=1.0) is UpdateDecision.ROLLED_BACK  # errors: at once
    assert "error rate" in versions.last_reason


def test_routing_is_stable_per_job_and_follows_the_share() -> None:
    versions = ExpertVersions(live="v1", policy=POLICY)
    versions.begin_update("v2", now_s=0.0)
    jobs = [f"job-{i}" for i in range(2000)]
    share = sum(versions.route(j) == "v2" for j in jobs) / len(jobs)
    assert 0.03 < share < 0.07
    assert all(versions.route(j) == versions.route(j) for j in jobs[:50])


def test_only_the_last_three_versions_are_kept_for_rollback() -> None:
    versions = ExpertVersions(live="v1", policy=UpdatePolicy(traffic_step=1.0, min_samples=1,
                                                             step_interval_s=0.0))
    for name in ("v2", "v3", "v4"):
        versions.begin_update(name, now_s=0.0)
        versions.record(versions.live, 1.0, True)
        versions.record(name, 1.0, True)
        assert versions.advance(now_s=0.0) is UpdateDecision.PROMOTED
    assert list(versions.kept) == ["v2", "v3", "v4"]
    assert versions.roll_back_to_previous() == "v3"
