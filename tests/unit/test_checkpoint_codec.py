"""The checkpoint codec writes and reads the safetensors format itself: what it writes, the
safetensors library reads back equal, and what the library writes, it reads; anything that is
not a checkpoint is refused with a CheckpointError, never half-read."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from workers.checkpoint import Checkpoint
from workers.errors import CheckpointError

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    out = {}
    for name in draw(st.lists(st.text("abcxyz._0123", min_size=1, max_size=8), max_size=6,
                              unique=True)):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        values = torch.randn(shape, generator=gen) * 50
        tensor = values > 0 if dtype is torch.bool else values.to(dtype)
        if draw(st.booleans()) and tensor.dim() >= 2:
            tensor = tensor.transpose(0, 1)  # not contiguous: written contiguous
        out[name] = tensor
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a)


@settings(max_examples=150, deadline=None)
@given(tensors(), st.dictionaries(st.text(max_size=5), st.integers() | st.none(), max_size=3))
def test_round_trip_and_the_library_agrees(ts: dict[str, torch.Tensor],
                                           meta: dict[str, object]) -> None:
    blob = Checkpoint(ts, {"m": meta}).encode()
    back = Checkpoint.decode(blob)
    assert same(back.tensors, ts) and back.meta == {"m": meta}
    assert same(dict(st_load(blob)), ts)  # the library reads what we write
    library = st_save({k: v.contiguous() for k, v in ts.items()},
                      metadata={"stepline": json.dumps({"m": meta})})
    theirs = Checkpoint.decode(library)  # and we read what it writes
    assert same(theirs.tensors, ts) and theirs.meta == {"m": meta}


def test_decoded_tensors_are_writable_and_independent() -> None:
    blob = Checkpoint({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.int64)}).encode()
    back = Checkpoint.decode(blob)
    back.tensors["a"] += 1
    assert torch.equal(back.tensors["b"], torch.ones(2, dtype=torch.int64))
    assert torch.equal(Checkpoint.decode(blob).tensors["a"], torch.zeros(3))


@pytest.mark.parametrize("mangle", [
    lambda b: b[:5],
    lambda b: b[:-1],
    lambda b: b + b"\0",
    lambda b: (10**9).to_bytes(8, "little") + b[8:],
    lambda b: b[:8] + b"[" + b[9:],
    lambda b: b.replace(b'"F32"', b'"Q32"'),
    lambda b: b.replace(b'"shape":[3]', b'"shape":[4]'),
    lambda b: b"",
])
def test_what_is_not_a_checkpoint_is_refused(mangle: object) -> None:
    blob = Checkpoint({"a": torch.arange(3, dtype=torch.float32)}, {"k": 1}).encode()
    with pytest.raises(CheckpointError):
        Checkpoint.decode(mangle(blob))  # type: ignore[operator]


def test_unsupported_metadata_is_refused_at_encode() -> None:
    with pytest.raises(CheckpointError, match="JSON"):
        Checkpoint({}, {"x": object()}).encode()


def test_broadcast_and_strided_tensors_are_written_as_their_values() -> None:
    ts = {"one": torch.tensor(5).expand(1), "row": torch.arange(3).expand(2, 3),
          "every_other": torch.arange(10.0)[::2]}
    back = Checkpoint.decode(Checkpoint(ts).encode()).tensors
    assert all(torch.equal(back[k], ts[k]) for k in ts)
