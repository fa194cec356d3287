"""A loaded MoE model wired for serving: its experts moved into versioned expert caches and its
routers replaced by :class:`StepRouter`, sharing one :class:`RoutingContext` per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.errors import ModelConfigError
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts
from workers.moe.experts import CachedExperts
from workers.moe.recipes import LoadedModel
from workers.moe.router import RouterConfig, RoutingContext, StepRouter
from workers.moe.tokenizer import encode_prompt
from workers.moe.versioned import VersionedExperts

_CALIBRATION_PROMPT = "Explain quantum computing in simple terms. Tell me a story about a dragon."


@dataclass(slots=True)
class ModelSession:
    """One model on one worker: model, tokenizer, expert versions and the routing context."""

    loaded: LoadedModel
    experts: VersionedExperts
    context: RoutingContext
    moe_layers: list[int]
    device: torch.device

    @property
    def cache(self) -> ExpertCache:
        """The active expert version's cache."""
        return self.experts.active

    @property
    def name(self) -> str:
        return self.loaded.recipe.name

    def new_context(self, config: RouterConfig) -> RoutingContext:
        """Reset the shared routing context for a request routed with ``config``."""
        self.context.config = config
        self.context.expert_counts = torch.zeros(
            len(self.moe_layers), self.loaded.num_experts, dtype=torch.int64
        )
        self.context.score_sum, self.context.score_count, self.context.step_seed = 0.0, 0, 0
        return self.context

    def calibrate_and_warm_up(self) -> int:
        """Route one built-in prompt to seed the routing history, then warm up the cache."""
        ids = encode_prompt(self.loaded.tokenizer, _CALIBRATION_PROMPT)
        self.new_context(RouterConfig.native())
        with torch.inference_mode():
            input_ids = torch.tensor([ids], device=self.device)
            self.loaded.model(input_ids=input_ids, use_cache=False)
        self.cache.end_forward()
        return self.cache.warm_up()


def open_session(
    loaded: LoadedModel, cache_config: CacheConfig, device: str = "cpu"
) -> ModelSession:
    """Move ``loaded``'s experts into a cache and install cache-backed experts and routers."""
    layers = _moe_layers(loaded.model)
    host = _extract_host_experts(layers, pin=device.startswith("cuda"))
    experts = VersionedExperts(host, cache_config, device=device)
    context = RoutingContext(
        config=RouterConfig.native(),
        expert_counts=torch.zeros(len(layers), loaded.num_experts, dtype=torch.int64),
        layer_order={layer: row for row, layer in enumerate(sorted(layers))},
    )
    for layer, block in layers.items():
        _install(block, layer, loaded, experts, context)
    loaded.model.to(torch.device(device))  # type: ignore[arg-type]
    return ModelSession(loaded, experts, context, sorted(layers), torch.device(device))


def _moe_layers(model: nn.Module) -> dict[int, nn.Module]:
    decoder = model.get_submodule("model.layers")
    blocks = [layer.get_submodule("mlp") for layer in decoder.children()]
    return {
        i: block
        for i, block in enumerate(blocks)
        if hasattr(block, "experts") and hasattr(block, "gate")
    }


def _extract_host_experts(layers: dict[int, nn.Module], pin: bool) -> HostExperts:
    gate_up, down = {}, {}
    for layer, block in layers.items():
        experts = block.get_submodule("experts")
        gate_up[layer] = _tensor(experts, "gate_up_proj").detach().clone()
        down[layer] = _tensor(experts, "down_proj").detach().clone()
        if pin:
            gate_up[layer], down[layer] = gate_up[layer].pin_memory(), down[layer].pin_memory()
    return HostExperts(gate_up=gate_up, down=down)


def _install(
    block: nn.Module, layer: int, loaded: LoadedModel, experts: VersionedExperts,
    context: RoutingContext,
) -> None:
    act_fn = block.get_submodule("experts").act_fn
    weight = _tensor(block.get_submodule("gate"), "weight")
    if not callable(act_fn) or not isinstance(weight, nn.Parameter):
        raise ModelConfigError(f"layer {layer}: the MoE block is not a transformers 5 fused block")
    block.experts = CachedExperts(experts, layer, loaded.num_experts, act_fn)
    block.gate = StepRouter(weight, layer, loaded.native_top_k, loaded.normalises_top_k, context)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise ModelConfigError(f"{type(module).__name__} has no tensor {name!r}")
    return value
