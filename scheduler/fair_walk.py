"""The fair order over the incremental planner's columns, and its repair between ticks.

``scheduler.ordering.fair_order`` ranks jobs by a fair key per job — (band, urgency, start
tag, warm) — whose start tags are each (band, tenant)'s counter plus the charges before the
job along a walk of its tenant's jobs. Here the keys are arrays over :class:`Columns` rows,
in the same floating-point operations in the same order: the walk is the last tick's again
where it still holds (the rows it no longer orders sorted apart and merged in), and the start
tags are summed again only for the (band, tenant)s whose part of the walk changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from scheduler.columns import (
    QUEUED,
    RUNNING,
    SUSPENDED,
    Bools,
    Columns,
    Floats,
    Ints,
    Tick,
    same_bits,
)
from scheduler.fairness import (
    ON_TIME,
    PAST_SAVING,
    URGENT,
    FairKey,
    FairShareConfig,
    ServiceLedger,
    TenantKey,
    join,
)
from scheduler.ordering import BAND_NAMES, Ranking

FairArrays = tuple[Floats, ...]
"""The fair key of every job as four arrays: band, urgency, start tag, warm 0 / cold 1."""


def fair_ranking(c: Columns, ranking: Ranking, tick: Tick, config: FairShareConfig,
                 service: ServiceLedger | None, now_s: float) -> tuple[Ranking, FairArrays]:
    """``ordering.fair_order`` without inheritance, over the columns: the chunk estimates,
    urgencies and charges as arrays; the join (``fairness.join`` itself) on the tenants of
    the contending rows and the running rows' charges; each (band, tenant)'s counter
    looked up once; the start tags a sequential cumulative sum per tenant, in the order
    ``fairness.fair_keys`` walks (band, tenant, urgency, in flight first, key, index).
    Also the fair key of every job as four arrays (band, urgency, start tag, warm 0 / cold
    1), for :func:`fair_best`."""
    rows = tick.rows
    remaining, units, after = tick.remaining, c.f["units"][rows], c.f["next_units"][rows]
    chunk = np.where((after > 0.0) & (units > 0.0), remaining * after / units,
                     remaining / np.maximum(c.i["left"][rows], 1))
    slack = tick.deadline - now_s - remaining
    past = slack < 0.0
    if ranking.behind:
        past[list(ranking.behind)] = True
    urgency = np.where(past, PAST_SAVING, np.where(slack < chunk, URGENT, ON_TIME))
    in_flight = (tick.state == QUEUED) | (tick.state == RUNNING)
    charge = chunk / c.f["fair_weight"][rows]
    band, tenant = c.i["cls_rank"][rows], c.i["tenant"][rows]
    ledger = service or ServiceLedger()
    virtual = _virtual(c, ledger, config)
    joined = join(ledger, _contending(c, tick, band, tenant), config,
                  _in_flight(c, band, tenant, charge, tick.state == RUNNING), virtual)
    # one small integer for (band, tenant, urgency, in flight first): the sort is stable,
    # so the index needs no key of its own
    within = ((band * len(c.tenant_names) + tenant) * 3 + urgency) * 2 + ~in_flight
    walk = _walk(c, within, tick.k1, tick.k2, rows)
    # no lift: the joined ledger's counters are the ledger's
    counters = virtual if not joined.lifts else joined.ledger.virtual(config)
    start = _start_tags(c, walk, band * len(c.tenant_names) + tenant, charge, counters,
                             rows)
    fair = (band.astype(np.float64), urgency.astype(np.float64), start,
            np.where(c.f["load"][rows] <= 0.0, 0.0, 1.0))
    return replace(ranking, fair=_FairKeys(fair), joined=joined), fair


def _virtual(c: Columns, ledger: ServiceLedger,
             config: FairShareConfig) -> dict[TenantKey, float]:
    """``ledger.virtual(config)``: the last tick's counters again when the measured
    seconds, the lifts and the weights are those of then (no chunk committed, none
    joined), as they are at most ticks."""
    last = c.virtual
    if (last is not None and last[2] == config and last[0] == ledger.service_s
            and last[1] == ledger.lift):
        return last[3]
    virtual = ledger.virtual(config)
    c.virtual = (dict(ledger.service_s), dict(ledger.lift), config, virtual)
    return virtual


def _walk(c: Columns, code: Ints, k1: Floats, k2: Floats, rows: Ints) -> Ints:
    """``np.lexsort((k2, k1, code))``: the last tick's walk again where it still holds,
    the rows it no longer orders (new, changed, moved past a neighbour) sorted apart
    and merged in by a binary search; the full sort when no walk is kept, a key is NaN
    or many rows moved."""
    c = c
    last, c.fair_walk = c.fair_walk, None
    if np.isnan(k1).any() or np.isnan(k2).any():  # no order a search can keep
        return lexsort3(k2, k1, code)
    if last is None:
        walk = lexsort3(k2, k1, code)
    elif same_bits(last[0], rows):  # the same rows at the same places
        walk = repaired_walk(code, k1, k2, last[1])
    else:
        position = np.full(len(c.views), -1, np.int64)
        position[rows] = np.arange(len(rows))
        kept = position[last[0][last[1]]]
        walk = repaired_walk(code, k1, k2, kept[kept >= 0])
    c.fair_walk = (rows, walk)
    return walk


def _contending(c: Columns, tick: Tick, band: Ints, tenant: Ints) -> frozenset[TenantKey]:
    """``ordering.active_tenants``: the (band, tenant) of every row not suspended."""
    names = c.tenant_names
    count = np.bincount((band * len(names) + tenant)[tick.state != SUSPENDED],
                        minlength=len(BAND_NAMES) * len(names))
    codes = np.flatnonzero(count)
    last = c.contending
    if last is not None and last[0] == len(names) and same_bits(last[1], codes):
        return last[2]
    out = frozenset((BAND_NAMES[code // len(names)], names[code % len(names)])
                    for code in codes.tolist())
    c.contending = (len(names), codes, out)
    return out


def _in_flight(c: Columns, band: Ints, tenant: Ints, charge: Floats,
               in_flight: Bools) -> dict[TenantKey, float]:
    """``fairness.in_flight_charges``: the in-flight rows' charges summed in index order."""
    out: dict[TenantKey, float] = {}
    names = c.tenant_names
    at = np.flatnonzero(in_flight)
    for b, t, value in zip(band[at].tolist(), tenant[at].tolist(), charge[at].tolist(),
                           strict=True):
        key = (BAND_NAMES[b], names[t])
        out[key] = out.get(key, 0.0) + value
    return out


