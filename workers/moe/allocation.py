"""Skew-aware split of a fixed number of expert slots across MoE layers: per-layer LRU hit
curves from recent routing (Mattson's stack algorithm) and the split that maximises total hits.

Pure functions, and a tracker the cache feeds with routing; the cache decides when to
rebalance and applies the plan (evicting from layers that shrink).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import add

Bound = Mapping[int, int] | int
"""A per-layer slot bound: one number for every layer, or one per layer."""
_VALUE_SCALE = 1 << 20  # fractional curve values are compared to this resolution


def lru_hit_curve(steps: Sequence[Sequence[int]], max_slots: int) -> list[int]:
    """LRU hits of one layer's trace at every size 0..max_slots, in one pass.

    ``steps`` holds the experts each token needs, pinned together as in
    :func:`workers.moe.policy.simulate_hits`, which this matches exactly at every feasible size.
    Sizes below the largest group cannot serve a token and read 0.
    """
    stack: list[int] = []  # most recent first
    at_depth = [0] * (max_slots + 1)  # hits that need exactly this many slots
    for needed in steps:
        for depth in _serve_token(stack, needed):
            if depth <= max_slots:
                at_depth[depth] += 1
    return _cumulative(at_depth, largest_group(steps))


def _serve_token(stack: list[int], needed: Sequence[int]) -> list[int]:
    """The LRU stack depths (1-based) of one token's hits, then the token moves to the top.

    With pinning a token's hits are the experts within the top ``s`` of the stack *before* the
    token (Mattson's inclusion still holds), so every depth is read first; a repeat within
    the token always hits (depth 1). The policy records a token's experts in order, so the
    last-named ends most recent.
    """
    distinct = set(needed)
    depths = [stack.index(expert) + 1 for expert in distinct if expert in stack]
    depths += [1] * (len(needed) - len(distinct))
    last_seen = {expert: position for position, expert in enumerate(needed)}
    stack[:] = [e for e in stack if e not in last_seen]
    stack[0:0] = sorted(last_seen, key=last_seen.__getitem__, reverse=True)
    return depths


def largest_group(steps: Iterable[Sequence[int]]) -> int:
    """The most distinct experts one token needs: the least number of slots that serves all."""
    return max((len(set(needed)) for needed in steps), default=0)


def _cumulative(at_depth: Sequence[int], feasible_from: int) -> list[int]:
    curve, running = [], 0
    for slots, hits in enumerate(at_depth):
        running += hits
        curve.append(running if slots >= max(feasible_from, 1) else 0)
    return curve


def allocate_slots(
    curves: Mapping[int, Sequence[float]], total: int, minimum: Bound, maximum: Bound
) -> dict[int, int]:
    """Slots per layer that maximise the summed ``curves`` (``curves[layer][s]``: hits with
    ``s`` slots, flat past its end), using exactly ``total`` slots unless every layer reaches
    its maximum, each layer within [minimum, maximum]. Among equal totals the most even split
    wins, then the one that favours lower layer ids, so plans are stable under ties.

    Exact, by dynamic programming over layers (O(layers x spare slots x per-layer range)): a
    greedy on marginal gain, even with look-ahead, misses the optimum on non-concave curves,
    and LRU hit curves of routing traces are not always concave. ``minimum`` should be at
    least the routing top-k, since a token's experts are pinned together.
    """
    layers = sorted(curves)
    low = {layer: _bound(minimum, layer, "minimum") for layer in layers}
    high = {layer: _bound(maximum, layer, "maximum") for layer in layers}
    _check_bounds(low, high, total)
    spare = min(total - sum(low.values()), sum(high[ly] - low[ly] for ly in layers))
    gains = [_gains(curves[ly], low[ly], min(high[ly] - low[ly], spare)) for ly in layers]
    extra = _best_split(gains, [low[ly] for ly in layers], spare)
    return {layer: low[layer] + more for layer, more in zip(layers, extra, strict=True)}


def _bound(bound: Bound, layer: int, which: str) -> int:
    if isinstance(bound, int):
        return bound
    if layer not in bound:
        raise ValueError(f"no {which} slot count for layer {layer}; give one for every layer")
    return bound[layer]


def _check_bounds(low: Mapping[int, int], high: Mapping[int, int], total: int) -> None:
    for layer in low:
        if not 0 <= low[layer] <= high[layer]:
            raise ValueError(
                f"layer {layer}: slot bounds [{low[layer]}, {high[layer]}] are empty or negative"
            )
    if sum(low.values()) > total:
        raise ValueError(
            f"the per-layer minimum slots add up to {sum(low.values())} but only {total} are "
            "available; raise the expert memory budget or lower the minimum (routing top-k)"
        )


def _gains(curve: Sequence[float], low: int, room: int) -> list[float]:
    """Value of giving ``j`` slots above ``low``, for j = 0..room."""
    def value(slots: int) -> float:
        return float(curve[min(slots, len(curve) - 1)]) if curve else 0.0
    return [value(low + j) for j in range(room + 1)]


def _best_split(gains: Sequence[Sequence[float]], base: Sequence[int], spare: int) -> list[int]:
    """How many of exactly ``spare`` extra slots each layer gets, maximising the summed gains,
    then minimising the sum of squared slots (evenness), then giving later layers the fewest."""
    keyed = _split_keys(gains, base)
    floor = -4 * sum(max(map(abs, layer_keys)) for layer_keys in keyed) - 1  # unreachable
    tables = [[0] + [floor] * spare]  # best key per number of extra slots used so far
    for layer_keys in keyed:
        tables.append(_add_layer(tables[-1], layer_keys))
    extra, left = [0] * len(keyed), spare
    for index in range(len(keyed) - 1, -1, -1):
        before, layer_keys, target = tables[index], keyed[index], tables[index + 1][left]
        extra[index] = next(j for j in range(min(len(layer_keys) - 1, left) + 1)
                            if before[left - j] + layer_keys[j] == target)
        left -= extra[index]
    return extra


def _split_keys(gains: Sequence[Sequence[float]], base: Sequence[int]) -> list[list[int]]:
    """Value and evenness folded into one integer per (layer, extra slots), so that the
    knapsack adds and compares plain ints at C speed; values count to 2**-20 unless whole."""
    whole = all(float(value).is_integer() for g in gains for value in g)
    scale = 1 if whole else _VALUE_SCALE
    unit = sum((slots + len(g)) ** 2 for g, slots in zip(gains, base, strict=True)) + 1
    return [[round(value * scale) * unit - (slots + j) ** 2 for j, value in enumerate(g)]
            for g, slots in zip(gains, base, strict=True)]


def _add_layer(best: Sequence[int], layer_keys: Sequence[int]) -> list[int]:
    """One knapsack step: per budget, the best key with this layer taking 0..len-1 slots."""
    width = len(layer_keys)
    return [max(map(add, best[max(0, budget - width + 1) : budget + 1][::-1], layer_keys))
            for budget in range(len(best))]


@dataclass(slots=True)
class _LayerReuse:
    """One layer's LRU stack over all its history, and its last steps' hit depths."""

    stack: list[int] = field(default_factory=list)
    steps: deque[tuple[tuple[int, ...], int]] = field(default_factory=deque)
    """Per token in the window: its hits' stack depths, and how many experts it needed."""
    at_depth: Counter[int] = field(default_factory=Counter)
    group_sizes: Counter[int] = field(default_factory=Counter)

    def add(self, depths: tuple[int, ...], group: int) -> None:
        self.steps.append((depths, group))
        self.at_depth.update(depths)
        self.group_sizes[group] += 1

    def drop_oldest(self) -> None:
        depths, group = self.steps.popleft()
        self.at_depth.subtract(depths)
        self.group_sizes[group] -= 1

    def curve(self, max_slots: int) -> list[int]:
        largest = max((size for size, n in self.group_sizes.items() if n > 0), default=0)
        at_depth = [self.at_depth[depth] for depth in range(max_slots + 1)]
        return _cumulative(at_depth, largest)


class ReuseTracker:
    """Per layer, the LRU hit depths of the last ``window`` tokens, and the slot plan they
    argue for.

    The cache records each token's experts per layer and, when it rebalances, asks for
    :meth:`plan`. Depths are taken once, at record time, against the layer's whole history,
    so a plan costs O(layers x slots) to read plus the split, not a replay of the window; the
    curve equals :func:`lru_hit_curve` of the window except that reuse reaching back before
    the window counts (no cold start at the window's edge).
    """

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"a reuse window needs at least one token, got {window}")
        self.window = window
        self._layers: dict[int, _LayerReuse] = {}

    def record(self, layer: int, experts: Sequence[int]) -> None:
        """One token at ``layer`` needed ``experts`` (pinned together)."""
        reuse = self._layers.setdefault(layer, _LayerReuse())
        reuse.add(tuple(_serve_token(reuse.stack, experts)), len(set(experts)))
        if len(reuse.steps) > self.window:
            reuse.drop_oldest()

    def merge(self, other: ReuseTracker) -> None:
        """Take in ``other``'s windows as older history than this tracker's own (a new model
        version starts from the live one's reuse), keeping the newest ``window`` tokens."""
        for layer, theirs in other._layers.items():
            ours = self._layers.get(layer, _LayerReuse())
            merged = _LayerReuse(list(ours.stack or theirs.stack))
            for depths, group in [*theirs.steps, *ours.steps][-self.window :]:
                merged.add(depths, group)
            self._layers[layer] = merged

    @property
    def layers(self) -> list[int]:
        """The layers recorded so far."""
        return sorted(self._layers)

    def curves(self, max_slots: int, layers: Iterable[int] = ()) -> dict[int, list[int]]:
        """LRU hits per size 0..max_slots over the window, per recorded layer and ``layers``
        (an unrecorded layer's curve is all zero)."""
        empty = _LayerReuse()
        wanted = sorted(set(self._layers) | set(layers))
        return {ly: self._layers.get(ly, empty).curve(max_slots) for ly in wanted}

    def plan(
        self, total: int, minimum: Bound, maximum: Bound, layers: Iterable[int] = ()
    ) -> dict[int, int]:
        """Slots per layer for ``total`` slots (see :func:`allocate_slots`), over ``layers``,
        the recorded ones and those that per-layer bounds name: pass every layer the total
        covers, so that one not routed yet is planned too instead of keeping its old share."""
        planned = set(layers) | set(self._layers)
        for bound in (minimum, maximum):
            if not isinstance(bound, int):
                planned |= set(bound)
        top = maximum if isinstance(maximum, int) else max(maximum.values(), default=0)
        return allocate_slots(self.curves(top, planned), total, minimum, maximum)
