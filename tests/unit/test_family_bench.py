"""``stepline bench --families`` on one tiny family: it runs and writes a well-formed report
(no timing is asserted: the figures are the bench's, not the test's), and the code-line count
covers every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.bench.family_lines import CLASSES, MODULES, family_lines
from app.cli import cli
from workers.diffusion.pipelines import FAMILIES

pytestmark = pytest.mark.timeout(300)


def test_the_families_bench_on_one_family_writes_a_well_formed_report(tmp_path: Path) -> None:
    # given Flux (true CFG and a timestep embedding to hold), one repetition, few steps
    args = ["bench", "--families", "--models", "flux-tiny", "--repetitions", "1",
            "--family-steps", "2", "--cache-steps", "3", "--out", str(tmp_path)]
    # when the bench runs
    result = CliRunner().invoke(cli, args)
    # then it wrote families.json with a timing row and a step-cache row for the family
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "families.json").read_text())
    (timing,) = report["timings"]
    assert timing["model"] == "flux-tiny" and len(timing["ratios"]) == 1
    assert timing["pipeline_s"] > 0 and timing["chunked_s"] > 0
    assert set(timing["ratio"]) == {"median", "lo", "hi"}
    (cache,) = report["step_cache"]
    # three steps, two passes (true CFG), four blocks: every block hook fired on the uncached run
    assert cache["uncached"]["block_evaluations"] == 3 * 2 * 4
    assert 0 < cache["first_block"]["block_evaluations"] <= 3 * 2 * 4
    assert "first_block_timestep_held" in cache
    assert set(report["code_lines"]) == {*FAMILIES, "shared"}


def test_an_unknown_model_is_refused_by_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "--families", "--models", "no-such-tiny",
                                      "--out", str(tmp_path)])
    assert result.exit_code != 0 and "no-such-tiny" in result.output


def test_every_family_has_its_code_counted_once() -> None:
    # given the families the workers serve
    counts = family_lines()
    # then each is counted (by module or by its classes) with some code of its own
    assert set(MODULES) | set(CLASSES) == set(FAMILIES)
    assert all(counts[family] > 0 for family in FAMILIES)