def _start_tags(c: Columns, walk: Ints, code: Ints, charge: Floats,
                counters: dict[TenantKey, float], rows: Ints) -> Floats:
    """:func:`_walked_tags` in the rows' order, again only for the (band, tenant)s whose
    rows along the walk, charges or counter are not those of the last tick (when each
    holds the same places of the walk as then)."""
    walk_rows, walked, codes = rows[walk], charge[walk], code[walk]
    base = _bases(c, counters)
    last = c.fair_tags
    if last is None or not (same_bits(last[2], codes) and last[3].shape == base.shape):
        tags = _walked_tags(codes, walked, base)
    else:
        moved = last[3].view(np.int64) != base.view(np.int64)
        dirty = ((last[0] != walk_rows) | (last[1].view(np.int64) != walked.view(np.int64))
                 | moved[codes])
        tags = last[4]
        if dirty.any():
            group = np.cumsum(np.concatenate(([True], codes[1:] != codes[:-1]))) - 1
            again = np.zeros(int(group[-1]) + 1, np.bool_)
            again[group[dirty]] = True
            redo = again[group]
            tags = tags.copy()
            tags[redo] = _walked_tags(codes[redo], walked[redo], base)
    c.fair_tags = (walk_rows, walked, codes, base, tags)
    out = np.empty(len(walk))
    out[walk] = tags
    return out


