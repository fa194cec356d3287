"""Routing traces: the file format's round trip and its error messages, and the synthetic
generator's knobs, measured on the traces it makes."""

from __future__ import annotations

import json
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest

from workers.moe.traces import (
    RequestTrace,
    RoutingTrace,
    TraceError,
    read_trace,
    synthetic_trace,
    top_k_overlap,
    write_trace,
)

pytestmark = pytest.mark.timeout(30)

QUIET = {"locality": 0.0, "layer_correlation": 0.0, "lookahead_accuracy": None}
"""Knobs that switch off every effect but popularity, to measure one at a time."""


def _small(**knobs: object) -> RoutingTrace:
    settings: dict[str, object] = {"layers": 4, "experts": 16, "top_k": 2, "requests": 3,
                                   "prefill_tokens": 4, "decode_tokens": 6, "seed": 7}
    settings.update(knobs)
    return synthetic_trace(**settings)  # type: ignore[arg-type]


def _hand_made() -> RoutingTrace:
    first = RequestTrace(
        steps=({0: (1, 2, 5), 1: None, 2: (0, 3)}, {0: (2,), 1: None, 2: (3,)}),
        lookahead=({}, {0: (2, 4, 1), 2: (0,)}),
    )
    second = RequestTrace(steps=({0: (4,), 1: None, 2: (1,)},))
    return RoutingTrace((first, second), model="toy-moe", num_experts=6, top_k=1, source="test")


