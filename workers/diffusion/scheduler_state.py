"""Save and restore a diffusers scheduler's full runtime state without pickle.

The state is every instance attribute that differs from the job's baseline scheduler (built from
the same config, its timesteps set, never stepped): tensors go to the checkpoint's tensors,
scalars and lists to its JSON metadata. A class outside the exact ones of
:data:`~workers.diffusion.samplers.SCHEDULERS`, or a value of any other type, raises, so an
unsupported scheduler fails loudly instead of resuming wrongly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from workers.diffusion.samplers import SCHEDULERS, Exact, derived_attributes
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
        return tensors[value["t"]].to(device, copy=True)  # own storage, as state._own
    if "nd" in value:
        return tensors[value["nd"]].numpy()
    items = [_decode_item(v, tensors, device) for v in value["list"]]
    return tuple(items) if value["tuple"] else items


def copy_scheduler(baseline: Any) -> Any:
    """A scheduler equal to ``baseline`` that shares nothing a step may change: tensors, arrays
    and lists are copied; the frozen config, scalars and functions are shared. What building and
    setting it up again gives, in a fraction of the time."""
    twin = object.__new__(type(baseline))
    twin.__dict__.update({key: _own(value) for key, value in vars(baseline).items()})
    return twin


def _own(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, tuple)):
        return type(value)(_own(v) for v in value)
    return value


def save_scheduler_state(
    scheduler: Any, fresh: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON metadata of the attributes of ``scheduler`` that differ from ``fresh``,
    the job's baseline; attributes a fresh scheduler derives again keep their fresh value."""
    name = type(scheduler).__name__
    if not isinstance(SCHEDULERS.get(name), Exact):
        raise CheckpointError(f"scheduler {name} cannot be checkpointed exactly")
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    baseline = vars(fresh)
    skip = _SKIP | set(derived_attributes(name))
    for key, value in vars(scheduler).items():
        if key in skip or (key in baseline and _same(value, baseline[key])):
            continue
        meta[key] = _encode_item(_PREFIX + key, value, tensors)
    return tensors, meta


def restore_scheduler_state(
    fresh: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device
) -> Any:
    """Set the saved attributes on ``fresh``, a copy of the job's baseline; returns it."""
    for key, value in meta.items():
        setattr(fresh, key, _decode_item(value, tensors, device))
    return fresh