def _bases(c: Columns, counters: dict[TenantKey, float]) -> Floats:
    """Each (band, tenant) code's counter (0: none), kept while ``counters`` is the same
    mapping (:func:`_virtual` hands the last one back while nothing changed)."""
    names, tenant_of = c.tenant_names, c.tenant_of
    last, size = c.bases, len(BAND_NAMES) * len(names)
    if last is not None and last[0] is counters and len(last[1]) == size:
        return last[1]
    base = np.zeros(size)
    for (band, tenant), value in counters.items():
        if band in BAND_NAMES and tenant in tenant_of:
            base[BAND_NAMES.index(band) * len(names) + tenant_of[tenant]] = value
    c.bases = (counters, base)
    return base


def fair_best(fair: FairArrays, pool: Ints, take: int, tick: Tick) -> Ints:
    """The ``take`` best of the pool (positions in it) by (fair key, key, index): whole
    (band, urgency) classes while they fit, then the least start tags of the class that
    does not (ties at the bar kept), and only those sorted."""
    if take <= 0:  # no slot (no alive worker): no class to fill, none to cut
        return np.zeros(0, np.int64)
    band, urgency, start, warm = (a[pool] for a in fair)
    k1, k2 = tick.k1[pool], tick.k2[pool]
    chosen = np.arange(len(pool))
    if take < len(pool):
        klass = (band * 3 + urgency).astype(np.int64)
        filled = np.cumsum(np.bincount(klass))
        edge = int(np.searchsorted(filled, take))
        need = take - (int(filled[edge - 1]) if edge else 0)
        edges = start[klass == edge]
        bar = np.partition(edges, need - 1)[need - 1]
        keep = (klass < edge) | ((klass == edge) & ((start <= bar) | np.isnan(bar)))
        chosen = np.flatnonzero(keep)
    return chosen[np.lexsort((chosen, k2[chosen], k1[chosen], warm[chosen], start[chosen],
                              urgency[chosen], band[chosen]))][:take]


