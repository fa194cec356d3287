"""DeepSeek-V3's MoE block served through the expert cache: its group-limited sigmoid router as
a step router, and the bytes of its always-resident shared experts.

``DeepseekV3MoE`` keeps its shape: ``gate`` (replaced by :class:`GroupLimitedRouter`), fused
routed ``experts`` (replaced by the cache-backed ``CachedExperts``, whose arithmetic is
``DeepseekV3Experts``' own) and ``shared_experts``, a dense MLP every token runs, which stays a
model parameter on the device. Multi-head Latent Attention needs nothing here: transformers'
``DynamicCache`` already holds each layer's compressed latent (the normed ``c_kv`` as keys, the
roped ``k_pe`` as values) and the attention expands it to per-head K/V on every forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from workers.moe.router import (
    _SEED_MODULUS,
    RouterConfig,
    RoutingContext,
    StepRouter,
    apply_capacity,
    drop_tokens,
)

_GROUP_BEST = 2
"""A group's score is the sum of its two best biased expert scores (DeepSeek-V3's rule)."""


class GroupLimitedRouter(StepRouter):
    """``DeepseekV3TopkRouter``'s arithmetic as a step router: sigmoid scores; each token
    chooses its top-k experts by score plus ``e_score_correction_bias`` among the ``topk_group``
    of ``n_group`` groups whose two best biased scores sum highest; the weights are the chosen
    experts' unbiased scores, normalised (``norm_topk_prob``) and scaled by
    ``routed_scaling_factor``.

    Configured routing acts on the same scores: the temperature divides the logits before the
    sigmoid, the diversity penalty lowers the biased choice scores, ``k`` caps the top-k, and a
    token past an expert's capacity falls back (by the unbiased scores) to any open expert,
    within its groups or not. The tally's routing score is the chosen experts' share of the
    token's total sigmoid score."""

    def __init__(self, gate: nn.Module, layer: int, normalise: bool,
                 context: RoutingContext) -> None:
        weight = gate.get_parameter("weight")
        super().__init__(weight, layer, int(getattr(gate, "top_k")), normalise, context)  # noqa: B009
        self.correction = gate.get_buffer("e_score_correction_bias")
        self.num_group = int(getattr(gate, "num_group"))  # noqa: B009
        self.topk_group = int(getattr(gate, "topk_group"))  # noqa: B009
        self.scaling = float(getattr(gate, "routed_scaling_factor"))  # noqa: B009

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        config = self.context.config
        hidden = hidden_states.view(-1, self.weight.shape[1])
        logits = F.linear(hidden.type(torch.float32), self.weight.type(torch.float32))
        scaled = logits if config.temperature == 1.0 else logits / config.temperature
        scores = scaled.sigmoid()
        choice = scores + self.correction
        usage = self._usage_share()
        if usage is not None:
            choice = choice - config.diversity_penalty * usage.to(choice)
        choice = self.group_limited(choice)
        k = config.effective_k(self.native_top_k)
        top_index = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        top_weights = scores.gather(1, top_index)
        if config.expert_capacity is not None:
            top_weights, top_index = self._capacity(scores, top_weights, top_index, config)
        self.context.record(self.layer, top_weights / scores.sum(dim=-1, keepdim=True),
                            top_index)
        self._observe(hidden, top_index)
        if self.normalise:
            denominator = top_weights.sum(dim=-1, keepdim=True) + 1e-20
            top_weights = top_weights / denominator
        top_weights = top_weights * self.scaling
        keep = self.context.token_mask
        if keep is not None:
            top_weights, top_index = drop_tokens(top_weights, top_index, keep,
                                                 self.weight.shape[0])
        return logits, top_weights, top_index

    def group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` ``[tokens, E]`` with every expert outside the token's best
        ``topk_group`` groups at -inf, by ``DeepseekV3TopkRouter``'s operations in its order."""
        experts = choice.shape[-1]
        per_group = experts // self.num_group
        group_scores = (choice.view(-1, self.num_group, per_group)
                        .topk(_GROUP_BEST, dim=-1)[0].sum(dim=-1))
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group)
                      .reshape(-1, experts))
        return choice.masked_fill(~score_mask.bool(), float("-inf"))

    def _capacity(self, scores: torch.Tensor, top_weights: torch.Tensor,
                  top_index: torch.Tensor, config: RouterConfig,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        seed = (self.context.step_seed * 1009 + self.layer) % _SEED_MODULUS
        generator = torch.Generator().manual_seed(seed)
        return apply_capacity(scores, top_weights, top_index, config, generator)


_SHARED = ("shared_experts", "shared_expert", "shared_expert_gate")
"""DeepSeek-V3's ``shared_experts``; Qwen3-Next's ``shared_expert`` and its sigmoid gate."""


def shared_expert_bytes(block: nn.Module) -> int:
    """Bytes of an MoE block's shared experts (DeepSeek-V3, Qwen3-Next; 0 without them)."""
    total = 0
    for name in _SHARED:
        shared = getattr(block, name, None)
        if isinstance(shared, nn.Module):
            total += sum(p.numel() * p.element_size() for p in shared.parameters())
    return total


def is_group_limited(block: nn.Module) -> bool:
    """Whether ``block``'s router is DeepSeek-V3's (group-limited, with a score bias)."""
    gate = getattr(block, "gate", None)
    return isinstance(gate, nn.Module) and hasattr(gate, "e_score_correction_bias")
