"""Checkpoint codec: tensors as safetensors, everything else as JSON metadata — never pickle.

A checkpoint is what a job needs to continue exactly on any worker: latents, scheduler state,
RNG state, KV cache. It crosses process boundaries through Redis, so it is plain bytes.

The bytes are the safetensors format exactly (``safetensors.torch.load`` reads them, and this
module reads what ``safetensors.torch.save`` writes), but written and parsed here: a job writes
one checkpoint per step, and the library's general path (shared-storage detection, a NumPy
round trip per tensor) cost a quarter to half a millisecond per step on small states — a tenth
of a small model's step. Here a checkpoint is one header and one join of the tensors' bytes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.errors import CheckpointError

_META_KEY = "stepline"
_HEADER_MAX = 100 * 1024 * 1024
"""Largest header accepted (the limit the safetensors library applies)."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_NAMES = {name: dtype for dtype, name in _DTYPES.items()}
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}


@dataclass(slots=True)
class Checkpoint:
    """The state of one job between two chunks.

    ``tensors`` hold every tensor (any dtype safetensors supports, any device: written from the
    CPU); ``meta`` holds JSON-serialisable values only (ints, floats, strings, lists, dicts,
    None).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    live: Any = field(default=None, compare=False, repr=False)
    """The runner's own in-memory state this checkpoint was written from, never serialised: a
    runner handed this object back (the worker's checkpoint cache, the job's next step on the
    same worker) may resume from it instead of rebuilding the state from the tensors, once —
    it takes it (sets None), so a second resume from the same checkpoint rebuilds."""

    def encode(self) -> bytes:
        """Serialise to safetensors bytes with the JSON metadata in the header."""
        try:
            meta_json = json.dumps(self.meta, sort_keys=True, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {exc}") from exc
        # Widest elements first, so every tensor starts at a multiple of its element size.
        order = sorted(self.tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        chunks: list[memoryview] = []
        for name, tensor in order:
            if tensor.dtype not in _DTYPES:
                raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
            flat = tensor.detach().to("cpu").reshape(-1)
            if flat.numel() and flat.stride(0) != 1:  # strided, or a broadcast element
                flat = flat.clone(memory_format=torch.contiguous_format)
            chunks.append(flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b""))
        layout = _layout(tuple((name, t.dtype, tuple(t.shape)) for name, t in order))
        text = ('{"__metadata__":{"' + _META_KEY + '":' + json.dumps(meta_json) + "}"
                + layout + "}").encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes
        return b"".join([len(text).to_bytes(8, "little"), text, *chunks])

    @classmethod
    def decode(cls, blob: bytes) -> Checkpoint:
        """Parse bytes written by :meth:`encode`; anything else raises :class:`CheckpointError`."""
        try:
            header_len = int.from_bytes(blob[:8], "little")
            if len(blob) < 8 or not 0 < header_len <= min(_HEADER_MAX, len(blob) - 8):
                raise ValueError(f"header length {header_len} does not fit {len(blob)} bytes")
            header = json.loads(blob[8 : 8 + header_len])
            meta = json.loads(header.pop("__metadata__")[_META_KEY])
            buffer = bytearray(blob[8 + header_len :])  # writable: tensors share it, no copies
            tensors = _tensors(header, buffer)
        except CheckpointError:
            raise
        except Exception as exc:  # malformed JSON, missing keys, bad types: not a checkpoint
            raise CheckpointError(f"not a Stepline checkpoint: {exc!r}") from exc
        if not isinstance(meta, dict):
            raise CheckpointError("not a Stepline checkpoint: its metadata is not an object")
        return cls(tensors=tensors, meta=meta)


_LAYOUTS: OrderedDict[tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], str] = OrderedDict()
_LAYOUTS_MAX = 256


def _layout(tensors: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> str:
    """The header's entries of ``tensors`` (name, dtype, shape, in file order), each led by a
    comma: a job writes the same layout every step, so it is built once (a small LRU)."""
    text = _LAYOUTS.get(tensors)
    if text is None:
        parts, offset = [], 0
        for name, dtype, shape in tensors:
            size = _ITEMSIZE[dtype]
            for dim in shape:
                size *= dim
            parts.append(f",{json.dumps(name)}:{{\"dtype\":\"{_DTYPES[dtype]}\",\"shape\":"
                         f"{json.dumps(list(shape))},\"data_offsets\":[{offset},{offset + size}]}}")
            offset += size
        text = _LAYOUTS[tensors] = "".join(parts)
        while len(_LAYOUTS) > _LAYOUTS_MAX:
            _LAYOUTS.popitem(last=False)
    _LAYOUTS.move_to_end(tensors)
    return text


def _tensors(header: dict[str, Any], buffer: bytearray) -> dict[str, torch.Tensor]:
    """The tensors a safetensors header describes over ``buffer``, which they must tile exactly
    (no gap, no overlap, nothing left over), as the format requires."""
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name)
                   for name, entry in header.items())
    position = 0
    tensors: dict[str, torch.Tensor] = {}
    for begin, end, name in spans:
        entry = header[name]
        dtype = _NAMES.get(entry["dtype"])
        shape = [int(size) for size in entry["shape"]]
        if dtype is None:
            raise CheckpointError(f"not a Stepline checkpoint: tensor {name!r} has dtype "
                                  f"{entry['dtype']!r}")
        numel = 1
        for size in shape:
            numel *= size
        itemsize = _ITEMSIZE[dtype]
        if begin != position or end - begin != numel * itemsize or min(shape, default=0) < 0:
            expected = f"{position}-{position + numel * itemsize}"
            raise CheckpointError(f"not a Stepline checkpoint: tensor {name!r} spans bytes "
                                  f"{begin}-{end}, expected {expected}")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif begin % itemsize == 0:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=numel,
                                             offset=begin).reshape(shape)
        else:  # a writer that did not align: copy the bytes out
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=begin)
            tensors[name] = raw.clone().view(dtype).reshape(shape)
        position = end
    if position != len(buffer):
        raise CheckpointError(f"not a Stepline checkpoint: {len(buffer) - position} bytes follow "
                              "the last tensor")
    return tensors
