"""The router: native reproduction, temperature, capacity with fallback, diversity penalty."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.moe.router import RouterConfig, RoutingContext, StepRouter, apply_capacity

pytestmark = pytest.mark.timeout(30)

EXPERTS, HIDDEN = 8, 16


def _router(config: RouterConfig, native_top_k: int = 2, normalise: bool = True) -> StepRouter:
    weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)))
    context = RoutingContext(config, torch.zeros(1, EXPERTS, dtype=torch.int64),
                             layer_order={0: 0})
    return StepRouter(weight, 0, native_top_k, normalise, context)


def _hidden(tokens: int = 12) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4))


def test_native_config_reproduces_the_mixtral_router_bit_for_bit() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    native = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS))
    ours = _router(RouterConfig.native())
    native.weight = ours.weight
    for want, got in zip(native(_hidden()), ours(_hidden()), strict=True):
        assert torch.equal(want, got)


def test_k_is_capped_at_the_models_own_top_k() -> None:
    _, _, index = _router(RouterConfig(k=8, expert_capacity=None))(_hidden())
    assert index.shape[1] == 2
    assert RouterConfig(k=1).effective_k(2) == 1


def test_a_lower_temperature_keeps_the_experts_and_sharpens_the_weights() -> None:
    _, warm, warm_index = _router(RouterConfig.native())(_hidden())
    _, cold, cold_index = _router(RouterConfig(temperature=0.5, expert_capacity=None))(_hidden())
    assert torch.equal(warm_index, cold_index)
    assert bool((cold[:, 0] >= warm[:, 0]).all())


def test_capacity_moves_overflow_tokens_to_the_next_best_open_expert() -> None:
    # given four tokens that all prefer expert 0 then 1, and capacity 2
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 4)
    top_probs, top_index = torch.topk(probs, 1, dim=-1)
    config = RouterConfig(k=1, expert_capacity=2, fallback="next_best")
    # when capacity applies
    _, index = apply_capacity(probs, top_probs, top_index, config, torch.Generator())
    # then the first two keep expert 0 and the rest spill to expert 1
    assert index.reshape(-1).tolist() == [0, 0, 1, 1]


def test_random_fallback_is_deterministic_for_a_given_seed() -> None:
    probs = torch.full((6, EXPERTS), 1.0 / EXPERTS)
    top_probs, top_index = torch.zeros(6, 1), torch.zeros(6, 1, dtype=torch.int64)
    config = RouterConfig(k=1, expert_capacity=1, fallback="random")
    runs = [apply_capacity(probs, top_probs, top_index, config,
                           torch.Generator().manual_seed(11))[1] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0].reshape(-1).tolist())) == 6  # capacity 1 each: all distinct


def test_diversity_penalty_steers_away_from_already_used_experts() -> None:
    plain = _router(RouterConfig(k=2, temperature=1.0, expert_capacity=None))
    penalised = _router(RouterConfig(k=2, temperature=1.0, expert_capacity=None,
                                     diversity_penalty=50.0))
    hidden = _hidden(1)
    _, _, first = plain(hidden)
    penalised.context.expert_counts[0, first.reshape(-1)] = 10
    _, _, second = penalised(hidden)
    assert set(first.reshape(-1).tolist()).isdisjoint(second.reshape(-1).tolist())


def test_routing_metrics_accumulate_counts_and_score() -> None:
    router = _router(RouterConfig.native())
    router(_hidden(5))
    context = router.context
    assert int(context.expert_counts.sum()) == 10
    assert 0.0 < context.routing_score <= 1.0
    assert context.activated_experts() == sorted(set(context.activated_experts()))


def test_a_seed_near_the_top_of_int64_still_routes_with_capacity() -> None:
    from workers.moe.runner import TextRunner

    runner = TextRunner(router=RouterConfig(k=2, expert_capacity=1))
    params = {"prompt": "hello there", "max_new_tokens": 3, "seed": 2**63 - 1,
              "model": "qwen3-moe-tiny"}
    state = None
    for index in range(runner.plan(params).num_chunks):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state.meta["generated"] == 3
