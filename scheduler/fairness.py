"""Tenant fair share within a priority band: a virtual counter per tenant in worker-seconds.

The Virtual Token Counter of Sheng et al. ("Fairness in Serving Large Language Models", OSDI
'24), counted in worker-seconds instead of tokens. A band is an SLO class (realtime,
interactive, batch): each tenant active in a band has a counter there, its measured service in
that band over its tier's weight, plus the lift the join rule gave it. Within a band the tick
serves the least counter first:

- **Charged at placement, corrected at completion.** A job in flight (queued or running) is
  charged its next chunk's estimate (the cost model's) on top of its tenant's counter; when the
  chunk commits, the estimate gives way to the chunk's measured seconds, which the commit adds
  to the stored counter (``tasks/lua/commit.lua``; the simulator's chunk end). A tenant's jobs
  queue behind one another: the k-th of them starts at the counter plus the estimates of the
  k − 1 before it, so one tick filling many slots interleaves the tenants as the counters would
  one pick at a time.
- **No banked credit.** A tenant that becomes active in a band (it had no live job there at
  the last tick) joins at the least standing among the tenants active there before and still
  (:func:`join`): a standing is the counter plus the charges of the tenant's chunks running,
  so a joiner does not go ahead of work already started. Queued chunks do not count: a job is
  queued as it is submitted, so a tenant's whole backlog would lift one who joins a
  millisecond later (by it, less the joiner's own over its weight: a gold joiner kept a
  deficit for good). When none stayed, it joins at the
  least standing the band had when it was last busy. A tenant idle for an hour comes back
  level with the others, not an hour ahead.
- **Deadlines still win.** A job whose slack (``scheduler.placement.slack_s``, the one slack
  function) no longer covers its next chunk goes before the fair order of its band; work past
  saving (negative slack, demoted or deferred) goes after it.
- **Warm first on ties.** Of two jobs at the same counter, the one whose model a worker holds
  (no load expected) goes first: placement then sends it where the model is.

Pure (stdlib only) and shared by the live tick and the simulator. The planner reads the
counters from the snapshot (``ClusterSnapshot.service``); the caller keeps them between ticks
(the join rule's lifts and the active set are its to persist: ``tasks.fair_share``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

TenantKey = tuple[str, str]
"""(band, tenant): a band is an SLO class's name."""

ServiceKey = tuple[str, str, str]
"""(band, tenant, tier): measured worker-seconds are kept by tier, so the weights apply when
the counter is read and may change at run time."""

URGENT, ON_TIME, PAST_SAVING = 0, 1, 2
"""Within a band, best first: a job whose slack no longer covers its next chunk, work that can
still make its deadline (the fair order), work past saving."""

FairKey = tuple[float, float, float, float]
"""(band rank, urgency, start tag, warm 0 / cold 1): smaller first."""


def _default_weights() -> Mapping[str, float]:
    return MappingProxyType({"gold": 2.0, "standard": 1.0})


@dataclass(frozen=True, slots=True)
class FairShareConfig:
    """Whether the tick orders each band by tenant fair share, and each tier's weight."""

    enabled: bool = False
    """Off: within the on-time band jobs go by value-weighted remaining work alone (a tenant
    that submits ten times more takes ten times the workers)."""
    weights: Mapping[str, float] = field(default_factory=_default_weights)
    """Share of each tier, relative: a gold tenant backlogged beside a standard one gets twice
    its worker-seconds. A tier not named weighs 1."""

    def __post_init__(self) -> None:
        for tier, weight in self.weights.items():
            if not (math.isfinite(weight) and weight > 0.0):
                raise ValueError(f"fair-share weight of tier {tier!r} must be > 0, got {weight}")

    def weight(self, tier: str) -> float:
        return self.weights.get(tier, 1.0)


@dataclass(frozen=True, slots=True)
class ServiceLedger:
    """The counters between ticks: measured worker-seconds per (band, tenant, tier), the lift
    the join rule gave each (band, tenant), who was active at the last tick, and each band's
    least counter then."""

    service_s: Mapping[ServiceKey, float] = field(default_factory=dict)
    lift: Mapping[TenantKey, float] = field(default_factory=dict)
    """Virtual seconds added when the tenant (re)joined a busy band."""
    active: frozenset[TenantKey] = frozenset()
    floor: Mapping[str, float] = field(default_factory=dict)
    """Per band: the least standing (counter plus in-flight charges, :func:`join`) among its
    active tenants at the last tick (where a tenant joins a band whose every tenant was new)."""

    def virtual(self, config: FairShareConfig) -> dict[TenantKey, float]:
        """Every (band, tenant)'s counter: lift + Σ measured seconds ÷ the tier's weight."""
        out: dict[TenantKey, float] = dict(self.lift)
        for (band, tenant, tier), seconds in sorted(self.service_s.items()):
            key = (band, tenant)
            out[key] = out.get(key, 0.0) + seconds / config.weight(tier)
        return out

    def worker_s(self) -> dict[TenantKey, float]:
        """Measured worker-seconds per (band, tenant), whatever the tier."""
        out: dict[TenantKey, float] = {}
        for (band, tenant, _), seconds in sorted(self.service_s.items()):
            out[band, tenant] = out.get((band, tenant), 0.0) + seconds
        return out

    def charged(self, band: str, tenant: str, tier: str, seconds: float) -> ServiceLedger:
        """The ledger with ``seconds`` of measured service added (what a commit does)."""
        key = (band, tenant, tier)
        service = dict(self.service_s)
        service[key] = service.get(key, 0.0) + seconds
        return replace(self, service_s=service)

    def to_json(self) -> dict[str, Any]:
        """A plain dict (the lifts, the active set and the floors; the measured seconds are
        kept apart, where the commits add to them)."""
        return {"lift": [[b, t, v] for (b, t), v in sorted(self.lift.items())],
                "active": sorted([b, t] for b, t in self.active),
                "floor": dict(sorted(self.floor.items()))}


