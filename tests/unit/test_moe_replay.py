"""Recording routing traces from a real model, replaying them through the live cache, and the
`stepline experts record / synth / replay` commands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from workers.errors import ParamsError
from workers.moe.expert_cache import CacheConfig
from workers.moe.record import RecordInput, read_inputs, record_trace
from workers.moe.replay import belady_rate, replay_cache, replay_table
from workers.moe.traces import read_trace, synthetic_trace, top_k_overlap, write_trace

pytestmark = pytest.mark.timeout(120)

CONFIG = CacheConfig(overlap=False)


def _small(lookahead: float | None = 0.9, seed: int = 0):  # type: ignore[no-untyped-def]
    return synthetic_trace(layers=4, experts=16, top_k=1, requests=4, prefill_tokens=4,
                           decode_tokens=40, lookahead_accuracy=lookahead, seed=seed)


def test_no_online_policy_beats_belady_on_uniform_slots() -> None:
    trace = _small()
    for slots in (2, 4, 8):
        best = belady_rate(trace, slots)
        for policy in ("lru", "lfru", "arc", "s3fifo", "lecar"):
            config = replace(CONFIG, policy=policy, allocation="uniform", prefetch_experts=0)
            run = replay_cache(trace, slots, config)
            assert run.hit_rate <= best + 1e-9, (policy, slots)
            assert run.hits + run.late + run.misses == run.accesses
            assert run.late == 0 and run.prefetch_issued == 0


def test_an_accurate_lookahead_lets_prefetch_beat_the_demand_optimum() -> None:
    trace = _small(lookahead=1.0)
    rows = replay_table(trace, [4], CONFIG, ("lru", "lfru"))
    row = rows[0].as_dict()
    prefetch = row["prefetch"]
    assert prefetch["lookahead"] and prefetch["lookahead_accuracy"] == pytest.approx(1.0)
    assert prefetch["stall_free"] > row["belady"]
    assert prefetch["prefetch_used"] > 0.8 * prefetch["prefetch_issued"]


def test_a_useless_lookahead_is_learnt_and_stops_moving_bytes() -> None:
    trace = _small(lookahead=0.0, seed=3)
    row = replay_table(trace, [4], CONFIG, ("lfru",))[0].as_dict()
    # calibration learns the predictions never come true: little traffic beyond demand paging
    assert row["prefetch"]["bytes_over_demand"] < 1.2


def test_replay_is_deterministic() -> None:
    trace = _small()
    assert replay_cache(trace, 4, CONFIG) == replay_cache(trace, 4, CONFIG)


def test_a_recorded_trace_round_trips_and_carries_the_lookahead(tmp_path: Path) -> None:
    inputs = [RecordInput("hello there", 6), RecordInput("a second prompt", 4)]
    trace = record_trace("qwen3-moe-tiny", inputs)
    assert [len(r.steps) for r in trace.requests] == [6, 4]
    assert trace.top_k == 2 and trace.num_experts == 16 and trace.moe_layers() == [0, 1]
    for request in trace.requests:
        for index, (step, ahead) in enumerate(zip(request.steps, request.lookahead, strict=True)):
            if index > 0:
                assert all(len(step[layer] or ()) <= 2 for layer in (0, 1))
            # layer 1 is predicted at layer 0 of the same step; layer 0 at the last step's last
            assert set(ahead) == ({1} if index == 0 else {0, 1})
    accuracy = top_k_overlap(trace)
    assert accuracy is not None and 0.0 <= accuracy <= 1.0
    path = tmp_path / "trace.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    assert record_trace("qwen3-moe-tiny", inputs) == trace  # greedy and seeded: repeatable


def test_record_inputs_are_validated_with_the_line_that_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi", "max_new_tokens": 3}\nplain prompt line\n\n')
    assert read_inputs(good, 5) == [RecordInput("hi", 3), RecordInput("plain prompt line", 5)]
    cases = {
        '{"prompt": ""}': "non-empty string",
        '{"prompt": "x", "max_new_tokens": 0}': "max_new_tokens",
        '{"prompt": "x", "tokens": 3}': "unknown field",
        '{"prompt": "x"': "not valid JSON",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text("ok prompt\n" + text + "\n")
        with pytest.raises(ParamsError, match=message) as error:
            read_inputs(bad, 5)
        assert "line 2" in str(error.value)


def test_the_cli_synthesises_and_replays_a_trace(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_RUN_DIR", str(tmp_path / "run"))
    runner = CliRunner()
    trace = tmp_path / "syn.jsonl"
    made = runner.invoke(cli, ["experts", "synth", "--out", str(trace), "--layers", "3",
                               "--experts", "16", "--requests", "3", "--decode-tokens", "30"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "replay.json"
    result = runner.invoke(cli, ["experts", "replay", str(trace), "--slots", "4,8",
                                 "--policy", "lru,lfru", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "belady" in result.output and "stallfree" in result.output
    report = json.loads(out.read_text())
    assert [row["slots_per_layer"] for row in report["rows"]] == [4, 8]
    assert set(report["rows"][0]["demand_hit_rate"]) == {"lru", "lfru", "default"}


@pytest.mark.parametrize(("args", "message"), [
    (["--slots", "0"], "at least 1"),
    (["--slots", "four"], "comma-separated integers"),
    (["--policy", "fifo"], "unknown policy fifo"),
    (["--copy-cost", "0"], "copy_cost"),
])
def test_the_cli_rejects_bad_replay_options_with_a_clear_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    monkeypatch.setenv("STEPLINE_RUN_DIR", str(tmp_path / "run"))
    trace = tmp_path / "t.jsonl"
    write_trace(_small(), trace)
    result = CliRunner().invoke(cli, ["experts", "replay", str(trace), *args])
    assert result.exit_code == 2
    assert message in _text(result.output)


def test_the_cli_names_the_line_of_a_malformed_trace(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_RUN_DIR", str(tmp_path / "run"))
    trace = tmp_path / "bad.jsonl"
    trace.write_text('[{"0": [1]}]\n[{"0": [-1]}]\n')
    result = CliRunner().invoke(cli, ["experts", "replay", str(trace)])
    assert result.exit_code == 2
    assert "line 2" in _text(result.output) and "-1" in result.output


def _text(output: str) -> str:
    """The error box's words, unwrapped."""
    return " ".join(output.replace("│", " ").replace("╭", " ").replace("╰", " ").split())
