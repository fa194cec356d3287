"""Step-level batching of text jobs: several prompts as one left-padded prefill, several jobs' KV
caches as one left-padded cache, with the attention mask and position ids that keep every row to
its own tokens and its own positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from workers.moe.generation import kv_pairs


@dataclass(frozen=True, slots=True)
class PaddedPrompts:
    """Prompts as one ``[rows, width]`` forward: each row's tokens end at the right edge, after
    pad tokens the mask hides, the router sends to no expert and no job counts."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    """``[rows, width]``: 1 on a row's own tokens, 0 on its padding."""
    positions: torch.Tensor
    """``[rows, width]``: each token's position in its own prompt (padding: 1, as generate())."""

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device,
           ) -> PaddedPrompts:
        width = max(len(ids) for ids in prompts)
        rows = [[pad_id] * (width - len(ids)) + list(ids) for ids in prompts]
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts],
                            dtype=torch.int64, device=device)
        positions = (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), mask, positions)

    @property
    def token_mask(self) -> torch.Tensor:
        """``[rows * width]`` bool, row-major as the MoE blocks flatten tokens: False on padding."""
        return self.mask.reshape(-1).bool()


class PaddedKV:
    """The members' caches as one ``[rows, heads, width, head_dim]`` cache per layer: each row's
    tokens end at the right edge, after zeros the mask hides; every step appends one column."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, config: PretrainedConfig) -> None:
        self.config = config
        self.cache = cache
        self.mask = mask
        """``[rows, width]``: 1 where a row's own tokens are, 0 on its padding."""
        self.lengths = [int(n) for n in mask.sum(dim=1).tolist()]
        """Per row, the tokens its cache holds (its next token's position)."""
        self.device = mask.device

    @classmethod
    def stack(cls, caches: Sequence[DynamicCache], config: PretrainedConfig) -> PaddedKV:
        """The members' own caches, each left-padded to the longest."""
        per_row = [kv_pairs(cache) for cache in caches]
        lengths = [int(pairs[0][0].shape[2]) for pairs in per_row]
        width = max(lengths)
        layers = []
        for layer in range(len(per_row[0])):
            keys = torch.cat([_left_pad(pairs[layer][0], width) for pairs in per_row])
            values = torch.cat([_left_pad(pairs[layer][1], width) for pairs in per_row])
            layers.append((keys, values))
        device = layers[0][0].device
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.int64,
                            device=device)
        return cls(DynamicCache(ddp_cache_data=layers, config=config), mask, config)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For a forward of one new token per row: the attention mask over the cache and the new
        column ``[rows, width + 1]``, and each row's position ids ``[rows, 1]``."""
        ones = torch.ones(self.rows, 1, dtype=self.mask.dtype, device=self.device)
        positions = torch.tensor(self.lengths, dtype=torch.int64, device=self.device)
        return torch.cat([self.mask, ones], dim=1), positions.unsqueeze(1)

    def advance(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Take the forward's cache (one more column) and the mask it ran with."""
        self.cache, self.mask = cache, mask
        self.lengths = [n + 1 for n in self.lengths]

    def row_cache(self, row: int) -> DynamicCache:
        """Row ``row``'s own cache: its tokens only, no padding, contiguous, in storage of its
        own (a view would keep the whole batch's cache alive with the job's checkpoint)."""
        start = int(self.mask.shape[1]) - self.lengths[row]
        own = torch.contiguous_format
        pairs = [(k[row : row + 1, :, start:].clone(memory_format=own),
                  v[row : row + 1, :, start:].clone(memory_format=own))
                 for k, v in kv_pairs(self.cache)]
        return DynamicCache(ddp_cache_data=pairs, config=self.config)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows``, in this order, and drop the padding columns none of them needs."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        self.lengths = [self.lengths[r] for r in rows]
        start = int(self.mask.shape[1]) - max(self.lengths, default=0)
        pairs = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                 for k, v in kv_pairs(self.cache)]
        self.cache = DynamicCache(ddp_cache_data=pairs, config=self.config)
        self.mask = self.mask.index_select(0, index)[:, start:]


def has_sliding_window(config: PretrainedConfig) -> bool:
    """Whether a model's cache crops old tokens: left padding would then misalign its rows."""
    return any(DynamicCache(config=config).is_sliding)


def has_linear_attention(config: PretrainedConfig) -> bool:
    """Whether a model has linear-attention layers (Qwen3-Next's gated DeltaNet): their conv and
    recurrent states run through every token a row holds, padding too, so rows do not pad."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin)
               for layer in DynamicCache(config=config).layers)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - int(tensor.shape[2])
    if pad == 0:
        return tensor
    zeros = tensor.new_zeros(tensor.shape[0], tensor.shape[1], pad, tensor.shape[3])
    return torch.cat([zeros, tensor], dim=2)
