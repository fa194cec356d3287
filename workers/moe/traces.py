"""Expert-routing traces: the JSON Lines format ``stepline experts record`` writes and
``stepline experts replay`` reads, and a synthetic generator with per-layer skew, temporal
locality, layer correlation and a lookahead predictor of known accuracy.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import random
import re
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
LOOKAHEAD_KEY = "lookahead"

Step = dict[int, tuple[int, ...] | None]
"""One forward step of one request: layer id -> the experts routed there (None: a dense layer)."""
StepLookahead = dict[int, tuple[int, ...]]
"""What a predictor said about each layer before it was routed: expert ids, best first."""
_Token = dict[int, tuple[int, ...]]
"""One synthetic token's routing: MoE layer id -> its experts."""

_HEADER_KEYS = ("stepline_trace", "model", "num_experts", "top_k", "source")
_LAYER_ID = re.compile(r"0|[1-9][0-9]*")
_REQUEST_BOOST = 2.0
"""How much likelier a request's favoured experts are than the layer's popularity says."""
_FAVOURED_SHARE = 1 / 8
"""The share of a layer's experts that each request favours."""
_REJECTION_TRIES = 32


class TraceError(ValueError):
    """Raised when a routing trace is malformed; the message says where (file, line, step, layer)
    and what is wrong."""


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """One request's routing, step 0 (the prefill: the sorted union over prompt tokens) first.

    ``lookahead`` holds one entry per step, ``{}`` where nothing was predicted; ``()`` means none.
    """

    steps: tuple[Step, ...]
    lookahead: tuple[StepLookahead, ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            raise TraceError("a request needs at least one step: its prefill, step 0")
        if not self.lookahead:
            object.__setattr__(self, "lookahead", tuple({} for _ in self.steps))
        elif len(self.lookahead) != len(self.steps):
            raise TraceError(f"a request has {len(self.steps)} steps but {len(self.lookahead)} "
                             "lookahead entries; give one per step ({} where none)")


@dataclass(frozen=True, slots=True)
class RoutingTrace:
    """Every recorded request in serving order, and what the header says about the model."""

    requests: tuple[RequestTrace, ...]
    model: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    source: str | None = None

    def moe_layers(self) -> list[int]:
        """Layer ids routed (non-null) in at least one step, ascending."""
        return sorted({layer for step in self._steps() for layer, group in step.items()
                       if group is not None})

    def experts(self) -> int:
        """Experts per layer: the header's ``num_experts``, else the largest id seen plus one."""
        if self.num_experts is not None:
            return self.num_experts
        return max((max(group) for group in self._groups() if group), default=-1) + 1

    def layer_sequences(self) -> dict[int, list[tuple[int, ...]]]:
        """Per MoE layer, the expert groups it needed in serving order: the requests one after
        another, each request's steps in order (what a per-layer cache replay consumes)."""
        sequences: dict[int, list[tuple[int, ...]]] = {layer: [] for layer in self.moe_layers()}
        for step in self._steps():
            for layer, group in step.items():
                if group is not None:
                    sequences[layer].append(group)
        return sequences

    def has_lookahead(self) -> bool:
        """Whether any step of any request carries a prediction."""
        return any(ranked for request in self.requests for ranked in request.lookahead)

    def tokens(self) -> int:
        """Forward steps over all requests; the prefill counts once, as it yields one token."""
        return sum(len(request.steps) for request in self.requests)

    def _steps(self) -> Iterator[Step]:
        for request in self.requests:
            yield from request.steps

    def _groups(self) -> Iterator[tuple[int, ...]]:
        for request in self.requests:
            for step, ranked in zip(request.steps, request.lookahead, strict=True):
                yield from (group for group in step.values() if group is not None)
                yield from ranked.values()


def top_k_overlap(trace: RoutingTrace) -> float | None:
    """The lookahead's accuracy: the mean over (step, layer) with a prediction of
    |first k predicted ∩ routed| / k, where k = |routed|; None when nothing was predicted."""
    scores = [
        len(set(ranked[: len(routed)]) & set(routed)) / len(routed)
        for request in trace.requests
        for step, lookahead in zip(request.steps, request.lookahead, strict=True)
        for layer, ranked in lookahead.items()
        if (routed := step.get(layer))
    ]
    return sum(scores) / len(scores) if scores else None


# --- reading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Header:
    model: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    source: str | None = None


class _DuplicateKeys(dict[str, Any]):
    """A JSON object in which a key appeared twice (``json`` would silently keep the last)."""

    duplicate: str = ""


def read_trace(path: Path | str) -> RoutingTrace:
    """Read a routing trace; raises TraceError saying where and what, for any malformed input.

    The file is JSON Lines, one request per line, optionally after a header line
    ``{"stepline_trace": 1, "model": ..., "num_experts": ..., "top_k": ..., "source": ...}``
    (each but the version may be null or absent); or one JSON array of requests, optionally
    with the header as its first item. A request is a list of steps; a step is an object from
    layer id (``"7"``) to the expert ids routed there, or null for a dense layer; step 0 is the
    prefill (the sorted union over prompt tokens). A step may also hold ``"lookahead"``: an
    object from layer id to the expert ids a predictor ranked for that layer before it was
    routed, best first. Lines and array items count from 1, steps from 0.
    """
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TraceError(f"{name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    documents = _documents(text, name)
    header = _Header()
    if documents and isinstance(documents[0][1], dict):
        header = _parse_header(documents[0][1], documents[0][0])
        documents = documents[1:]
    requests = tuple(_parse_request(value, where, header) for where, value in documents)
    return RoutingTrace(requests, header.model, header.num_experts, header.top_k, header.source)


def _documents(text: str, name: str) -> list[tuple[str, Any]]:
    """Each header or request in ``text`` with where it stands, from JSON Lines or one array."""
    if not text.strip():
        return []
    try:
        whole = _loads(text)
    except json.JSONDecodeError as error:
        if not error.msg.startswith("Extra data"):  # the file's first syntax error, in either form
            raise _bad_json(f"{name} line {error.lineno}", error) from None
        return list(_json_lines(text, name))
    if _is_request_array(whole):
        return [(f"{name} item {number}", value) for number, value in enumerate(whole, 1)]
    first_line = next(n for n, line in enumerate(text.split("\n"), 1) if line.strip())
    return [(f"{name} line {first_line}", whole)]


def _json_lines(text: str, name: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            where = f"{name} line {number}"
            try:
                yield where, _loads(line)
            except json.JSONDecodeError as error:
                raise _bad_json(where, error) from None


def _is_request_array(value: Any) -> bool:
    """Whether one JSON value is an array of requests rather than a single request's steps."""
    if not isinstance(value, list):
        return False
    return not value or isinstance(value[0], list) or _is_header(value[0])


def _is_header(value: Any) -> bool:
    return isinstance(value, dict) and "stepline_trace" in value


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_mark_duplicate_keys)


def _mark_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = Counter(key for key, _ in pairs)
    if len(counts) == len(pairs):
        return dict(pairs)
    marked = _DuplicateKeys(pairs)
    marked.duplicate = next(key for key, count in counts.items() if count > 1)
    return marked


def _bad_json(where: str, error: json.JSONDecodeError) -> TraceError:
    return TraceError(f"{where}: not valid JSON: {error.msg} at column {error.colno}")


def _parse_header(value: dict[str, Any], where: str) -> _Header:
    where = f"{where} (header)"
    _reject_duplicate_key(value, where)
    if "stepline_trace" not in value:
        raise TraceError(f'{where}: an object on the first line must be a header with '
                         f'"stepline_trace": {FORMAT_VERSION}; a request is a JSON list of steps')
    version = value["stepline_trace"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise TraceError(f"{where}: trace format version {_show(version)} is not supported; "
                         f"this reader reads version {FORMAT_VERSION}")
    unknown = sorted(set(value) - set(_HEADER_KEYS))
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"a header holds only {', '.join(_HEADER_KEYS)}")
    header = _Header(model=_optional_text(value, "model", where),
                     num_experts=_optional_count(value, "num_experts", where),
                     top_k=_optional_count(value, "top_k", where),
                     source=_optional_text(value, "source", where))
    if header.top_k is not None and header.num_experts is not None and (
            header.top_k > header.num_experts):
        raise TraceError(f"{where}: top_k {header.top_k} exceeds num_experts {header.num_experts}")
    return header


def _optional_text(value: dict[str, Any], key: str, where: str) -> str | None:
    found = value.get(key)
    if found is None or isinstance(found, str):
        return found
    raise TraceError(f"{where}: {key} must be a string or null, got {_show(found)}")


def _optional_count(value: dict[str, Any], key: str, where: str) -> int | None:
    found = value.get(key)
    if found is None or (type(found) is int and found >= 1):
        return found
    raise TraceError(f"{where}: {key} must be a positive integer or null, got {_show(found)}")


def _parse_request(value: Any, where: str, header: _Header) -> RequestTrace:
    if not isinstance(value, list):
        hint = " (only the first line or item may be a header)" if isinstance(value, dict) else ""
        raise TraceError(f"{where}: a request must be a JSON list of steps, got "
                         f"{_kind(value)}{hint}")
    if not value:
        raise TraceError(f"{where}: a request has no steps; it needs at least its prefill, step 0")
    parsed = [_parse_step(step, f"{where}, step {index}", index, header)
              for index, step in enumerate(value)]
    return RequestTrace(tuple(step for step, _ in parsed), tuple(ranked for _, ranked in parsed))


def _parse_step(value: Any, where: str, index: int,
                header: _Header) -> tuple[Step, StepLookahead]:
    if not isinstance(value, dict):
        raise TraceError(f"{where}: a step must be a JSON object from layer id to expert ids, "
                         f"got {_kind(value)}")
    _reject_duplicate_key(value, where)
    step: Step = {}
    for key, group in value.items():
        if key == LOOKAHEAD_KEY:
            continue
        layer = _layer_id(key, where, f' or "{LOOKAHEAD_KEY}"')
        step[layer] = _routed(group, f"{where}, layer {key!r}", index > 0, header)
    if LOOKAHEAD_KEY not in value:
        return step, {}
    return step, _parse_lookahead(value[LOOKAHEAD_KEY], f"{where}, {LOOKAHEAD_KEY}", step, header)


def _routed(value: Any, where: str, decode: bool, header: _Header) -> tuple[int, ...] | None:
    """One layer's experts in a step; a decode step routes one token, so at most top_k."""
    if value is None:
        return None
    group = _expert_ids(value, where, header.num_experts)
    if decode and header.top_k is not None and len(group) > header.top_k:
        raise TraceError(f"{where}: {len(group)} experts in a decode step, more than the "
                         f"header's top_k {header.top_k}; fix top_k or leave it out")
    return group


def _parse_lookahead(value: Any, where: str, step: Step, header: _Header) -> StepLookahead:
    if not isinstance(value, dict):
        raise TraceError(f"{where}: must be a JSON object from layer id to ranked expert ids, "
                         f"got {_kind(value)}")
    _reject_duplicate_key(value, where)
    ranked: StepLookahead = {}
    for key, group in value.items():
        layer_where = f"{where}, layer {key!r}"
        layer = _layer_id(key, where, "")
        if step.get(layer) is None:
            raise TraceError(f"{layer_where}: the step routes no experts at this layer (it is "
                             "absent or null), so it can have no lookahead")
        ranked[layer] = _expert_ids(group, layer_where, header.num_experts)
    return ranked


def _layer_id(key: str, where: str, alternative: str) -> int:
    if not _LAYER_ID.fullmatch(key):
        raise TraceError(f"{where}: key {key!r} is not a layer id (a non-negative integer in "
                         f"decimal, such as \"7\"){alternative}")
    return int(key)


def _expert_ids(value: Any, where: str, num_experts: int | None) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(f"{where}: expected a list of expert ids, got {_kind(value)}")
    seen: set[int] = set()
    for expert in value:
        if type(expert) is not int or expert < 0:
            raise TraceError(f"{where}: expert id {_show(expert)} is not a non-negative "
                             "integer")
        if num_experts is not None and expert >= num_experts:
            raise TraceError(f"{where}: expert id {expert} is out of range; the header says "
                             f"num_experts {num_experts}")
        if expert in seen:
            raise TraceError(f"{where}: expert {expert} is listed twice")
        seen.add(expert)
    return tuple(value)


def _reject_duplicate_key(value: dict[str, Any], where: str) -> None:
    if isinstance(value, _DuplicateKeys):
        raise TraceError(f"{where}: key {value.duplicate!r} appears twice in one object")


def _show(value: Any) -> str:
    """``value`` as JSON would spell it, or its repr when it is no JSON value."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _kind(value: Any) -> str:
    """The JSON type of a decoded value, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else "a number"


# --- writing -------------------------------------------------------------------------------


def write_trace(trace: RoutingTrace, path: Path | str) -> None:
    """Write ``trace`` as JSON Lines: a header line, then one compact line per request, with
    ``"lookahead"`` only on steps that have one. The file appears whole (written aside, then
    renamed); a trace that would not read back raises TraceError and writes nothing."""
    target = Path(path)
    partial = target.with_name(f"{target.name}.partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            for line in _trace_lines(trace, f"cannot write {target}"):
                out.write(line + "\n")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)


def _trace_lines(trace: RoutingTrace, where: str) -> Iterator[str]:
    """Each line of ``trace``'s file, checked with the reader's own rules."""
    header = {"stepline_trace": FORMAT_VERSION, "model": trace.model,
              "num_experts": trace.num_experts, "top_k": trace.top_k, "source": trace.source}
    meta = _parse_header(header, where)
    yield _dumps(header)
    for index, request in enumerate(trace.requests):
        payload = _request_payload(request)
        _parse_request(payload, f"{where}: trace.requests[{index}]", meta)
        yield _dumps(payload)


def _request_payload(request: RequestTrace) -> list[dict[str, Any]]:
    payload: list[dict[str, Any]] = []
    for step, ranked in zip(request.steps, request.lookahead, strict=True):
        line: dict[str, Any] = {str(layer): None if group is None else list(group)
                                for layer, group in sorted(step.items())}
        if ranked:
            line[LOOKAHEAD_KEY] = {str(layer): list(group)
                                   for layer, group in sorted(ranked.items())}
        payload.append(line)
    return payload


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# --- synthetic traces ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Knobs:
    """The generator's arguments, checked."""

    layers: int
    experts: int
    top_k: int
    requests: int
    prefill_tokens: int
    decode_tokens: int
    skew: tuple[float, float]
    locality: float
    window: int
    layer_correlation: float
    lookahead_accuracy: float | None
    dense_layers: tuple[int, ...]
    seed: int

    def __post_init__(self) -> None:
        low, high = self.skew
        for ok, problem in (
            (self.layers >= 1, f"layers must be at least 1, got {self.layers}"),
            (self.experts >= 1, f"experts must be at least 1, got {self.experts}"),
            (1 <= self.top_k <= self.experts,
             f"top_k must be between 1 and experts ({self.experts}), got {self.top_k}"),
            (self.requests >= 0, f"requests must be at least 0, got {self.requests}"),
            (self.prefill_tokens >= 1,
             f"prefill_tokens must be at least 1, got {self.prefill_tokens}"),
            (self.decode_tokens >= 0,
             f"decode_tokens must be at least 0, got {self.decode_tokens}"),
            (0.0 <= low <= high,
             f"skew must be (low, high) with 0 <= low <= high, got {self.skew}"),
            (0.0 <= self.locality <= 1.0, f"locality must be in [0, 1], got {self.locality}"),
            (self.window >= 1, f"window must be at least 1, got {self.window}"),
            (0.0 <= self.layer_correlation <= 1.0,
             f"layer_correlation must be in [0, 1], got {self.layer_correlation}"),
            (self.lookahead_accuracy is None or 0.0 <= self.lookahead_accuracy <= 1.0,
             f"lookahead_accuracy must be in [0, 1] or None, got {self.lookahead_accuracy}"),
            (all(0 <= layer < self.layers for layer in self.dense_layers),
             f"dense_layers must be layer ids below layers ({self.layers}), "
             f"got {list(self.dense_layers)}"),
        ):
            if not ok:
                raise ValueError(problem)

    def describe(self) -> str:
        """The call that regenerates this trace, for the header's ``source``."""
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"synthetic_trace({args})"


@dataclass(frozen=True, slots=True)
class _SyntheticModel:
    """What is drawn once per seed: each MoE layer's popularity (cumulative weights indexed by
    expert id) and, per MoE layer after the first, the successor of each expert of the MoE
    layer before it."""

    experts: int
    moe_layers: tuple[int, ...]
    popularity: dict[int, list[float]]
    successor: dict[int, tuple[int, ...]]


def synthetic_trace(
    *,
    layers: int = 24,
    experts: int = 128,
    top_k: int = 1,
    requests: int = 30,
    prefill_tokens: int = 16,
    decode_tokens: int = 128,
    skew: tuple[float, float] = (0.6, 1.4),
    locality: float = 0.5,
    window: int = 8,
    layer_correlation: float = 0.5,
    lookahead_accuracy: float | None = 0.9,
    dense_layers: Sequence[int] = (),
    seed: int = 0,
) -> RoutingTrace:
    """A trace of ``requests`` requests over layers ``0..layers-1``, each a prefill step then
    ``decode_tokens`` decode steps; the same arguments always give the same trace.

    - Popularity: each MoE layer ranks its experts in its own random order and weights rank r
      by ``1 / (r + 1) ** s``, with the Zipf exponent ``s`` drawn per layer uniformly from
      ``skew`` (so skew differs by layer). Each request favours its own random eighth of each
      layer's experts, twice as likely as the layer says, so that requests differ.
    - Per token and MoE layer, each of ``top_k`` distinct experts is, in order of precedence:
      with probability ``layer_correlation``, the fixed successor (drawn once, from this
      layer's popularity) of the token's expert in the same slot at the previous MoE layer;
      else with probability ``locality``, an expert this layer used in the request's last
      ``window`` tokens (a uniformly chosen token, then one of its experts); else a draw from
      the request's popularity. A repeat within the token is redrawn from popularity.
    - Step 0 is the prefill: per layer, the sorted union over ``prefill_tokens`` tokens; the
      window spans prompt and decoded tokens alike.
    - ``lookahead_accuracy`` (None: no lookahead recorded): every step predicts every MoE layer
      with ``2 * n`` expert ids (capped at ``experts``), n = the experts routed there; each
      routed expert is among the first n with probability ``lookahead_accuracy``, else a wrong
      one drawn from the layer's popularity takes its place; the rest are popular experts not
      yet listed. So ``top_k_overlap`` of the trace is ``lookahead_accuracy`` in expectation.
    - ``dense_layers`` are null in every step and break no correlation chain: a layer after
      one follows the MoE layer before it.

    Routing and lookahead draw from separate streams: changing the accuracy leaves the routing
    as it was, and a trace of n requests is the first n requests of a longer one.
    """
    knobs = _Knobs(layers, experts, top_k, requests, prefill_tokens, decode_tokens,
                   (float(skew[0]), float(skew[1])), locality, window, layer_correlation,
                   lookahead_accuracy, tuple(sorted(set(dense_layers))), seed)
    model = _draw_model(random.Random(seed), knobs)
    routing = random.Random(f"stepline-routing-{seed}")
    predicting = random.Random(f"stepline-lookahead-{seed}")
    return RoutingTrace(
        tuple(_synthetic_request(routing, predicting, model, knobs) for _ in range(requests)),
        model=None, num_experts=experts, top_k=top_k, source=knobs.describe(),
    )


def _draw_model(rng: random.Random, knobs: _Knobs) -> _SyntheticModel:
    moe_layers = tuple(layer for layer in range(knobs.layers) if layer not in knobs.dense_layers)
    popularity: dict[int, list[float]] = {}
    for layer in moe_layers:
        exponent = rng.uniform(*knobs.skew)
        order = list(range(knobs.experts))
        rng.shuffle(order)
        weights = [0.0] * knobs.experts
        for rank, expert in enumerate(order):
            weights[expert] = (rank + 1) ** -exponent
        popularity[layer] = list(itertools.accumulate(weights))
    successor = {later: tuple(_draw(rng, popularity[later]) for _ in range(knobs.experts))
                 for later in moe_layers[1:]}
    return _SyntheticModel(knobs.experts, moe_layers, popularity, successor)


def _synthetic_request(routing: random.Random, predicting: random.Random,
                       model: _SyntheticModel, knobs: _Knobs) -> RequestTrace:
    favoured = {layer: _favour(routing, model.popularity[layer]) for layer in model.moe_layers}
    recent: dict[int, deque[tuple[int, ...]]] = {
        layer: deque(maxlen=knobs.window) for layer in model.moe_layers}
    prompt = [_route_token(routing, model, knobs, favoured, recent)
              for _ in range(knobs.prefill_tokens)]
    tokens = [_union(prompt, model.moe_layers)] + [
        _route_token(routing, model, knobs, favoured, recent) for _ in range(knobs.decode_tokens)]
    steps = tuple({layer: token.get(layer) for layer in range(knobs.layers)} for token in tokens)
    if knobs.lookahead_accuracy is None:
        return RequestTrace(steps)
    accuracy = knobs.lookahead_accuracy
    return RequestTrace(steps, tuple(
        {layer: _predict(predicting, model.popularity[layer], routed, accuracy)
         for layer, routed in token.items()}
        for token in tokens))


def _favour(rng: random.Random, popularity: list[float]) -> list[float]:
    """``popularity`` (cumulative) with a random ``_FAVOURED_SHARE`` of experts boosted."""
    weights = [high - low for low, high in itertools.pairwise([0.0, *popularity])]
    for expert in rng.sample(range(len(weights)), max(1, round(len(weights) * _FAVOURED_SHARE))):
        weights[expert] *= _REQUEST_BOOST
    return list(itertools.accumulate(weights))


def _route_token(rng: random.Random, model: _SyntheticModel, knobs: _Knobs,
                 favoured: dict[int, list[float]],
                 recent: dict[int, deque[tuple[int, ...]]]) -> _Token:
    token: _Token = {}
    before: tuple[int, ...] | None = None
    for layer in model.moe_layers:
        picks: list[int] = []
        for slot in range(knobs.top_k):
            successor = None
            if before is not None and rng.random() < knobs.layer_correlation:
                successor = model.successor[layer][before[slot]]
            picks.append(_pick(rng, successor, knobs.locality, favoured[layer], recent[layer],
                               picks))
        token[layer] = before = tuple(picks)
        recent[layer].append(before)
    return token


def _pick(rng: random.Random, successor: int | None, locality: float, popularity: list[float],
          recent: deque[tuple[int, ...]], taken: list[int]) -> int:
    if successor is not None:
        candidate = successor
    elif recent and rng.random() < locality:
        candidate = rng.choice(rng.choice(recent))
    else:
        candidate = _draw(rng, popularity)
    if candidate not in taken:
        return candidate
    redrawn = _draw_excluding(rng, popularity, set(taken))
    assert redrawn is not None, "top_k <= experts leaves an expert untaken"
    return redrawn


def _union(prompt: list[_Token], layers: Sequence[int]) -> _Token:
    return {layer: tuple(sorted({e for token in prompt for e in token[layer]})) for layer in layers}


def _predict(rng: random.Random, popularity: list[float], routed: tuple[int, ...],
             accuracy: float) -> tuple[int, ...]:
    """``2 * len(routed)`` ranked ids whose first ``len(routed)`` hold each routed expert with
    probability ``accuracy``, else a popular wrong one in its place."""
    head: list[int] = []
    for expert in routed:
        wrong = None if rng.random() < accuracy else _draw_excluding(
            rng, popularity, {*routed, *head})
        head.append(expert if wrong is None else wrong)
    rng.shuffle(head)
    while len(head) < min(2 * len(routed), len(popularity)):
        extra = _draw_excluding(rng, popularity, set(head))
        if extra is None:
            break
        head.append(extra)
    return tuple(head)


def _draw(rng: random.Random, popularity: list[float]) -> int:
    """An expert id drawn by cumulative weights ``popularity``."""
    return min(bisect.bisect_right(popularity, rng.random() * popularity[-1]), len(popularity) - 1)


def _draw_excluding(rng: random.Random, popularity: list[float], excluded: set[int]) -> int | None:
    """A popularity draw outside ``excluded`` (uniform among the rest once draws keep landing
    inside it); None when every expert is excluded."""
    for _ in range(_REJECTION_TRIES):
        candidate = _draw(rng, popularity)
        if candidate not in excluded:
            return candidate
    remaining = [e for e in range(len(popularity)) if e not in excluded]
    return rng.choice(remaining) if remaining else None


__all__ = [
    "FORMAT_VERSION",
    "LOOKAHEAD_KEY",
    "RequestTrace",
    "RoutingTrace",
    "Step",
    "StepLookahead",
    "TraceError",
    "read_trace",
    "synthetic_trace",
    "top_k_overlap",
    "write_trace",
]
