"""The expert router: top-k over temperature-scaled router probabilities, a per-expert capacity
with a fallback, and a diversity penalty; it records per-request routing metrics.

With ``temperature=1``, unbounded capacity, no penalty and ``k >= `` the model's own top-k, the
router reproduces the model's native routing bit for bit (that is what ``RouterConfig.native()``
is). ``k`` is a ceiling: it is capped at the model's ``num_experts_per_tok``, because activating
more experts than the model was trained with costs memory and changes its outputs for no gain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

Fallback = Literal["random", "next_best"]
_NATIVE_K_CEILING = 64
_SEED_MODULUS = 1 << 63
"""torch seeds are 64-bit; a job's seed may be any non-negative int64, so the per-step,
per-layer seed derived from it is folded back into range (unchanged when it already fits)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How tokens are routed; ``expert_capacity=None`` means unbounded."""

    k: int = 8
    temperature: float = 0.5
    expert_capacity: int | None = 256
    fallback: Fallback = "random"
    diversity_penalty: float = 0.0

    @classmethod
    def native(cls) -> RouterConfig:
        """The model's own routing: same experts and weights as ``model.generate()``."""
        return cls(k=_NATIVE_K_CEILING, temperature=1.0, expert_capacity=None)

    def effective_k(self, native_top_k: int) -> int:
        """Experts per token for a model whose native top-k is ``native_top_k``."""
        return max(1, min(self.k, native_top_k))

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> RouterConfig:
        return cls(**meta)


@dataclass(slots=True)
class RoutingTally:
    """One job's routing statistics: what its checkpoint carries and its artifact reports.

    ``expert_counts[layer, expert]`` counts tokens routed there; the routing score is the mean,
    over tokens and layers, of the probability mass of the chosen experts.
    """

    expert_counts: torch.Tensor  # int64 [num_layers, num_experts]
    score_sum: float = 0.0
    score_count: int = 0

    def add(self, row: int, top_index: torch.Tensor, token_scores: torch.Tensor) -> None:
        """Count tokens routed to ``top_index`` ``[tokens, k]`` in layer row ``row``, each with
        its chosen experts' probability mass in ``token_scores`` ``[tokens]`` (float64)."""
        flat = top_index.reshape(-1).to(torch.int64)
        self.expert_counts[row].index_add_(0, flat, torch.ones_like(flat))
        self.score_sum += float(token_scores.sum())
        self.score_count += int(top_index.shape[0])

    @property
    def routing_score(self) -> float:
        return self.score_sum / self.score_count if self.score_count else 0.0

    def activated_experts(self) -> list[int]:
        """Sorted unique expert ids activated in any layer."""
        used = (self.expert_counts > 0).any(dim=0).nonzero().reshape(-1)
        return [int(e) for e in used]

    def activated_by_layer(self, layer_order: dict[int, int]) -> dict[str, list[int]]:
        """Per model layer (``layer_order`` maps it to its row), the expert ids it activated."""
        by_layer = {}
        for layer, row in layer_order.items():
            used = (self.expert_counts[row] > 0).nonzero().reshape(-1)
            by_layer[str(layer)] = [int(e) for e in used]
        return by_layer


