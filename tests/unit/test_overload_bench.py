"""The overload sweep's bookkeeping on a tiny run (figures belong in the benchmark, not here)."""

from __future__ import annotations

import pytest

from app.bench.overload_bench import run_overload_bench

pytestmark = pytest.mark.timeout(120)


def test_every_job_is_counted_once_and_every_shed_one_has_its_reason() -> None:
    report = run_overload_bench(targets=(1.3,), seeds=1, jobs=80, workers=2)
    (point,) = report["points"]
    assert set(point["arms"]) == {"effective", "compute"}
    for arm in point["arms"].values():
        assert arm["with_reason"] == arm["shed_or_expired"]
        assert sum(c["jobs"] for c in arm["classes"].values()) == 80
        assert sum(sum(c["outcomes"].values()) for c in arm["classes"].values()) == 80
        assert arm["effective_offered"] >= arm["compute_offered"]
    assert point["goal"]["goal"] == 0.95
