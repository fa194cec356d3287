"""Routing history: per-layer expert frequencies and expert@L -> expert@L+1 transition counts,
used to prefetch the next layer's likely experts and to rank experts for warm-up."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RoutingHistory:
    """Counts of expert use per layer and of transitions between consecutive MoE layers."""

    def __init__(self, layers: Sequence[int], num_experts: int) -> None:
        self.layers = list(layers)
        self.num_experts = num_experts
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        self.frequency = torch.zeros(len(self.layers), num_experts, dtype=torch.float64)
        self.transitions = torch.zeros(
            max(len(self.layers) - 1, 0), num_experts, num_experts, dtype=torch.float64
        )

    def next_layer(self, layer: int) -> int | None:
        row = self._row[layer]
        return self.layers[row + 1] if row + 1 < len(self.layers) else None

    def record(self, layer: int, experts: Sequence[int], previous: Sequence[int] | None) -> None:
        """``experts`` were used at ``layer``; ``previous`` at the MoE layer before it."""
        row = self._row[layer]
        index = torch.tensor(list(experts), dtype=torch.int64)
        self.frequency[row].index_add_(0, index, torch.ones(len(index), dtype=torch.float64))
        if previous and row > 0:
            prev = torch.tensor(list(previous), dtype=torch.int64)
            self.transitions[row - 1][prev.unsqueeze(1), index.unsqueeze(0)] += 1.0

    def predict_next(
        self, layer: int, experts: Sequence[int], count: int
    ) -> list[tuple[int, float]]:
        """The ``count`` experts most likely at the layer after ``layer`` given ``experts``,
        each with its share of the observed transitions (its confidence)."""
        row = self._row[layer]
        if row + 1 >= len(self.layers) or count <= 0:
            return []
        scores = self.transitions[row][list(experts)].sum(dim=0)
        if float(scores.sum()) == 0.0:
            scores = self.frequency[row + 1].clone()
        total = float(scores.sum())
        if total == 0.0:
            return []
        order = torch.argsort(scores, descending=True, stable=True)[:count]
        return [(int(e), float(scores[e]) / total) for e in order if float(scores[e]) > 0.0]

    def ranking(self) -> list[tuple[int, int]]:
        """Every (layer, expert), most frequently used first (layer order breaks ties)."""
        flat = self.frequency.reshape(-1)
        order = torch.argsort(flat, descending=True, stable=True)
        return [(self.layers[int(i) // self.num_experts], int(i) % self.num_experts) for i in order]