def _write_lines(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _lru_hit_rate(sequence: Sequence[tuple[int, ...]], slots: int) -> float:
    resident: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for group in sequence:
        for expert in group:
            total += 1
            if expert in resident:
                hits += 1
                resident.move_to_end(expert)
            else:
                resident[expert] = None
                if len(resident) > slots:
                    resident.popitem(last=False)
    return hits / total


def _mean_lru_hit_rate(trace: RoutingTrace, slots: int) -> float:
    rates = [_lru_hit_rate(seq, slots) for seq in trace.layer_sequences().values()]
    return sum(rates) / len(rates)


def _window_reuse(trace: RoutingTrace, window: int) -> float:
    """Share of decode-step experts that the same layer used in the request's previous
    ``window`` decode steps."""
    reused = total = 0
    for request in trace.requests:
        decode = request.steps[1:]
        for t in range(window, len(decode)):
            for layer, group in decode[t].items():
                if group is None:
                    continue
                seen = {e for step in decode[t - window : t] for e in step[layer] or ()}
                reused += sum(e in seen for e in group)
                total += len(group)
    return reused / total


def _top_share_per_layer(trace: RoutingTrace) -> list[float]:
    """Per MoE layer, the share of decode routings that went to its most used expert."""
    shares = []
    for sequence in trace.layer_sequences().values():
        counts = Counter(e for group in sequence for e in group)
        shares.append(max(counts.values()) / sum(counts.values()))
    return shares


# --- the file format -----------------------------------------------------------------------


@pytest.mark.parametrize("accuracy", [0.8, None], ids=["with-lookahead", "without-lookahead"])
def test_a_written_synthetic_trace_reads_back_equal(tmp_path: Path, accuracy: float | None) -> None:
    trace = _small(dense_layers=(1,), lookahead_accuracy=accuracy)
    write_trace(trace, tmp_path / "trace.jsonl")
    assert read_trace(tmp_path / "trace.jsonl") == trace
    assert trace.has_lookahead() == (accuracy is not None)


def test_a_hand_made_trace_with_partial_lookahead_and_dense_layers_reads_back_equal(
    tmp_path: Path,
) -> None:
    trace = _hand_made()
    write_trace(trace, tmp_path / "trace.jsonl")
    assert read_trace(str(tmp_path / "trace.jsonl")) == trace


def test_a_trace_without_header_fields_reads_back_equal(tmp_path: Path) -> None:
    trace = RoutingTrace(_hand_made().requests)
    write_trace(trace, tmp_path / "trace.jsonl")
    assert read_trace(tmp_path / "trace.jsonl") == trace


def test_the_file_is_a_compact_header_line_then_one_line_per_request(tmp_path: Path) -> None:
    write_trace(_hand_made(), tmp_path / "trace.jsonl")
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert lines == [
        '{"stepline_trace":1,"model":"toy-moe","num_experts":6,"top_k":1,"source":"test"}',
        '[{"0":[1,2,5],"1":null,"2":[0,3]},'
        '{"0":[2],"1":null,"2":[3],"lookahead":{"0":[2,4,1],"2":[0]}}]',
        '[{"0":[4],"1":null,"2":[1]}]',
    ]
    assert not list(tmp_path.glob("*.partial"))


def test_a_file_without_header_reads_with_no_model_facts(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "trace.jsonl", '[{"0":[3,1],"1":null},{"0":[2]}]', "",
                        '[{"0":[0]}]')
    trace = read_trace(path)
    assert trace.model is None and trace.num_experts is None and trace.top_k is None
    assert trace.requests[0].steps == ({0: (3, 1), 1: None}, {0: (2,)})
    assert trace.requests[0].lookahead == ({}, {})
    assert trace.experts() == 4


@pytest.mark.parametrize("header", [True, False], ids=["with-header", "without-header"])
def test_a_whole_file_json_array_of_requests_reads_like_json_lines(
    tmp_path: Path, header: bool
) -> None:
    trace = _hand_made() if header else RoutingTrace(_hand_made().requests)
    write_trace(trace, tmp_path / "trace.jsonl")
    items = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    array = tmp_path / "trace.json"
    array.write_text(json.dumps(items if header else items[1:], indent=2))
    assert read_trace(array) == trace


def test_an_empty_file_is_a_trace_of_no_requests(tmp_path: Path) -> None:
    assert read_trace(_write_lines(tmp_path / "trace.jsonl", "")).requests == ()
    assert read_trace(_write_lines(tmp_path / "array.json", "[]")).requests == ()


def test_the_error_names_file_line_step_and_layer(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "trace.jsonl", '{"stepline_trace":1}', '[{"7":[1]}]',
                        '[{"7":[1]},{"7":[1]},{"7":[1]},{"7":[1]},{"7":[1]},{"7":[-1]}]')
    with pytest.raises(TraceError, match=re.escape(
            f"{path} line 3, step 5, layer '7': expert id -1 is not a non-negative integer")):
        read_trace(path)


@pytest.mark.parametrize(("lines", "where", "problem"), [
    (['[{"0":[1]}]', '[{"0":[1],}]'], "line 2", "not valid JSON: Expecting property name"),
    (['[{"0":[1]}]', '{"0":[1]}'], "line 2",
     "a request must be a JSON list of steps, got an object (only the first line"),
    (['"hello"'], "line 1", "a request must be a JSON list of steps, got a string"),
    (["[]", '[{"0":[1]}]'], "line 1", "a request has no steps"),
    (['[{"0":[1]},[1]]'], "line 1, step 1", "a step must be a JSON object"),
    (['[{"x7":[1]}]'], "line 1, step 0", "key 'x7' is not a layer id"),
    (['[{"07":[1]}]'], "line 1, step 0", "key '07' is not a layer id"),
    (['[{"-1":[1]}]'], "line 1, step 0", "key '-1' is not a layer id"),
    (['[{"0":[1],"0":[2]}]'], "line 1, step 0", "key '0' appears twice in one object"),
    (['[{"0":"1"}]'], "line 1, step 0, layer '0'", "expected a list of expert ids, got a string"),
    (['[{"0":[1.5]}]'], "line 1, step 0, layer '0'", "expert id 1.5 is not a non-negative"),
    (['[{"0":["3"]}]'], "line 1, step 0, layer '0'", 'expert id "3" is not a non-negative'),
    (['[{"0":[true]}]'], "line 1, step 0, layer '0'", "expert id true is not a non-negative"),
    (['[{"0":[3,1,3]}]'], "line 1, step 0, layer '0'", "expert 3 is listed twice"),
    (['[{"0":[1],"lookahead":[1,2]}]'], "line 1, step 0, lookahead",
     "must be a JSON object from layer id to ranked expert ids, got a list"),
    (['[{"0":[1],"lookahead":{"0":2}}]'], "line 1, step 0, lookahead, layer '0'",
     "expected a list of expert ids, got a number"),
    (['[{"0":[1],"lookahead":{"0":[2,2]}}]'], "line 1, step 0, lookahead, layer '0'",
     "expert 2 is listed twice"),
    (['[{"0":[1],"lookahead":{"x":[2]}}]'], "line 1, step 0, lookahead",
     "key 'x' is not a layer id"),
    (['[{"0":[1],"1":null,"lookahead":{"1":[2]}}]'], "line 1, step 0, lookahead, layer '1'",
     "the step routes no experts at this layer"),
], ids=["bad-json", "object-request", "string-request", "empty-request", "list-step",
        "word-layer", "padded-layer", "negative-layer", "duplicate-layer", "string-group",
        "float-expert", "string-expert", "bool-expert", "duplicate-expert", "list-lookahead",
        "number-lookahead-group", "duplicate-lookahead-expert", "word-lookahead-layer",
        "lookahead-for-dense-layer"])
def test_malformed_requests_are_refused_with_where_and_what(
    tmp_path: Path, lines: list[str], where: str, problem: str
) -> None:
    path = _write_lines(tmp_path / "trace.jsonl", *lines)
    with pytest.raises(TraceError, match=re.escape(f"{path} {where}: {problem}")):
        read_trace(path)


@pytest.mark.parametrize(("header", "problem"), [
    ('{"model":"m"}', 'an object on the first line must be a header with "stepline_trace": 1'),
    ('{"stepline_trace":2}', "trace format version 2 is not supported"),
    ('{"stepline_trace":"1"}', 'trace format version "1" is not supported'),
    ('{"stepline_trace":1,"num_expert":8}', "unknown key(s) 'num_expert'"),
    ('{"stepline_trace":1,"num_experts":0}', "num_experts must be a positive integer or null"),
    ('{"stepline_trace":1,"top_k":1.0}', "top_k must be a positive integer or null, got 1.0"),
    ('{"stepline_trace":1,"model":3}', "model must be a string or null, got 3"),
    ('{"stepline_trace":1,"num_experts":2,"top_k":4}', "top_k 4 exceeds num_experts 2"),
])
def test_a_malformed_header_is_refused(tmp_path: Path, header: str, problem: str) -> None:
    path = _write_lines(tmp_path / "trace.jsonl", header, '[{"0":[1]}]')
    with pytest.raises(TraceError, match=re.escape(f"{path} line 1 (header): {problem}")):
        read_trace(path)


def test_expert_ids_are_checked_against_the_headers_num_experts_and_top_k(tmp_path: Path) -> None:
    header = '{"stepline_trace":1,"num_experts":4,"top_k":1}'
    out_of_range = _write_lines(tmp_path / "a.jsonl", header, '[{"0":[1],"lookahead":{"0":[4]}}]')
    with pytest.raises(TraceError, match=re.escape(
            "line 2, step 0, lookahead, layer '0': expert id 4 is out of range; the header says "
            "num_experts 4")):
        read_trace(out_of_range)
    over_top_k = _write_lines(tmp_path / "b.jsonl", header, '[{"0":[1,2]},{"0":[1,2]}]')
    with pytest.raises(TraceError, match=re.escape(
            "line 2, step 1, layer '0': 2 experts in a decode step, more than the header's "
            "top_k 1")):
        read_trace(over_top_k)


def test_a_pretty_printed_array_with_a_syntax_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text('[\n  [{"0": [1]}],\n  [{"0": [2]},]\n]\n')
    with pytest.raises(TraceError, match=re.escape(f"{path} line 3: not valid JSON")):
        read_trace(path)


def test_errors_in_a_whole_file_array_name_the_item(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([[{"0": [1]}], [{"0": [1]}, {"0": [-2]}]]))
    with pytest.raises(TraceError,
                       match=re.escape(f"{path} item 2, step 1, layer '0': expert id -2")):
        read_trace(path)


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'[{"0":[1]}]\n\xff\xfe\n')
    with pytest.raises(TraceError, match="not UTF-8 text"):
        read_trace(path)


