"""The degradation sweep (``app.bench.degradation_bench``) on a small overloaded trace: every
arm runs the same arrivals, only jobs that gave a floor are degraded, never below it, and the
report is plain JSON."""

from __future__ import annotations

import json

import pytest

from app.bench.degradation_bench import FLOOR, run_degradation_bench

pytestmark = pytest.mark.timeout(300)


def test_a_small_sweep_degrades_only_jobs_with_a_floor_on_the_same_arrivals() -> None:
    # given one seeded trace of 120 jobs on 4 workers at effective load 1.6
    report = run_degradation_bench(targets=(1.6,), seeds=1, jobs=120, workers=4, gates=(0.8,))
    (point,) = report["points"]
    arms = point["arms"]
    # then every arm ran the same jobs, and the arm without floors degraded none
    assert set(arms) == {"none", "degrade", "levels", "levels_queued", "degrade_at_0.8"}
    assert {arm["jobs"] for arm in arms.values()} == {120}
    assert arms["none"]["degraded"] == 0
    # and no arm degraded a job that did not allow it, nor below its floor
    for arm in arms.values():
        assert arm["degraded_without_floor"] == 0
        assert arm["mean_work_kept"] is None or 0.0 < arm["mean_work_kept"] < 1.0
    # and degrading steps alone keeps at least the floor's share of the work
    assert arms["degrade"]["mean_work_kept"] is None or arms["degrade"]["mean_work_kept"] >= FLOOR
    # and the overload made some job degrade, and the ratios are those of the counts
    assert arms["degrade_at_0.8"]["degraded"] > 0
    assert point["met_ratio"] == arms["degrade"]["met"] / arms["none"]["met"]
    json.dumps(report)