@dataclass(slots=True)
class RoutingContext:
    """Per-request routing state the routers write to; it travels in the job's checkpoint
    (during a batched forward it counts the batch, and ``rows`` each job).

    ``expert_counts[layer, expert]`` counts tokens routed there; the routing score is the mean,
    over tokens and layers, of the probability mass of the chosen experts.
    """

    config: RouterConfig
    expert_counts: torch.Tensor  # int64 [num_layers, num_experts]
    score_sum: float = 0.0
    score_count: int = 0
    step_seed: int = 0
    trace: list[tuple[int, list[list[int]]]] | None = None
    layer_order: dict[int, int] = field(default_factory=dict)
    observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    """Called as soon as a layer is routed, before its experts run, with (layer, the router's
    input ``[tokens, H]``, the chosen expert ids ``[tokens, k]``): the expert cache's prefetch
    hook."""
    rows: list[RoutingTally] | None = None
    """Set while a batched forward runs: its input is ``[len(rows), T]`` and each row's tokens
    are also counted in that row's own tally (a job's statistics, not the batch's)."""
    token_mask: torch.Tensor | None = None
    """Set while a left-padded forward runs: ``[len(rows) * T]`` bool, False on padding tokens,
    which the routers send to no expert and which nothing counts (tallies, cache, observer).
    Only native routing pads: a capacity would still see the padding tokens."""

    def record(self, layer: int, top_probs: torch.Tensor, top_index: torch.Tensor) -> None:
        """Count a layer's routing of the forward's tokens (padding excluded)."""
        row = self.layer_order.get(layer, layer)
        token_scores = top_probs.detach().sum(dim=-1).double()
        if self.rows:
            self._record_rows(row, top_index, token_scores)
        if self.token_mask is not None:
            top_index, token_scores = top_index[self.token_mask], token_scores[self.token_mask]
        flat = top_index.reshape(-1).to(torch.int64)
        self.expert_counts[row].index_add_(0, flat, torch.ones_like(flat))
        self.score_sum += float(token_scores.sum())
        self.score_count += int(top_index.shape[0])
        if self.trace is not None:
            self.trace.append((layer, top_index.tolist()))

    def totals(self) -> RoutingTally:
        """What this context has counted, as a tally (sharing the counts tensor): the request's,
        or a batched forward's over all its rows."""
        return RoutingTally(self.expert_counts, self.score_sum, self.score_count)

    @property
    def routing_score(self) -> float:
        return self.totals().routing_score

    def activated_experts(self) -> list[int]:
        """Sorted unique expert ids activated in any layer."""
        return self.totals().activated_experts()

    def activated_by_layer(self) -> dict[str, list[int]]:
        return self.totals().activated_by_layer(self.layer_order)

    def _record_rows(self, row: int, top_index: torch.Tensor, token_scores: torch.Tensor) -> None:
        rows = self.rows
        assert rows is not None
        tokens = int(top_index.shape[0])
        if tokens % len(rows):
            raise ValueError(f"a forward of {tokens} tokens does not split into {len(rows)} rows")
        per_row = tokens // len(rows)
        for i, tally in enumerate(rows):
            span = slice(i * per_row, (i + 1) * per_row)
            index, scores = top_index[span], token_scores[span]
            if self.token_mask is not None:
                index, scores = index[self.token_mask[span]], scores[self.token_mask[span]]
            tally.add(row, index, scores)


