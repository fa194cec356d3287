"""Save and restore a diffusers scheduler's full runtime state without pickle.

The state is every instance attribute that differs from a freshly built scheduler of the same
config: tensors go to the checkpoint's tensors, scalars and lists to its JSON metadata. A value of
any other type raises, so an unsupported scheduler fails loudly instead of resuming wrongly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from workers.errors import CheckpointError

_PREFIX = "sched."
_SCALARS = (bool, int, float, str, type(None))
_SKIP = frozenset({"_internal_dict", "config"})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and isinstance(a, _SCALARS) and a == b


def _encode_item(name: str, value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().clone()
        return {"t": name}
    if isinstance(value, np.ndarray):
        tensors[name] = torch.from_numpy(value.copy())
        return {"nd": name}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode_item(f"{name}.{i}", v, tensors) for i, v in enumerate(value)]
        return {"list": items, "tuple": isinstance(value, tuple)}
    raise CheckpointError(
        f"scheduler attribute {name!r} has unsupported type {type(value).__name__}")


def _decode_item(value: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    if not isinstance(value, dict):
        return value
    if "t" in value:
        return tensors[value["t"]].to(device)
    if "nd" in value:
        return tensors[value["nd"]].numpy()
    items = [_decode_item(v, tensors, device) for v in value["list"]]
    return tuple(items) if value["tuple"] else items


def save_scheduler_state(
    scheduler: Any, fresh: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON metadata of the attributes of ``scheduler`` that differ from ``fresh``."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    baseline = vars(fresh)
    for key, value in vars(scheduler).items():
        if key in _SKIP or (key in baseline and _same(value, baseline[key])):
            continue
        meta[key] = _encode_item(_PREFIX + key, value, tensors)
    return tensors, meta


def restore_scheduler_state(
    fresh: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device
) -> Any:
    """Set the saved attributes on a freshly built scheduler of the same config; returns it."""
    for key, value in meta.items():
        setattr(fresh, key, _decode_item(value, tensors, device))
    return fresh


def scheduler_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The scheduler's entries among a checkpoint's tensors."""
    return {k: v for k, v in tensors.items() if k.startswith(_PREFIX)}