@dataclass(frozen=True, slots=True)
class Joined:
    """:func:`join`'s outcome: the ledger to order by and persist, and the lifts it made."""

    ledger: ServiceLedger
    lifts: Mapping[TenantKey, float]
    """(band, tenant) → the lift added this tick (> 0)."""


def join(ledger: ServiceLedger, active: Iterable[TenantKey], config: FairShareConfig,
         in_flight: Mapping[TenantKey, float] | None = None,
         virtual: Mapping[TenantKey, float] | None = None) -> Joined:
    """The join rule: each (band, tenant) in ``active`` that was not active at the last tick is
    lifted to the least standing of the band's tenants active then and now (none: the band's
    floor), if below it. The active set and the floors become this tick's.

    A tenant's standing is its counter plus ``in_flight[band, tenant]``: the charges of its
    chunks in flight (each its estimate over the tier's weight, as :func:`fair_keys` charges
    them), placed but not committed, so not in the counter yet. The least counter alone would
    let a joiner's first start tag sit below every in-flight-charged tag of those who stayed:
    it would go ahead of them by up to their whole in-flight work (credit banked out of the
    others' placements), however many workers that takes. ``virtual``: the ledger's
    :meth:`ServiceLedger.virtual`, where the caller kept it from the last tick."""
    now = frozenset(active)
    if virtual is None:
        virtual = ledger.virtual(config)
    charged = in_flight or {}
    by_band: dict[str, list[str]] = {}
    for band, tenant in sorted(now):
        by_band.setdefault(band, []).append(tenant)
    lift = dict(ledger.lift)
    lifts: dict[TenantKey, float] = {}
    floor = dict(ledger.floor)
    for band, tenants in by_band.items():
        standing = {t: virtual.get((band, t), 0.0) + charged.get((band, t), 0.0)
                    for t in tenants}
        staying = [standing[t] for t in tenants if (band, t) in ledger.active]
        reference = min(staying) if staying else floor.get(band)
        for tenant in tenants:
            key = (band, tenant)
            own = standing[tenant]
            if key not in ledger.active and reference is not None and own < reference:
                lifts[key] = reference - own
                lift[key] = lift.get(key, 0.0) + lifts[key]
                standing[tenant] = reference
        floor[band] = min(standing.values())
    return Joined(ServiceLedger(ledger.service_s, lift, now, floor), lifts)


@dataclass(frozen=True, slots=True)
class FairJob:
    """What the fair order reads of one live job."""

    band: int
    """Its class's rank (0: realtime)."""
    tenant: str
    weight: float
    urgency: int
    """:data:`URGENT`, :data:`ON_TIME` or :data:`PAST_SAVING`."""
    in_flight: bool
    """Queued or running: its next chunk is placed, so its estimate is charged already."""
    chunk_s: float
    """Its next chunk's estimated worker-seconds."""
    warm: bool
    """A worker holds its model (no load expected before its next chunk)."""


def in_flight_charges(jobs: Sequence[FairJob], band_names: Sequence[str]
                      ) -> dict[TenantKey, float]:
    """(band, tenant) → the charges of its jobs in flight (each its chunk estimate over its
    weight), summed in the jobs' order: what :func:`join` adds to a counter for a standing."""
    out: dict[TenantKey, float] = {}
    for job in jobs:
        if job.in_flight:
            key = (band_names[job.band], job.tenant)
            out[key] = out.get(key, 0.0) + job.chunk_s / job.weight
    return out


def urgency(slack_s: float, chunk_s: float, past_saving: bool) -> int:
    """:data:`URGENT` when the slack no longer covers the next chunk (but is not negative),
    :data:`PAST_SAVING` for work that cannot make its deadline or is demoted or deferred."""
    if past_saving or slack_s < 0.0:
        return PAST_SAVING
    return URGENT if slack_s < chunk_s else ON_TIME


def fair_keys(jobs: Sequence[FairJob], within: Sequence[tuple[float, float]],
              counters: Mapping[TenantKey, float], band_names: Sequence[str]
              ) -> list[FairKey]:
    """Each job's :data:`FairKey`. ``within``: the job's own key in the band's previous order
    (value-weighted remaining work), which orders a tenant's jobs among themselves after their
    urgency and whether they are in flight; ``counters``: :meth:`ServiceLedger.virtual` (a
    tenant absent counts 0); ``band_names[band]``: the band's name in the counters.

    A tenant's jobs in that order start at its counter plus the charges of those before it
    (each its chunk estimate over its weight), summed from zero in order and added to the
    counter last. O(n log n): one sort."""
    walk = sorted(range(len(jobs)), key=lambda i: (
        jobs[i].band, jobs[i].tenant, jobs[i].urgency, not jobs[i].in_flight, within[i], i))
    keys: list[FairKey] = [(0.0, 0.0, 0.0, 0.0)] * len(jobs)
    group: tuple[int, str] | None = None
    base, charged = 0.0, 0.0
    for i in walk:
        job = jobs[i]
        if (job.band, job.tenant) != group:
            group = (job.band, job.tenant)
            base, charged = counters.get((band_names[job.band], job.tenant), 0.0), 0.0
        keys[i] = (float(job.band), float(job.urgency), base + charged,
                   0.0 if job.warm else 1.0)
        charged += job.chunk_s / job.weight
    return keys


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values`` (1: all equal; 1/n: one takes everything)."""
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0.0 else total * total / (len(values) * squares)
