"""Checkpoint codec: tensors as safetensors, everything else as JSON metadata — never pickle.

A checkpoint is what a job needs to continue exactly on any worker: latents, scheduler state,
RNG state, KV cache. It crosses process boundaries through Redis, so it is plain bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from workers.errors import CheckpointError

_META_KEY = "stepline"


@dataclass(slots=True)
class Checkpoint:
    """The state of one job between two chunks.

    ``tensors`` hold every tensor (contiguous, any dtype safetensors supports); ``meta`` holds
    JSON-serialisable values only (ints, floats, strings, lists, dicts, None).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        """Serialise to safetensors bytes with the JSON metadata in the header."""
        try:
            meta_json = json.dumps(self.meta, sort_keys=True, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {exc}") from exc
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.tensors.items()}
        return st_save(tensors, metadata={_META_KEY: meta_json})

    @classmethod
    def decode(cls, blob: bytes) -> Checkpoint:
        """Parse bytes written by :meth:`encode`; anything else raises :class:`CheckpointError`."""
        try:
            tensors = st_load(blob)
            header_len = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8 : 8 + header_len])
            meta = json.loads(header["__metadata__"][_META_KEY])
        except Exception as exc:  # safetensors raises several types; all mean "not a checkpoint"
            raise CheckpointError(f"not a Stepline checkpoint: {exc}") from exc
        return cls(tensors=dict(tensors), meta=meta)

    def nbytes(self) -> int:
        """Size of the tensors in bytes (the metadata is negligible beside them)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
