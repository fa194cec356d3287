"""The deferral of overcommitted work (``scheduler.judgement``'s Moore-Hodgson rule) over the
incremental planner's columns.

Runnable jobs are taken in deadline order; while the work so far overruns the room up to a
job's deadline (its time to the deadline × the workers), the job of least value per second of
work seen so far is deferred. The floats and the ties are those of the readable loop.
"""

from __future__ import annotations

import heapq
from functools import partial

import numpy as np

from scheduler.columns import Columns, Floats, Ints, Tick


def defer_overcommitted(c: Columns, tick: Tick, runnable: Ints, workers: int,
                        now_s: float) -> frozenset[int]:
    """``judgement._defer_overcommitted`` (Moore-Hodgson): the running sum of work in
    deadline order is compared with the room a block at a time (a cumulative sum from the
    running total, so each partial sum is the readable loop's float); the heap of the
    jobs seen so far is built only when some job does not fit. The heap holds each job's
    rank in the readable heap's order of (key, index) — one sort up front instead of a
    tuple per job and tuple comparisons — unless a key is NaN (then the tuples)."""
    order = c.kept("defer order", (runnable, tick.deadline[runnable]), lambda: runnable[
        np.argsort(tick.deadline[runnable], kind="stable")])
    n = len(order)
    if not n:
        return frozenset()
    work_of = tick.remaining[order]
    room = (tick.deadline[order] - now_s) * max(workers, 1)
    heap: list[int] = []
    deferred: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    work_s, start, pushed, block, dense = 0.0, 0, 0, n, False
    entries: list[int] = []
    """Per position in ``order``: its heap entry (its rank)."""
    index_of: list[int] = []
    work_by: list[float] = []
    """Per rank: the job's survey index and its work."""
    room_list: list[float] = []
    work_list: list[float] = []
    while start < n:
        if dense:
            # Jobs that do not fit come close together: the readable loop, a stretch at a
            # time, until a stretch fits whole.
            stop, hit = min(start + 64, n), False
            for k in range(start, stop):
                work_s += work_list[k]
                push(heap, entries[k])
                if work_s > room_list[k]:
                    hit = True
                    while work_s > room_list[k] and heap:
                        e = pop(heap)
                        work_s -= work_by[e]
                        deferred.append(index_of[e])
            start = pushed = stop
            dense, block = hit, 64
            continue
        end = min(start + block, n)
        sums = np.cumsum(np.concatenate(([work_s], work_of[start:end])))[1:]
        over = sums > room[start:end]
        if not over.any():
            work_s, start, block = float(sums[-1]), end, min(block * 2, 4096)
            continue
        at = start + int(over.argmax())
        work_s = float(sums[at - start])
        if not entries:
            keys = (-work_of) / c.f["value"][tick.rows[order]]
            if np.isnan(keys).any():
                return _defer_tuples(c, tick, order, room)
            entries, index_of, work_by, work_list = c.kept(
                "defer ranks", (order, keys, work_of), partial(_ranks, order, keys, work_of))
            room_list = room.tolist()
        fresh = entries[pushed:at + 1]
        if len(fresh) > len(heap) // 4:
            heap.extend(fresh)
            heapq.heapify(heap)
        else:
            for item in fresh:
                push(heap, item)
        pushed = at + 1
        while work_s > room_list[at] and heap:
            e = pop(heap)
            work_s -= work_by[e]
            deferred.append(index_of[e])
        start, dense = at + 1, True
    return frozenset(deferred)


def _defer_tuples(c: Columns, tick: Tick, order: Ints, room: Floats) -> frozenset[int]:
    """:func:`defer_overcommitted` as the readable loop, for keys no sort can rank as the heap
    compares them (a NaN)."""
    keys = ((-tick.remaining[order]) / c.f["value"][tick.rows[order]]).tolist()
    remaining = tick.remaining.tolist()
    heap: list[tuple[float, int]] = []
    deferred: list[int] = []
    work_s = 0.0
    for k, i in enumerate(order.tolist()):
        work_s += remaining[i]
        heapq.heappush(heap, (keys[k], i))
        while work_s > room[k] and heap:
            _, j = heapq.heappop(heap)
            work_s -= remaining[j]
            deferred.append(j)
    return frozenset(deferred)


def _ranks(order: Ints, keys: Floats, work_of: Floats
           ) -> tuple[list[int], list[int], list[float], list[float]]:
    """The Moore-Hodgson heap's entries: each position's rank in the order of (key, index),
    and by rank the index and the work; and the work by position."""
    n = len(order)
    by = np.lexsort((order, keys))
    rank = np.empty(n, np.int64)
    rank[by] = np.arange(n)
    return rank.tolist(), order[by].tolist(), work_of[by].tolist(), work_of.tolist()
