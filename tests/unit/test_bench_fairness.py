"""The fairness bench's arithmetic and one small simulated run of it."""

from __future__ import annotations

from app.bench.fairness import fairness_trace, max_min_shares, run_fairness_bench


def test_max_min_shares_give_the_light_their_demand_and_split_the_rest() -> None:
    shares = max_min_shares({"a": 1.0, "b": 10.0, "c": 10.0}, 9.0)
    assert shares == {"a": 1.0, "b": 4.0, "c": 4.0}


def test_the_flooding_tenant_submits_about_flood_times_each_light_one() -> None:
    trace = fairness_trace(3, 10.0, 1.3, 8, 60.0, seed=1)
    counts = {t: sum(1 for a in trace if a.tenant == t) for t in ("t0", "t1", "t2")}
    assert counts["t0"] > 5 * max(counts["t1"], counts["t2"])
    assert fairness_trace(3, 10.0, 1.3, 8, 60.0, seed=1, with_flood=False) \
        and all(a.tenant != "t0" for a in fairness_trace(3, 10.0, 1.3, 8, 60.0, 1, False))


def test_a_small_fairness_run_reports_every_figure_for_every_tenant() -> None:
    report = run_fairness_bench(tenants=2, workers=2, duration_s=10.0, seeds=1)
    run = report["runs"][0]
    for arm in ("fair", "unfair"):
        assert set(run[arm]["served_share"]) == {"t0", "t1"}
        assert abs(sum(run[arm]["served_share"].values()) - 1.0) < 1e-9
        assert 0.0 < run[arm]["jain"] <= 1.0 + 1e-9
    assert report["summary"]["throughput_ratio"] is not None
