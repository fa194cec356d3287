"""The fast ranking keys the allocation sorts 10 000 jobs by are the readable rank, float for
float (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import ClusterSnapshot, PolicyConfig
from scheduler.ordering import Ranking, order_jobs
from tests.unit.test_scheduler_support import NOW_S, snapshots

pytestmark = pytest.mark.timeout(240)  # hypothesis runs slow on a loaded 2-core machine

RANDOM = settings(max_examples=150, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
POLICIES = (PolicyConfig(), PolicyConfig(late_penalty=1.0, aging_bound_s=0.5),
            PolicyConfig(late_penalty=20.0, aging_bound_s=60.0))


def _without_dependencies(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    return replace(snapshot, jobs=tuple(replace(job, depends_on=()) for job in snapshot.jobs))


def _assert_keys_are_the_rank(ranking: Ranking, origin: int | None) -> None:
    pool = [i for i in range(len(ranking.survey.live)) if i != origin]
    keys = ranking.keys(pool)
    assert keys == [ranking.rank(i)[1:] for i in pool]
    by_key = [pool[k] for k in sorted(range(len(pool)), key=keys.__getitem__)]
    assert by_key == sorted(pool, key=ranking.rank)


@RANDOM
@given(snapshot=snapshots(), policy=st.sampled_from(POLICIES),
       now_offset_s=st.floats(-30.0, 200.0))
def test_fast_keys_equal_the_readable_rank_without_inheritance(
        snapshot: ClusterSnapshot, policy: PolicyConfig, now_offset_s: float) -> None:
    # given any snapshot with no job waiting on another (the keys' inlined path); when ordered
    order = order_jobs(_without_dependencies(snapshot), policy, NOW_S + now_offset_s)
    assert not order.levels.inherited
    # then every job but the origin has the rank's key and tie-break, and sorts the same
    _assert_keys_are_the_rank(order.ranking, order.levels.origin)


@RANDOM
@given(snapshot=snapshots(), policy=st.sampled_from(POLICIES),
       now_offset_s=st.floats(-30.0, 200.0))
def test_fast_keys_equal_the_readable_rank_with_dependencies(
        snapshot: ClusterSnapshot, policy: PolicyConfig, now_offset_s: float) -> None:
    # given any snapshot, dependencies and inherited levels included; when ordered
    order = order_jobs(snapshot, policy, NOW_S + now_offset_s)
    # then the keys still order every job but the origin exactly as the rank does
    _assert_keys_are_the_rank(order.ranking, order.levels.origin)