class _FairKeys(Sequence[FairKey]):
    """``Ranking.fair`` over the four key arrays (read by index for the few jobs ranked one
    at a time, as the preemption's holders are)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: tuple[Floats, ...]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys[0])

    def __getitem__(self, i: int) -> FairKey:  # type: ignore[override]
        band, urgency, start, warm = self._keys
        return (float(band[i]), float(urgency[i]), float(start[i]), float(warm[i]))


def lexsort3(k2: Floats, k1: Floats, code: Ints) -> Ints:
    """``np.lexsort((k2, k1, code))`` (``code`` >= 0 first, then ``k1``, ``k2``, the index),
    faster: each float replaced by its dense rank (an unstable sort, then a count of new
    values), the four folded into one distinct integer, which any sort puts in the one order.
    A NaN (no rank) or a fold past 63 bits: ``np.lexsort`` itself."""
    n = len(code)
    if not n or np.isnan(k1).any() or np.isnan(k2).any():
        return np.lexsort((k2, k1, code))
    r1, r2 = _dense_rank(k1), _dense_rank(k2)
    m1, m2, top = int(r1.max()) + 1, int(r2.max()) + 1, int(code.max()) + 1
    if top * m1 * m2 * n >= 1 << 63:
        return np.lexsort((k2, k1, code))
    return np.argsort(((code * m1 + r1) * m2 + r2) * n + np.arange(n))


_WALK_KEY = np.dtype([("code", np.int64), ("k1", np.float64), ("k2", np.float64),
                      ("at", np.int64)])
"""One row of the fair walk's key: a structured value compares field by field, as
``np.lexsort`` orders (the index last)."""


def _walked_tags(codes: Ints, walked: Floats, base: Floats) -> Floats:
    """Each start tag along a walk: its (band, tenant)'s counter (``base[code]``) plus the
    charges before it along the walk of the same (band, tenant), summed from zero in that
    order (a cumulative sum along each row of a padded table: sequential, so the readable
    loop's floats)."""
    n = len(codes)
    if not n:
        return np.zeros(0)
    cut = np.concatenate(([True], codes[1:] != codes[:-1]))
    group = np.cumsum(cut) - 1
    begins = np.flatnonzero(cut)
    place = np.arange(n) - begins[group]
    sizes = np.diff(np.concatenate((begins, [n])))
    before = np.zeros(n)
    if int(sizes.max()) * len(begins) <= 4 * n + 4096:
        table = np.zeros((len(begins), int(sizes.max())))
        table[group, place] = walked
        summed = np.cumsum(table, axis=1)
        later = place > 0
        before[later] = summed[group[later], place[later] - 1]
    else:  # a few tenants hold most rows: one cumulative sum per tenant
        for lo, size in zip(begins.tolist(), sizes.tolist(), strict=True):
            before[lo + 1:lo + size] = np.cumsum(walked[lo:lo + size - 1])
    return base[codes] + before


def _walk_keys(code: Ints, k1: Floats, k2: Floats, at: Ints) -> npt.NDArray[np.void]:
    keys = np.empty(len(at), _WALK_KEY)
    keys["code"], keys["k1"], keys["k2"], keys["at"] = code[at], k1[at], k2[at], at
    return keys


def _in_order(code: Ints, k1: Floats, k2: Floats, at: Ints) -> Bools:
    """Whether each position of ``at`` comes before the next by (code, k1, k2, index)."""
    c, f, g = code[at], k1[at], k2[at]
    later = (g[:-1] < g[1:]) | ((g[:-1] == g[1:]) & (at[:-1] < at[1:]))
    later = (f[:-1] < f[1:]) | ((f[:-1] == f[1:]) & later)
    return (c[:-1] < c[1:]) | ((c[:-1] == c[1:]) & later)  # type: ignore[no-any-return]


def repaired_walk(code: Ints, k1: Floats, k2: Floats, kept: Ints) -> Ints:
    """The positions in ascending (code, k1, k2, index), from ``kept`` (the last walk's
    positions still here, in its order): those less both of each pair out of order (again
    until none is), the rest sorted apart and merged in (``np.searchsorted`` on structured
    keys, which compare field by field). The full sort when more than an eighth moved."""
    n = len(code)
    loose: list[Ints] = []
    if len(kept) < n:
        seen = np.zeros(n, np.bool_)
        seen[kept] = True
        loose.append(np.flatnonzero(~seen))
    for _ in range(8):
        ordered = _in_order(code, k1, k2, kept)
        if ordered.all():
            break
        out = np.zeros(len(kept), np.bool_)
        out[:-1] |= ~ordered
        out[1:] |= ~ordered
        loose.append(kept[out])
        kept = kept[~out]
    else:
        return lexsort3(k2, k1, code)
    if not loose:
        return kept
    merged = np.concatenate(loose)
    if len(merged) * 8 > n:
        return lexsort3(k2, k1, code)
    merged = merged[np.lexsort((merged, k2[merged], k1[merged], code[merged]))]
    where = np.searchsorted(_walk_keys(code, k1, k2, kept), _walk_keys(code, k1, k2, merged))
    return np.insert(kept, where, merged)


def _dense_rank(values: Floats) -> Ints:
    """Each value's rank among the distinct values (equal values, 0.0 and -0.0 too, share
    one)."""
    order = np.argsort(values)
    ordered = values[order]
    rank = np.empty(len(values), np.int64)
    rank[order] = np.cumsum(np.concatenate(([0], ordered[1:] != ordered[:-1])))
    return rank
