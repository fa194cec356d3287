"""The live counters: unfinished jobs per (state, class) and per tenant, kept in Redis by the
same Lua scripts that change a job's state (``_events.lua``), so that ``/metrics``, ``/v1/stats``
and the tenants' queue quotas read them in O(states x classes) or O(1) instead of reading every
unfinished job's record (what made a submit and a scrape slow down as the backlog grew)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from tasks import keys, scripts

if TYPE_CHECKING:
    import redis


@dataclass(frozen=True, slots=True)
class LiveByState:
    """Unfinished jobs per (state, class), as the counters hold them."""

    counts: Mapping[tuple[str, str], int]

    @classmethod
    def parse(cls, raw: Mapping[bytes, bytes]) -> LiveByState:
        """From the counter hash as read (fields ``STATE|slo``)."""
        counts: dict[tuple[str, str], int] = {}
        for field, value in raw.items():
            state, _, slo = field.decode().partition("|")
            counts[(state, slo)] = int(value)
        return cls(counts)

    def of_class(self, slo: str) -> int:
        return sum(n for (_, s), n in self.counts.items() if s == slo)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class LiveCounts:
    """Reads (and, when a process starts, rebuilds) the live counters."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._rebuild = scripts.register(client, "count_live")

    def rebuild(self) -> int:
        """Set both counters to a full count of the live set's records, atomically (one script:
        O(unfinished jobs), once per API process, so a store written before the counters
        existed reads right); returns the unfinished jobs counted."""
        return int(self._rebuild(keys=[keys.ACTIVE, keys.LIVE_BY_STATE, keys.LIVE_BY_TENANT,
                                       keys.RAN],
                                 args=[keys.job("")]))

    def by_state(self) -> LiveByState:
        return LiveByState.parse(cast(dict[bytes, bytes],
                                      self.redis.hgetall(keys.LIVE_BY_STATE)))

    def of_tenant(self, tenant: str) -> int:
        """The tenant's unfinished jobs (its queue quota counts them)."""
        raw = self.redis.hget(keys.LIVE_BY_TENANT, tenant)
        return 0 if raw is None else int(cast(bytes, raw))

    def ran_since(self, since_s: float) -> list[str]:
        """Jobs that held a worker at some point since ``since_s`` (running now included), from
        the last hour."""
        raw = cast(list[bytes], self.redis.zrangebyscore(keys.RAN, since_s, "+inf"))
        return [m.decode() for m in raw]

    def running(self) -> list[str]:
        """Jobs RUNNING now."""
        return self.ran_since(float("inf"))

    def by_tenant(self) -> dict[str, int]:
        raw = cast(dict[bytes, bytes], self.redis.hgetall(keys.LIVE_BY_TENANT))
        return {k.decode(): int(v) for k, v in raw.items()}
