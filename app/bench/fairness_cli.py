"""``stepline bench --fairness``: :mod:`app.bench.fairness`, printed and written as JSON; with
``--live``, :mod:`app.bench.fairness_live` beside it (the same traces on live stacks and in the
simulator), ``fairness_live.json``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.fairness import run_fairness_bench
from app.bench.fairness_live import LiveFairness, run_live_fairness, side_by_side


def fairness_bench(
    out: Path, *, tenants: int, seeds: int, print_: Callable[[str], Any], live: bool = False
) -> dict[str, Any]:
    report = run_fairness_bench(tenants=tenants, seeds=seeds, progress=print_)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fairness.json"
    path.write_text(json.dumps(report, indent=1))
    for key, value in report["summary"].items():
        if value is not None:
            print_(f"{key}: {value['mean']:.3f} [{value['lo']:.3f}, {value['hi']:.3f}]")
    print_(f"report: {path} ({report['wall_s']:.0f} s, simulated)")
    if live:
        report["live"] = live_fairness_bench(out, tenants=tenants, seeds=seeds, print_=print_)
    return report


def live_fairness_bench(
    out: Path, *, tenants: int, seeds: int, print_: Callable[[str], Any]
) -> dict[str, Any]:
    """The live arm (:mod:`app.bench.fairness_live`), sim beside live, ``fairness_live.json``."""
    report = run_live_fairness(LiveFairness(tenants=tenants, seeds=seeds), progress=print_)
    path = out / "fairness_live.json"
    path.write_text(json.dumps(report, indent=1))
    for line in side_by_side(report):
        print_(line)
    print_(
        f"report: {path} ({report['wall_s']:.0f} s; load average "
        f"{report['load_average']['before'][0]:.1f} → {report['load_average']['after'][0]:.1f})"
    )
    return report
