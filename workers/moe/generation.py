"""Token-level pieces of chunked generation: the sampler and the KV-cache codec.

Sampling draws from a CPU ``torch.Generator`` whose state travels in the checkpoint, so a
resumed job draws exactly the numbers it would have drawn uninterrupted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from workers.errors import CheckpointError

_KV_KEY = "kv.{layer}.{part}"


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """Next token from one row of logits: argmax when ``temperature == 0``, else nucleus
    sampling with ``top_p`` from the temperature-scaled distribution."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def new_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def generator_from_state(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.set_state(state.to(torch.uint8).cpu())
    return generator


def kv_pairs(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache's (keys, values) per layer, each ``[batch, heads, length, head_dim]``."""
    return [_pair(layer, cache_layer) for layer, cache_layer in enumerate(cache.layers)]


def _pair(layer: int, cache_layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = getattr(cache_layer, "keys", None), getattr(cache_layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise CheckpointError(f"KV cache layer {layer} holds no key/value tensors to save")
    return keys, values


def kv_to_tensors(cache: DynamicCache) -> dict[str, torch.Tensor]:
    """The cache's per-layer key/value tensors, named for a checkpoint. A sliding-window layer
    keeps only its last ``window - 1`` tokens, so it also saves how many it has seen
    (``kv.<i>.seen``): the positions and the window's mask follow that count, not the kept one.
    A linear-attention layer (Qwen3-Next's gated DeltaNet) has no keys: it saves its conv and
    recurrent states and its token count instead (:func:`_linear_to_tensors`)."""
    tensors = {}
    for layer, cache_layer in enumerate(cache.layers):
        if isinstance(cache_layer, LinearAttentionCacheLayerMixin):
            tensors.update(_linear_to_tensors(layer, cache_layer))
            continue
        keys, values = _pair(layer, cache_layer)
        tensors[_KV_KEY.format(layer=layer, part="key")] = keys
        tensors[_KV_KEY.format(layer=layer, part="value")] = values
        seen = getattr(cache.layers[layer], "cumulative_length", None)
        if isinstance(seen, int):
            tensors[_KV_KEY.format(layer=layer, part="seen")] = torch.tensor(seen)
    return tensors


def kv_from_tensors(
    tensors: dict[str, torch.Tensor], config: PretrainedConfig, device: torch.device
) -> DynamicCache:
    """Rebuild a :class:`DynamicCache` from :func:`kv_to_tensors` output on ``device``."""
    layers = 1 + max((int(name.split(".")[1]) for name in tensors if name.startswith("kv.")),
                     default=-1)
    pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for layer in range(layers):
        key = tensors.get(_KV_KEY.format(layer=layer, part="key"))
        value = tensors.get(_KV_KEY.format(layer=layer, part="value"))
        pairs.append((None, None) if key is None or value is None
                     else (key.to(device), value.to(device)))
    cache = DynamicCache(ddp_cache_data=pairs, config=config)
    for index, cache_layer in enumerate(cache.layers):
        if isinstance(cache_layer, LinearAttentionCacheLayerMixin):
            _linear_from_tensors(index, cache_layer, tensors, device)
            continue
        seen = tensors.get(_KV_KEY.format(layer=index, part="seen"))
        if seen is not None:
            if not hasattr(cache_layer, "cumulative_length"):
                raise CheckpointError(f"KV layer {index} was saved sliding; the model's is not")
            setattr(cache_layer, "cumulative_length", int(seen))  # noqa: B010
    return cache


def _linear_to_tensors(layer: int, cache_layer: LinearAttentionCacheLayerMixin,
                       ) -> dict[str, torch.Tensor]:
    """A linear-attention layer's state: per state index its conv window
    (``kv.<i>.conv.<s>``, the last ``conv_kernel_size`` inputs) and recurrent state
    (``kv.<i>.recurrent.<s>``), and the tokens it has seen (``kv.<i>.seen``)."""
    tensors = {}
    for state in range(cache_layer.number_of_states):
        conv, recurrent = cache_layer.conv_states[state], cache_layer.recurrent_states[state]
        if conv is not None:
            tensors[_KV_KEY.format(layer=layer, part=f"conv.{state}")] = conv
        if recurrent is not None:
            tensors[_KV_KEY.format(layer=layer, part=f"recurrent.{state}")] = recurrent
    tensors[_KV_KEY.format(layer=layer, part="seen")] = (
        cache_layer.cumulative_length_linear.clone())
    return tensors


def _linear_from_tensors(layer: int, cache_layer: LinearAttentionCacheLayerMixin,
                         tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore :func:`_linear_to_tensors` output into a fresh linear-attention layer, as its
    own prefill left it: states initialised at their saved shapes, past the prefill."""
    for state in range(cache_layer.number_of_states):
        conv = tensors.get(_KV_KEY.format(layer=layer, part=f"conv.{state}"))
        if conv is not None:
            cache_layer.lazy_initialization(conv_states=conv.to(device), state_idx=state)
            held = cache_layer.conv_states[state]
            assert held is not None  # lazy_initialization allocated it
            held.copy_(conv)
            cache_layer.has_previous_state[state] = True
        recurrent = tensors.get(_KV_KEY.format(layer=layer, part=f"recurrent.{state}"))
        if recurrent is not None:
            cache_layer.lazy_initialization(recurrent_states=recurrent.to(device), state_idx=state)
            held = cache_layer.recurrent_states[state]
            assert held is not None
            held.copy_(recurrent)
    seen = tensors.get(_KV_KEY.format(layer=layer, part="seen"))
    if seen is not None:
        cache_layer.cumulative_length_linear = seen.to(device=device, dtype=torch.int64).clone()
