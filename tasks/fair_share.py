"""The tenants' fair-share counters in Redis (``scheduler.fairness``): the measured seconds the
commit script adds per (band, tenant, tier) in ``sl:fair:service``, and the join rule's lifts,
active set and floors the tick writes to ``sl:fair:state``. Both outlive a scheduler restart."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

from scheduler.fairness import Joined, ServiceLedger
from tasks import keys

if TYPE_CHECKING:  # a type only
    import redis


def read_ledger(client: redis.Redis) -> ServiceLedger:
    """The counters as stored (an absent or foreign state: no lifts, nobody active)."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.FAIR_SERVICE)
    pipe.get(keys.FAIR_STATE)
    raw_service, raw_state = cast(tuple[dict[bytes, bytes], bytes | None], tuple(pipe.execute()))
    service: dict[tuple[str, str, str], float] = {}
    for name, value in raw_service.items():
        parts = name.decode().split("\t")
        if len(parts) == 3:
            band, tenant, tier = parts
            service[band, tenant, tier] = float(value)
    state: dict[str, Any] = {}
    if raw_state:
        try:
            state = json.loads(raw_state)
        except ValueError:
            state = {}
    try:
        lift = {(str(b), str(t)): float(v) for b, t, v in state.get("lift", [])}
        active = frozenset((str(b), str(t)) for b, t in state.get("active", []))
        floor = {str(b): float(v) for b, v in state.get("floor", {}).items()}
    except (TypeError, ValueError):
        lift, active, floor = {}, frozenset(), {}
    return ServiceLedger(service, lift, active, floor)


def save_joined(client: redis.Redis, joined: Joined) -> None:
    """The tick's join: lifts, active set and floors (the tick lease holder is their only
    writer; the measured seconds are the commits')."""
    client.set(keys.FAIR_STATE, json.dumps(joined.ledger.to_json()))
