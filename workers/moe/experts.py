"""Cache-backed replacement for a transformers fused-experts module (``layer.mlp.experts``).

It keeps the call signature ``forward(hidden, top_k_index, top_k_weights)`` and the eager
implementation's arithmetic and order, so outputs are bit-identical to the native module; the
weights come from the :class:`ExpertCache` instead of the module's own parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from workers.moe.copy import Weights
from workers.moe.expert_cache import ExpertCache
from workers.moe.versioned import VersionedExperts


class CachedExperts(nn.Module):
    """Runs the experts a batch routes to, a slot-pool-sized group at a time, pinned while used;
    each routed expert runs once per forward over all the tokens (rows) routed to it.
    With :class:`VersionedExperts` the weights come from the active version's cache. The routing
    itself reaches the cache earlier, from the router (so prefetch overlaps this compute)."""

    def __init__(
        self,
        cache: ExpertCache | VersionedExperts,
        layer: int,
        num_experts: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self._source = cache
        self.layer = layer
        self.num_experts = num_experts
        self.act_fn = act_fn

    @property
    def cache(self) -> ExpertCache:
        source = self._source
        return source.active if isinstance(source, VersionedExperts) else source

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            routings = mask.sum(dim=(-1, -2))
            hit = torch.greater(routings, 0).nonzero().reshape(-1)
        needed = [int(e) for e in hit if int(e) < self.num_experts]
        # One run of an expert serves every token routed to it: the rows of a batched decode
        # step share one read of its weights, which the cache counts per token and per run.
        tokens = {e: int(routings[e]) for e in needed}
        cache = self.cache  # one version for the whole pass
        group_size = cache.capacity(self.layer)
        # Ascending expert order in every group keeps the native accumulation order.
        for start in range(0, len(needed), group_size):
            group = needed[start : start + group_size]
            weights = cache.acquire(self.layer, group, tokens)
            try:
                for expert in group:
                    top_k_pos, token_idx = torch.where(mask[expert])
                    out = self.expert_output(weights[expert], hidden_states[token_idx])
                    out = out * top_k_weights[token_idx, top_k_pos, None]
                    final.index_add_(0, token_idx, out.to(final.dtype))
            finally:
                cache.release(self.layer, group)
        return final

    def expert_output(self, weights: Weights, states: torch.Tensor) -> torch.Tensor:
        """One expert's MLP on the tokens routed to it (``weights``: its cached slice)."""
        gate_up, down = weights[0], weights[1]
        gate, up = F.linear(states, gate_up).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, down)


class GptOssCachedExperts(CachedExperts):
    """:class:`CachedExperts` with ``GptOssExperts``' arithmetic: transposed fused weights with
    biases, gate and up interleaved, both clamped to ``limit``, gate scaled by ``alpha``."""

    def __init__(
        self, cache: ExpertCache | VersionedExperts, layer: int, num_experts: int, alpha: float,
        limit: float,
    ) -> None:
        super().__init__(cache, layer, num_experts, torch.sigmoid)
        self.alpha = alpha
        self.limit = limit

    def expert_output(self, weights: Weights, states: torch.Tensor) -> torch.Tensor:
        gate_up_proj, down_proj, gate_up_bias, down_bias = weights
        gate_up = states @ gate_up_proj + gate_up_bias
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ down_proj + down_bias