def test_writing_a_trace_that_would_not_read_back_raises_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    bad = RoutingTrace((RequestTrace(({0: (1,)}, {0: (2, 2)})),))
    with pytest.raises(TraceError, match=re.escape(
            "trace.requests[0], step 1, layer '0': expert 2 is listed twice")):
        write_trace(bad, tmp_path / "trace.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_a_request_needs_a_step_and_one_lookahead_entry_per_step() -> None:
    with pytest.raises(TraceError, match="at least one step"):
        RequestTrace(())
    with pytest.raises(TraceError, match="2 steps but 1 lookahead entries"):
        RequestTrace(({0: (1,)}, {0: (2,)}), ({},))


# --- derived figures -----------------------------------------------------------------------


def test_layer_sequences_run_requests_one_after_another_with_steps_in_order() -> None:
    assert _hand_made().layer_sequences() == {
        0: [(1, 2, 5), (2,), (4,)],
        2: [(0, 3), (3,), (1,)],
    }


def test_helpers_report_moe_layers_experts_tokens_and_lookahead() -> None:
    trace = _hand_made()
    assert trace.moe_layers() == [0, 2]
    assert trace.experts() == 6
    assert RoutingTrace(trace.requests).experts() == 6  # largest id (5, routed) + 1
    assert trace.tokens() == 3
    assert trace.has_lookahead()
    assert not RoutingTrace((trace.requests[1],)).has_lookahead()


def test_top_k_overlap_is_the_mean_share_of_routed_experts_in_the_first_k_predicted() -> None:
    # Step 1: layer 0 routed (2,), predicted first 1 = (2,) -> 1; layer 2 routed (3,),
    # predicted (0,) -> 0.
    assert top_k_overlap(_hand_made()) == pytest.approx(0.5)
    assert top_k_overlap(RoutingTrace((_hand_made().requests[1],))) is None


# --- the synthetic generator ---------------------------------------------------------------


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert _small(seed=3) == _small(seed=3)
    assert _small(seed=3).requests != _small(seed=4).requests


def test_lookahead_accuracy_leaves_the_routing_alone_and_more_requests_extend_the_trace() -> None:
    with_lookahead, without = _small(lookahead_accuracy=0.5), _small(lookahead_accuracy=None)
    assert [r.steps for r in with_lookahead.requests] == [r.steps for r in without.requests]
    assert _small(requests=5).requests[:3] == _small(requests=3).requests


def test_synthetic_steps_have_the_promised_shape() -> None:
    trace = _small(layers=5, top_k=3, prefill_tokens=6, decode_tokens=9, dense_layers=(0, 3))
    assert (trace.num_experts, trace.top_k, trace.moe_layers()) == (16, 3, [1, 2, 4])
    assert trace.source is not None and trace.source.startswith("synthetic_trace(layers=5,")
    for request in trace.requests:
        assert len(request.steps) == 1 + 9
        prefill, *decode = request.steps
        for layer in (1, 2, 4):
            assert prefill[layer] == tuple(sorted(set(prefill[layer] or ())))
            assert 3 <= len(prefill[layer] or ()) <= 16
        for step in decode:
            assert step[0] is None and step[3] is None
            assert all(len(set(step[layer] or ())) == 3 for layer in (1, 2, 4))
        for step, ranked in zip(request.steps, request.lookahead, strict=True):
            assert set(ranked) == {1, 2, 4}
            for layer, predicted in ranked.items():
                assert len(predicted) == len(set(predicted)) == min(2 * len(step[layer] or ()), 16)


def test_a_higher_skew_needs_fewer_distinct_experts_and_an_lru_cache_hits_more() -> None:
    flat, steep = (_small(layers=6, experts=128, top_k=1, requests=4, decode_tokens=120,
                          skew=(s, s), **QUIET) for s in (0.2, 1.6))
    distinct = {name: sum(len({g for group in seq for g in group})
                          for seq in trace.layer_sequences().values())
                for name, trace in (("flat", flat), ("steep", steep))}
    assert distinct["steep"] < 0.6 * distinct["flat"]
    assert _mean_lru_hit_rate(steep, 8) > _mean_lru_hit_rate(flat, 8) + 0.25


def test_locality_raises_reuse_within_the_window() -> None:
    settings = {**QUIET, "experts": 64, "top_k": 1, "requests": 4, "decode_tokens": 80,
                "skew": (0.3, 0.3), "window": 8}
    without = _small(**settings)
    with_locality = _small(**{**settings, "locality": 0.8})
    assert _window_reuse(with_locality, 8) > _window_reuse(without, 8) + 0.4


def test_each_layer_draws_its_own_skew() -> None:
    settings = {**QUIET, "layers": 12, "experts": 64, "top_k": 1, "requests": 4,
                "decode_tokens": 150}
    varied = _top_share_per_layer(_small(**settings, skew=(0.1, 2.5)))
    fixed = _top_share_per_layer(_small(**settings, skew=(1.0, 1.0)))
    assert max(varied) - min(varied) > 0.3
    assert max(fixed) - min(fixed) < 0.2


def test_full_layer_correlation_makes_each_moe_layer_a_function_of_the_one_before() -> None:
    def successors(trace: RoutingTrace, before: int, after: int) -> dict[int, set[int]]:
        seen: dict[int, set[int]] = defaultdict(set)
        for request in trace.requests:
            for step in request.steps[1:]:
                seen[(step[before] or ())[0]].add((step[after] or ())[0])
        return seen

    settings = {"layers": 4, "experts": 16, "top_k": 1, "decode_tokens": 60, "locality": 0.0,
                "dense_layers": (2,)}
    chained = _small(**settings, layer_correlation=1.0)
    free = _small(**settings, layer_correlation=0.0)
    for before, after in ((0, 1), (1, 3)):  # layer 3 follows layer 1 across the dense layer 2
        assert all(len(nexts) == 1 for nexts in successors(chained, before, after).values())
        assert any(len(nexts) > 1 for nexts in successors(free, before, after).values())


@pytest.mark.parametrize("accuracy", [0.0, 0.35, 0.9, 1.0])
def test_the_measured_top_k_overlap_matches_the_lookahead_accuracy(accuracy: float) -> None:
    trace = _small(layers=8, experts=64, top_k=2, requests=6, decode_tokens=100,
                   lookahead_accuracy=accuracy)
    assert top_k_overlap(trace) == pytest.approx(accuracy, abs=0.02)


@pytest.mark.parametrize(("knobs", "problem"), [
    ({"top_k": 17}, "top_k must be between 1 and experts (16), got 17"),
    ({"skew": (1.2, 0.4)}, "skew must be (low, high) with 0 <= low <= high"),
    ({"locality": 1.5}, "locality must be in [0, 1], got 1.5"),
    ({"window": 0}, "window must be at least 1, got 0"),
    ({"lookahead_accuracy": -0.1}, "lookahead_accuracy must be in [0, 1] or None"),
    ({"dense_layers": (4,)}, "dense_layers must be layer ids below layers (4), got [4]"),
])
def test_the_generator_refuses_arguments_out_of_range(knobs: dict[str, object],
                                                      problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        _small(**knobs)
