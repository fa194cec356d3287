"""What the next MoE layer will route to, before it routes: decayed routing history and the
next layer's own router applied early (lookahead), blended into calibrated confidences.

Two sources of prediction:

- **History**: per-layer expert frequencies and expert@L -> expert@L+1 transition counts
  (including last layer -> first layer of the next token), decayed so that a formerly hot expert
  ages out, and smoothed toward the layer's frequency so one observation is not a certainty.
  Confidences are inclusion probabilities: the estimated chance that an expert is among those the
  next layer routes to.
- **Lookahead**: the next layer's router weights applied to this layer's router input (no
  training). In a pre-norm transformer the residual stream changes slowly from one layer to the
  next, so the next router's top-k on today's hidden state names most of tomorrow's experts
  (Fate and pre-gated MoE report 90 %+). Its confidence is its own measured accuracy per layer
  (an exponential average of the share of routed experts it named), so a predictor that does not
  work on a model stops being trusted instead of moving bytes for nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

_RESCALE_AT = 1e150


class RoutingHistory:
    """Decayed counts of expert use per layer and of transitions between consecutive MoE
    layers; the transition out of the last layer goes to the first layer of the next token.

    Decay is lazy: each observation adds a weight that grows by ``1 / decay``, which is the same
    ranking and the same shares as multiplying every old count by ``decay``, without touching them.
    Arrays are numpy: a token touches a handful of entries per layer, and numpy's scalar updates
    cost far less than torch's on this path, which runs once per layer per token.
    """

    def __init__(self, layers: Sequence[int], num_experts: int, decay: float = 0.999,
                 smoothing: float = 2.0, max_group: int | None = None) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"history decay must be in (0, 1], got {decay}")
        self.max_group = max_group
        """Transitions are learnt only between groups this small (a token's experts, not a
        prefill's union, which would link every expert to every other)."""
        self.layers = list(layers)
        self.num_experts = num_experts
        self.decay = decay
        self.smoothing = smoothing
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.frequency = np.zeros((n, num_experts))
        self.steps = np.zeros(n)
        # transitions[r][a, b]: a used at layer r, then b at the layer after r (wrapping).
        self.transitions = np.zeros((n, num_experts, num_experts))
        # occurrences[r][a]: how often a was used at layer r with its successor observed.
        self.occurrences = np.zeros((n, num_experts))
        self._weight = [1.0] * n

    def next_layer(self, layer: int) -> int:
        """The MoE layer routed after ``layer``: the next one, or the first of the next token."""
        return self.layers[(self._row[layer] + 1) % len(self.layers)]

    def record(self, layer: int, experts: Sequence[int], previous: Sequence[int] | None) -> None:
        """``experts`` were used at ``layer``; ``previous`` at the MoE layer routed before it
        (the previous layer, or the last layer of the previous token)."""
        row = self._row[layer]
        weight = self._advance(row)
        used = sorted(set(experts))
        if not used:
            return
        frequency = self.frequency[row]
        for expert in used:
            frequency[expert] += weight
        self.steps[row] += weight
        small = self.max_group is None or (len(used) <= self.max_group
                                           and len(set(previous or ())) <= self.max_group)
        if previous and small:
            prev_row = (row - 1) % len(self.layers)
            transitions, occurrences = self.transitions[prev_row], self.occurrences[prev_row]
            for a in set(previous):
                occurrences[a] += weight
                for b in used:
                    transitions[a, b] += weight

    def _advance(self, row: int) -> float:
        self._weight[row] /= self.decay
        if self._weight[row] > _RESCALE_AT:
            scale = self._weight[row]
            before = (row - 1) % len(self.layers)
            self.frequency[row] /= scale
            self.steps[row] /= scale
            self.transitions[before] /= scale
            self.occurrences[before] /= scale
            self._weight[row] = 1.0
        return self._weight[row]

    def inclusion(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        """For every expert of the layer after ``layer``, the estimated probability that it is
        routed there given ``experts`` at ``layer``: transitions from each of ``experts``,
        smoothed toward the next layer's marginal (``smoothing`` pseudo-observations)."""
        row = self._row[layer]
        next_row = (row + 1) % len(self.layers)
        steps = float(self.steps[next_row])
        frequency = self.frequency[next_row]
        # The prior: the share of steps that used each expert there, itself smoothed toward
        # "any expert, equally" so that one layer seen once is not a certainty either.
        per_step = float(frequency.sum()) / steps if steps > 0 else 1.0
        s = self.smoothing
        base = (frequency + s * per_step / self.num_experts) / (steps + s)
        if not experts:
            return np.asarray(np.minimum(base, 1.0))
        index = sorted(set(experts))
        counts = self.transitions[row][index]  # [len(experts), E]
        seen = self.occurrences[row][index][:, None]
        per_expert = (counts + self.smoothing * base) / (seen + self.smoothing)
        # The step's experts each predict; a rarely seen one predicts noisily, so average.
        return np.asarray(np.minimum(per_expert.mean(axis=0), 1.0))

    def ranking(self) -> list[tuple[int, int]]:
        """Every (layer, expert), most frequently used first (layer order breaks ties)."""
        shares = self.frequency / np.asarray(self._weight)[:, None]
        order = np.argsort(-shares.reshape(-1), kind="stable")
        return [(self.layers[int(i) // self.num_experts], int(i) % self.num_experts) for i in order]

    def share(self, layer: int, expert: int) -> float:
        """``expert``'s share of ``layer``'s (decayed) use."""
        row = self.frequency[self._row[layer]]
        total = float(row.sum())
        return float(row[expert]) / total if total else 0.0

    def merge(self, other: RoutingHistory) -> None:
        """Add ``other``'s counts (another version of the same model), in this one's scale.
        Transitions out of row r were counted at the weight of the row after it."""
        ratio = np.asarray(self._weight) / np.asarray(other._weight)
        self.frequency += other.frequency * ratio[:, None]
        self.steps += other.steps * ratio
        ratio_next = np.roll(ratio, -1)
        self.transitions += other.transitions * ratio_next[:, None, None]
        self.occurrences += other.occurrences * ratio_next[:, None]


@dataclass(frozen=True, slots=True)
class Lookahead:
    """The next layer's router applied to this layer's hidden state: experts ranked best first,
    with the router's probability of each (mean over the step's tokens)."""

    layer: int
    """The layer this predicts (not the one it was computed at)."""
    ranked: tuple[int, ...]
    probs: tuple[float, ...]


class LookaheadPredictor:
    """Applies layer l+1's router weight to layer l's router input; the last MoE layer predicts
    the first layer of the next token the same way."""

    def __init__(self, gates: Mapping[int, torch.Tensor], rank: int) -> None:
        self.layers = sorted(gates)
        self._gates = dict(gates)
        self.rank = rank

    def next_layer(self, layer: int) -> int:
        index = self.layers.index(layer)
        return self.layers[(index + 1) % len(self.layers)]

    def predict(self, layer: int, hidden: torch.Tensor) -> Lookahead:
        """Rank the experts of the layer after ``layer`` from ``hidden`` ([tokens, H])."""
        target = self.next_layer(layer)
        weight = self._gates[target]
        with torch.no_grad():
            logits = F.linear(hidden.reshape(-1, weight.shape[1]).to(weight.dtype), weight)
            probs = torch.softmax(logits.float(), dim=-1).mean(dim=0)
            top = torch.topk(probs, min(self.rank, probs.shape[0]))
        return Lookahead(target, tuple(int(e) for e in top.indices),
                         tuple(float(p) for p in top.values))


class LookaheadAccuracy:
    """Per layer, how often lookahead named the experts that were then routed: the share of
    routed experts found among the prediction's first ``len(routed)`` (top-k overlap), as an
    exponential average; the cache's counters keep the totals."""

    def __init__(self, decay: float = 0.98) -> None:
        self._decay = decay
        self._recent: dict[int, float] = {}

    def score(self, prediction: Lookahead, routed: Sequence[int]) -> float:
        """Record one prediction against what was routed; returns its top-k overlap."""
        routed_set = set(routed)
        if not routed_set:
            return 0.0
        named = set(prediction.ranked[: len(routed_set)])
        share = len(named & routed_set) / len(routed_set)
        layer = prediction.layer
        old = self._recent.get(layer)
        decay = self._decay
        self._recent[layer] = share if old is None else decay * old + (1 - decay) * share
        return share

    def recent(self, layer: int) -> float | None:
        """The running (exponentially weighted) accuracy for ``layer``; None before any."""
        return self._recent.get(layer)


class Calibration:
    """Maps a predictor's raw confidence to the share of such predictions that came true,
    measured online in bins (with a prior pulling each bin toward its raw value): a prefetch
    threshold then means the same on any model and trace."""

    def __init__(self, bins: int = 20, prior: float = 5.0) -> None:
        self.bins = bins
        self.prior = prior
        self.count = np.zeros(bins)
        self.hits = np.zeros(bins)

    def _bin(self, raw: float) -> int:
        return min(self.bins - 1, max(0, int(raw * self.bins)))

    def observe(self, raw: float, came_true: bool) -> None:
        b = self._bin(raw)
        self.count[b] += 1
        self.hits[b] += came_true

    def __call__(self, raw: float) -> float:
        b = self._bin(raw)
        return float((self.hits[b] + self.prior * raw) / (self.count[b] + self.prior))


def lookahead_inclusion(prediction: Lookahead, accuracy: float, num_experts: int,
                        routed_per_step: int) -> np.ndarray:
    """Inclusion probabilities from a lookahead: its first ``routed_per_step`` experts are right
    with the layer's measured ``accuracy``; the rest of the mass falls on the next ranks in
    proportion to the router's own probabilities."""
    out = np.zeros(num_experts)
    k = max(1, routed_per_step)
    head, tail = prediction.ranked[:k], prediction.ranked[k:]
    for expert in head:
        out[expert] = accuracy
    missing = (1.0 - accuracy) * k  # routed experts the head did not name
    tail_mass = sum(prediction.probs[k:])
    for expert, prob in zip(tail, prediction.probs[k:], strict=True):
        if tail_mass > 0:
            out[expert] = min(1.0, missing * prob / tail_mass)
    return out
