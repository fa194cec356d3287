"""Worker occupancy read from job event streams: which worker held which job when, and the
capacity left idle while accepted work waited.

Pure interval arithmetic (stdlib only), shared by the bench's report (``app.bench.report``) and
the dashboard's live timeline (``app.api.timeline``); it imports nothing of ``app`` so neither
reaches the other through it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Interval = tuple[float, float]
"""``(start_s, end_s)`` in wall-clock seconds."""


@dataclass(frozen=True, slots=True)
class JobSpan:
    """One accepted job of a run as the bench observed it."""

    runnable_at_s: float
    """When it could first run: its submit time (or its last dependency's end, if later)."""
    finished_at_s: float | None
    """When it ended (any terminal state); None if it had not ended when observation stopped."""
    running: tuple[tuple[str, Interval], ...]
    """``(worker, interval)`` for every stretch a worker held it."""


@dataclass(frozen=True, slots=True)
class IdleWhileWaiting:
    """Capacity a run left idle while at least one of its jobs was runnable and waiting."""

    idle_worker_s: float
    """Σ over time of (idle workers), wherever ≥ 1 job waited."""
    servable_worker_s: float
    """Σ over time of min(idle workers, waiting jobs): the part that waiting work could have
    used, since one job occupies one worker at a time."""
    capacity_worker_s: float
    """Workers × the observed window."""

    @property
    def share(self) -> float | None:
        return self.idle_worker_s / self.capacity_worker_s if self.capacity_worker_s else None

    def as_json(self) -> dict[str, float | None]:
        return {"worker_s": self.idle_worker_s, "share_of_capacity": self.share,
                "servable_worker_s": self.servable_worker_s,
                "capacity_worker_s": self.capacity_worker_s}


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(span: Interval, holes: Iterable[Interval]) -> list[Interval]:
    """``span`` less the union of ``holes``."""
    start, end = span
    out: list[Interval] = []
    for a, b in merge(holes):
        if a > start:
            out.append((start, min(a, end)))
        start = max(start, b)
        if start >= end:
            break
    if start < end:
        out.append((start, end))
    return [i for i in out if i[1] > i[0]]


def running_intervals(
    events: Sequence[Mapping[str, str]], until_s: float
) -> list[tuple[str, Interval]]:
    """Who held a job when, from its event stream: each claim (a ``state`` event into RUNNING,
    ``by`` the worker) until the job leaves RUNNING, plus each chunk commit's compute interval
    ``[ts − service_s, ts]`` (a subset of the former, kept should a claim event be missing).
    A claim still open at the end of the stream lasts until ``until_s``."""
    out: list[tuple[str, Interval]] = []
    claim: tuple[str, float] | None = None
    for e in events:
        ts = float(e["ts"])
        if e.get("kind") == "commit":
            out.append((e["by"], (ts - float(e["service_s"]), ts)))
        elif e.get("kind") == "state":
            if claim is not None and e.get("from") == "RUNNING":
                out.append((claim[0], (claim[1], ts)))
                claim = None
            if e.get("to") == "RUNNING":
                claim = (e["by"], ts)
    if claim is not None:
        out.append((claim[0], (claim[1], max(until_s, claim[1]))))
    return out


def idle_while_waiting(
    jobs: Sequence[JobSpan], workers: int, window: Interval
) -> IdleWhileWaiting:
    """Worker-seconds idle while work waited, over ``window``.

    A job *waits* while it is runnable (from ``runnable_at_s``), not yet ended, and held by no
    worker (so a chunked job's hop between two chunks counts as waiting: dispatch overhead is
    capacity lost). A worker is *idle* while it holds no job of the run; a worker that never
    appears in any job's events is idle throughout. Overlapping intervals of one worker, or of
    one job, count once."""
    busy: dict[str, list[Interval]] = defaultdict(list)
    deltas: list[tuple[float, int, int]] = []  # (time, Δ busy workers, Δ waiting jobs)
    for job in jobs:
        for worker, interval in job.running:
            busy[worker].append(interval)
        for a, b in _clip(_waiting(job, window[1]), window):
            deltas += [(a, 0, 1), (b, 0, -1)]
    for intervals in busy.values():
        for a, b in _clip(merge(intervals), window):
            deltas += [(a, 1, 0), (b, -1, 0)]
    return _sweep(sorted(deltas), workers, window)


def _waiting(job: JobSpan, until_s: float) -> list[Interval]:
    end = until_s if job.finished_at_s is None else job.finished_at_s
    return subtract((job.runnable_at_s, end), (i for _, i in job.running))


def _clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _sweep(
    deltas: Sequence[tuple[float, int, int]], workers: int, window: Interval
) -> IdleWhileWaiting:
    busy = waiting = 0
    idle_s = servable_s = 0.0
    last = window[0]
    for t, d_busy, d_waiting in deltas:
        if waiting > 0:
            idle = max(workers - busy, 0)
            idle_s += idle * (t - last)
            servable_s += min(idle, waiting) * (t - last)
        last, busy, waiting = t, busy + d_busy, waiting + d_waiting
    capacity = workers * max(window[1] - window[0], 0.0)
    return IdleWhileWaiting(idle_s, servable_s, capacity)
