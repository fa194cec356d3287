"""What each worker holds warm, as placement reads its heartbeat's residency: the models on its
device and in host memory (and those it is loading or staging), the adapters on them, its
budget's room, and what a waiting job needs resident (:func:`model_need`); the tick's asks to
stage a model into a worker's host memory ahead of its queued jobs (:class:`StageRequest`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from scheduler.model import JobKind
from scheduler.placement import Holding, ModelNeed
from tasks import keys
from tasks.heartbeat import Heartbeat
from tasks.store import JobStore

RESIDENT_PREFIXES = {JobKind.IMAGE: "diffusion", JobKind.VIDEO: "diffusion",
                     JobKind.SIMULATED: "simulated"}
"""Per kind whose jobs run on a model, the first part of its models' residency keys
(``diffusion:<recipe>:<device>:<weights>``, with a suffix for a part held apart such as
``:transformer_2``; ``simulated:<model>``)."""


SHARED_PREFIXES = ("text_encoder",)
"""First parts of residency keys of modules held once for several models (a text encoder
shared by every recipe that names the same one, ``text_encoder:<identity>:<device>``): no model
of their own to place, their bytes spread over the models held beside them."""


def model_need(kind: JobKind | str, params: Mapping[str, Any]) -> ModelNeed | None:
    """What a job needs resident (its model and adapters, named ``<prefix>:<name>`` as
    :func:`resident_model` names the residency's keys); None for a job on no model."""
    prefix = RESIDENT_PREFIXES.get(JobKind(kind))
    model = params.get("model")
    if prefix is None or model is None:
        return None
    adapters = frozenset(f"{prefix}:{a['name']}" for a in params.get("adapters") or ()
                         if isinstance(a, Mapping) and "name" in a)
    size = params.get("model_bytes") if prefix == "simulated" else None
    return ModelNeed(f"{prefix}:{model}", adapters, int(size) if isinstance(size, int) else 0)


def resident_model(key: str) -> str | None:
    """The model a residency key holds, as :func:`model_need` names it (None: a kind placement
    does not route, e.g. a MoE model)."""
    parts = key.split(":")
    if len(parts) >= 2 and parts[0] in RESIDENT_PREFIXES.values():
        return f"{parts[0]}:{parts[1]}"
    return None


def holding(name: str, beat: Heartbeat, free_in_s: float) -> Holding:
    """A worker as placement sees it, from its heartbeat's residency: models on its device (and
    the one it is loading) and in host memory, adapters loaded on them, its device budget's
    free bytes (None: no budget; every item's bytes, a shared text encoder's once) and how many
    models it holds (the budget over the mean bytes of the models it holds, as
    :func:`model_sizes` counts them; 0 when either is unknown)."""
    r = beat.residency
    device_bytes = _tier(r, "device")
    loading = r.get("loading")
    arriving = str(loading.get("model", "")) if isinstance(loading, Mapping) else ""
    device = frozenset(m for k in (*device_bytes, *([arriving] if arriving else ()))
                       if (m := resident_model(k)) is not None)  # being loaded: there soon
    host = frozenset(m for k in (*_tier(r, "host"), *_staging(r))
                     if (m := resident_model(k)) is not None)  # being staged: host soon
    adapters: set[str] = set()
    held = r.get("adapters")
    for key, names in (held.items() if isinstance(held, Mapping) else ()):
        if resident_model(str(key)) is not None and isinstance(names, list):
            adapters |= {f"{str(key).split(':')[0]}:{n}" for n in names}
    sizes = model_sizes(device_bytes)
    budget = r.get("budget_bytes")
    capacity, free_bytes = 0, None
    if isinstance(budget, int):
        free_bytes = max(budget - sum(device_bytes.values()), 0)  # every model it holds
        if sizes and sum(sizes) > 0:
            capacity = max(1, int(budget // (sum(sizes) / len(sizes))))
    return Holding(name, free_in_s, device, host - device, frozenset(adapters), capacity,
                   free_bytes)


def model_sizes(tier_bytes: Mapping[str, int]) -> list[float]:
    """The bytes of each model one tier holds: its keys' together (a model's own item and its
    parts', e.g. Wan 2.2's second expert), plus an equal share of the shared parts' (text
    encoders held once for several models)."""
    per_model: dict[str, int] = {}
    shared = 0
    for key, size in tier_bytes.items():
        if (model := resident_model(key)) is not None:
            per_model[model] = per_model.get(model, 0) + int(size)
        elif key.split(":")[0] in SHARED_PREFIXES:
            shared += int(size)
    share = shared / len(per_model) if per_model else 0.0
    return [size + share for size in per_model.values()]


def _tier(residency: Mapping[str, Any], tier: str) -> dict[str, int]:
    held = residency.get(tier)
    return {str(k): int(v) for k, v in held.items()} if isinstance(held, Mapping) else {}


def _staging(residency: Mapping[str, Any]) -> list[str]:
    """The residency keys a worker is reading into host memory now (asked by the tick)."""
    keys_ = residency.get("staging")
    return [str(k) for k in keys_] if isinstance(keys_, list) else []


# staging into host memory ---------------------------------------------------------------------
class StageRequest(BaseModel):
    """The tick's ask to one worker: read the model a job of ``kind`` with ``params`` runs on
    into host memory ahead of its queued jobs (``keys.stage``; the worker's stager thread)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: JobKind
    params: dict[str, Any]


UNLIMITED_HOST_SLOTS = 1_000
"""Host slots of a worker whose host budget is unlimited."""


def host_slots(beat: Heartbeat, model_bytes: float) -> int:
    """How many more models of ``model_bytes`` a worker can stage into host memory: none when
    it runs no stager (its heartbeat's ``residency.stager``) or has no host tier."""
    r = beat.residency
    budget = r.get("host_budget_bytes", 0)
    if not r.get("stager") or budget == 0 or model_bytes <= 0:
        return 0
    if not isinstance(budget, int):
        return UNLIMITED_HOST_SLOTS
    staging = {resident_model(k) or k for k in _staging(r)}  # a model once, however keyed
    used = sum(_tier(r, "host").values()) + len(staging) * model_bytes
    return max(0, int((budget - used) // model_bytes))


def mean_model_bytes(beats: Iterable[Heartbeat], needs: Iterable[ModelNeed]) -> float:
    """The size a model to stage is taken to have: the mean of the models the workers hold
    (measured), else of the waiting jobs' declared sizes; 0 when neither is known."""
    held = [b for beat in beats for tier in ("device", "host")
            for b in model_sizes(_tier(beat.residency, tier))]
    if not held:
        held = [float(need.bytes) for need in needs if need.bytes > 0]
    return sum(held) / len(held) if held else 0.0


def held_models(beats: Iterable[Heartbeat]) -> set[str]:
    """The models some worker holds on its device or in host memory, or is staging there (as
    :func:`model_need` names them), by the heartbeats."""
    held: set[str] = set()
    for beat in beats:
        r = beat.residency
        held.update(m for k in (*_tier(r, "device"), *_tier(r, "host"), *_staging(r))
                    if (m := resident_model(k)) is not None)
    return held


def push_stage_requests(store: JobStore, asked: Sequence[tuple[str, str, StageRequest]],
                        ttl_s: float) -> None:
    """Hand each worker its staging requests (expiring: a worker that never pops them is gone)."""
    if not asked:
        return
    pipe = store.redis.pipeline(transaction=False)
    for worker, _, request in asked:
        key = keys.stage(worker)
        pipe.rpush(key, request.model_dump_json())
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
    pipe.execute()