class StepRouter(nn.Module):
    """Drop-in for a transformers top-k router: ``forward(h) -> (logits, weights, indices)``."""

    def __init__(
        self,
        weight: nn.Parameter,
        layer: int,
        native_top_k: int,
        normalise: bool,
        context: RoutingContext,
        bias: nn.Parameter | None = None,
        softmax_top: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.softmax_top = softmax_top
        """gpt-oss: the weights are the softmax of the chosen experts' logits (its router takes
        the top-k of the biased logits, then a softmax over those k); under a temperature or
        penalty, the normalised probabilities of the chosen experts (``normalise``)."""
        self.layer = layer
        self.native_top_k = native_top_k
        self.normalise = normalise
        self.context = context

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        config = self.context.config
        hidden = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(hidden, self.weight, self.bias)
        probs = routing_probs(logits, config, self._usage_share())
        top_probs, top_index = torch.topk(probs, config.effective_k(self.native_top_k), dim=-1)
        if config.expert_capacity is not None:
            seed = (self.context.step_seed * 1009 + self.layer) % _SEED_MODULUS
            generator = torch.Generator().manual_seed(seed)
            top_probs, top_index = apply_capacity(probs, top_probs, top_index, config, generator)
        self.context.record(self.layer, top_probs, top_index)
        self._observe(hidden, top_index)
        keep = self.context.token_mask
        if self.softmax_top and config.temperature == 1.0 and config.diversity_penalty <= 0:
            # the same numbers as the normalised probabilities below, in gpt-oss's own order
            chosen = logits.gather(-1, top_index)
            top_probs = torch.softmax(chosen, dim=1, dtype=chosen.dtype)
        elif self.normalise:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        if keep is not None:
            top_probs, top_index = drop_tokens(top_probs, top_index, keep, self.weight.shape[0])
        return logits, top_probs.to(logits.dtype), top_index

    def _observe(self, hidden: torch.Tensor, top_index: torch.Tensor) -> None:
        """Tell the context's observer (the cache's prefetch hook) of the routing, padding out."""
        keep = self.context.token_mask
        if self.context.observer is not None:
            routed = (hidden, top_index) if keep is None else (hidden[keep], top_index[keep])
            self.context.observer(self.layer, *routed)

    def _usage_share(self) -> torch.Tensor | None:
        if self.context.config.diversity_penalty <= 0:
            return None
        row = self.context.expert_counts[self.context.layer_order.get(self.layer, self.layer)]
        total = int(row.sum())
        return row.double() / total if total else None


def drop_tokens(top_probs: torch.Tensor, top_index: torch.Tensor, keep: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Route the tokens outside ``keep`` to no expert: index ``num_experts``, which the fused
    experts' one-hot (``num_experts + 1`` classes) drops, with weight 0 (their MLP output is 0)."""
    dropped = ~keep.unsqueeze(-1)
    return top_probs.masked_fill(dropped, 0.0), top_index.masked_fill(dropped, num_experts)


def routing_probs(
    logits: torch.Tensor, config: RouterConfig, usage_share: torch.Tensor | None
) -> torch.Tensor:
    """Softmax of the temperature-scaled (and diversity-penalised) logits, in float32."""
    scores = logits.float()
    if usage_share is not None:
        # Experts this request already leans on lose up to diversity_penalty logits.
        scores = scores - config.diversity_penalty * usage_share.to(scores)
    if config.temperature != 1.0:
        scores = scores / config.temperature
    return torch.softmax(scores, dim=-1)


def apply_capacity(
    probs: torch.Tensor,
    top_probs: torch.Tensor,
    top_index: torch.Tensor,
    config: RouterConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reassign tokens beyond ``expert_capacity`` per expert, in token order, by the fallback.

    Capacity is soft when every other expert is full too: the token then keeps its choice.
    """
    capacity = config.expert_capacity
    num_experts = probs.shape[-1]
    assert capacity is not None
    if int(torch.bincount(top_index.reshape(-1), minlength=num_experts).max()) <= capacity:
        return top_probs, top_index
    top_probs, top_index = top_probs.clone(), top_index.clone()
    load = [0] * num_experts
    for token in range(top_index.shape[0]):
        for slot in range(top_index.shape[1]):
            expert = int(top_index[token, slot])
            if load[expert] >= capacity:
                taken = {int(e) for e in top_index[token]}
                alt = _fallback_expert(probs[token], taken, load, capacity, config, generator)
                if alt is not None:
                    expert = alt
                    top_index[token, slot] = alt
                    top_probs[token, slot] = probs[token, alt]
            load[expert] += 1
    return top_probs, top_index


def _fallback_expert(
    token_probs: torch.Tensor,
    taken: set[int],
    load: list[int],
    capacity: int,
    config: RouterConfig,
    generator: torch.Generator,
) -> int | None:
    open_experts = [e for e in range(len(load)) if load[e] < capacity and e not in taken]
    if not open_experts:
        return None
    if config.fallback == "next_best":
        return max(open_experts, key=lambda e: (float(token_probs[e]), -e))
    pick = int(torch.randint(len(open_experts), (1,), generator=generator))
    return open_experts[pick]
