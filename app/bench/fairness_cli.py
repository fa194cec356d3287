"""``stepline bench --fairness``: :mod:`app.bench.fairness`, printed and written as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.fairness import run_fairness_bench


def fairness_bench(out: Path, *, tenants: int, seeds: int,
                   print_: Callable[[str], Any]) -> dict[str, Any]:
    report = run_fairness_bench(tenants=tenants, seeds=seeds, progress=print_)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fairness.json"
    path.write_text(json.dumps(report, indent=1))
    for key, value in report["summary"].items():
        if value is not None:
            print_(f"{key}: {value['mean']:.3f} [{value['lo']:.3f}, {value['hi']:.3f}]")
    print_(f"report: {path} ({report['wall_s']:.0f} s, simulated)")
    return report
