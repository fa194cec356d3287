"""A loaded MoE model wired for serving: its experts moved into versioned expert caches and its
routers replaced by :class:`StepRouter`, sharing one :class:`RoutingContext` per request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from workers.errors import ModelConfigError
from workers.moe.deepseek import GroupLimitedRouter, is_group_limited, shared_expert_bytes
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts
from workers.moe.experts import CachedExperts, GptOssCachedExperts
from workers.moe.prefetch import Lookahead, LookaheadPredictor
from workers.moe.recipes import LoadedModel
from workers.moe.router import RouterConfig, RoutingContext, StepRouter
from workers.moe.tokenizer import encode_prompt
from workers.moe.versioned import VersionedExperts
from workers.residency import Resident, module_tensors

_CALIBRATION_PROMPT = "Explain quantum computing in simple terms. Tell me a story about a dragon."


@dataclass(slots=True)
class ModelSession:
    """One model on one worker: model, tokenizer, expert versions and the routing context."""

    loaded: LoadedModel
    experts: VersionedExperts
    context: RoutingContext
    moe_layers: list[int]
    device: torch.device
    predictor: LookaheadPredictor | None = None
    """The next router applied early; None when prefetch is off."""
    listeners: list[Callable[[int, list[int], Lookahead | None], None]] = field(
        default_factory=list)
    """Also told of every routing (layer, experts, lookahead made there): trace recorders."""

    def on_routed(self, layer: int, hidden: torch.Tensor, top_index: torch.Tensor) -> None:
        """The router hook: hand the routing and the next layer's lookahead to the cache."""
        num_experts = self.loaded.num_experts
        experts = sorted({int(e) for e in top_index.reshape(-1).tolist() if 0 <= e < num_experts})
        lookahead = None
        if self.predictor is not None and (self.listeners or self.cache.wants_lookahead(layer)):
            lookahead = self.predictor.predict(layer, hidden)
        self.cache.observe_routing(layer, experts, lookahead)
        for listener in self.listeners:
            listener(layer, experts, lookahead)

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
        self.cache.begin_request()
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


def session_tensors(session: ModelSession) -> Iterator[torch.Tensor]:
    """Every tensor ``session`` holds: the model's parameters and buffers (its experts moved
    out), and each expert version's host weights and device-cache copies."""
    yield from module_tensors([session.loaded.model])
    yield from session.experts.tensors()


def moe_resident(device: str) -> Resident:
    """MoE sessions in the model residency: measured with their expert caches (so those count
    inside the same budget). On the CPU the host tier keeps a session as it is; on a GPU an
    evicted session is dropped (its expert caches' device slots are not moved to the host)."""
    if device.startswith("cuda"):
        return Resident(tensors=session_tensors, release=_close, grows=True)
    return Resident(tensors=session_tensors, to_host=_stay, to_device=_stay, release=_close,
                    grows=True)


def _stay(session: ModelSession) -> None:
    """Host and device are one memory on the CPU: nothing moves."""


def _close(session: ModelSession) -> None:
    session.experts.close()


def open_session(
    loaded: LoadedModel, cache_config: CacheConfig, device: str = "cpu", lookahead: bool = False
) -> ModelSession:
    """Move ``loaded``'s experts into a cache and install cache-backed experts and routers.
    The lookahead predictor runs whenever prefetch is on (or ``lookahead`` asks for it, as the
    trace recorder does)."""
    layers = _moe_layers(loaded.model)
    host = _extract_host_experts(layers, pin=device.startswith("cuda"))
    experts = VersionedExperts(host, cache_config, device=device, min_slots=loaded.native_top_k)
    context = RoutingContext(
        config=RouterConfig.native(),
        expert_counts=torch.zeros(len(layers), loaded.num_experts, dtype=torch.int64),
        layer_order={layer: row for row, layer in enumerate(sorted(layers))},
    )
    gates = {}
    for layer, block in layers.items():
        gates[layer] = _install(block, layer, loaded, experts, context)
    loaded.model.to(torch.device(device))  # type: ignore[arg-type]
    predictor = None
    if cache_config.prefetch_experts > 0 or lookahead:
        predictor = LookaheadPredictor(gates, rank=2 * loaded.native_top_k)
    session = ModelSession(loaded, experts, context, sorted(layers), torch.device(device),
                           predictor)
    context.observer = session.on_routed
    return session


def _moe_layers(model: nn.Module) -> dict[int, nn.Module]:
    decoder = model.get_submodule("model.layers")
    blocks = [layer.get_submodule("mlp") for layer in decoder.children()]
    return {
        i: block
        for i, block in enumerate(blocks)
        if hasattr(block, "experts") and (hasattr(block, "gate") or hasattr(block, "router"))
    }


def _extract_host_experts(layers: dict[int, nn.Module], pin: bool) -> HostExperts:
    parts: dict[str, dict[int, torch.Tensor]] = {name: {} for name in _EXPERT_TENSORS}
    for layer, block in layers.items():
        experts = block.get_submodule("experts")
        for name, held in parts.items():
            if name.endswith("_bias") and getattr(experts, name, None) is None:
                continue  # only gpt-oss's experts carry biases
            held[layer] = _tensor(experts, name).detach().clone()
            if pin:
                held[layer] = held[layer].pin_memory()
    return HostExperts(gate_up=parts["gate_up_proj"], down=parts["down_proj"],
                       gate_up_bias=parts["gate_up_proj_bias"], down_bias=parts["down_proj_bias"],
                       shared_bytes=sum(shared_expert_bytes(block) for block in layers.values()))


_EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _install(
    block: nn.Module, layer: int, loaded: LoadedModel, experts: VersionedExperts,
    context: RoutingContext,
) -> nn.Parameter:
    """Swap in the cache-backed experts and the step router; returns the router's weight."""
    native = block.get_submodule("experts")
    if hasattr(block, "router"):  # gpt-oss: biased router, softmax over the top-k logits
        weight = _tensor(block.get_submodule("router"), "weight")
        bias = _tensor(block.get_submodule("router"), "bias")
        if not isinstance(weight, nn.Parameter) or not isinstance(bias, nn.Parameter):
            raise ModelConfigError(f"layer {layer}: the gpt-oss router has no weight and bias")
        block.experts = GptOssCachedExperts(experts, layer, loaded.num_experts,
                                            float(getattr(native, "alpha")),  # noqa: B009
                                            float(getattr(native, "limit")))  # noqa: B009
        block.router = StepRouter(weight, layer, loaded.native_top_k, True, context, bias=bias,
                                  softmax_top=True)
        return weight
    act_fn = native.act_fn
    weight = _tensor(block.get_submodule("gate"), "weight")
    if not callable(act_fn) or not isinstance(weight, nn.Parameter):
        raise ModelConfigError(f"layer {layer}: the MoE block is not a transformers 5 fused block")
    block.experts = CachedExperts(experts, layer, loaded.num_experts, act_fn)
    if is_group_limited(block):  # DeepSeek-V3: sigmoid scores, group-limited, scaled weights
        block.gate = GroupLimitedRouter(block.get_submodule("gate"), layer,
                                        loaded.normalises_top_k, context)
    else:
        block.gate = StepRouter(weight, layer, loaded.native_top_k, loaded.normalises_top_k,
                                context)
    return weight


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise ModelConfigError(f"{type(module).__name__} has no tensor {name!r}")
    return value
