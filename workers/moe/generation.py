"""Token-level pieces of chunked generation: the sampler and the KV-cache codec.

Sampling draws from a CPU ``torch.Generator`` whose state travels in the checkpoint, so a
resumed job draws exactly the numbers it would have drawn uninterrupted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

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
    pairs = []
    for layer, cache_layer in enumerate(cache.layers):
        keys, values = getattr(cache_layer, "keys", None), getattr(cache_layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise CheckpointError(f"KV cache layer {layer} holds no key/value tensors to save")
        pairs.append((keys, values))
    return pairs


def kv_to_tensors(cache: DynamicCache) -> dict[str, torch.Tensor]:
    """The cache's per-layer key/value tensors, named for a checkpoint. A sliding-window layer
    keeps only its last ``window - 1`` tokens, so it also saves how many it has seen
    (``kv.<i>.seen``): the positions and the window's mask follow that count, not the kept one."""
    tensors = {}
    for layer, (keys, values) in enumerate(kv_pairs(cache)):
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
    pairs = []
    layer = 0
    while (key := _KV_KEY.format(layer=layer, part="key")) in tensors:
        value = tensors[_KV_KEY.format(layer=layer, part="value")]
        pairs.append((tensors[key].to(device), value.to(device)))
        layer += 1
    cache = DynamicCache(ddp_cache_data=pairs, config=config)
    for index, cache_layer in enumerate(cache.layers):
        seen = tensors.get(_KV_KEY.format(layer=index, part="seen"))
        if seen is not None:
            if not hasattr(cache_layer, "cumulative_length"):
                raise CheckpointError(f"KV layer {index} was saved sliding; the model's is not")
            cache_layer.cumulative_length = int(seen)
    return cache
