"""The scheduler tick: beat sends it to ``control`` every ``origin_detection_interval``.

One tick runs at a time cluster-wide (a Redis lease), so two scheduler workers can run for high
availability. The tick snapshots the store, asks the pure policy for a plan and applies it.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import redis
from celery import shared_task
from redis.commands.core import Script

from scheduler import IncrementalPlanner
from tasks import keys, scripts
from tasks.adapter import TickPhases, run_tick
from tasks.context import worker_context
from tasks.load_estimates import ExpectedLoads
from tasks.routing import TICK_TASK
from tasks.snapshot import SnapshotCache
from tasks.store import JobStore

log = logging.getLogger(__name__)


@shared_task(name=TICK_TASK, bind=True, ignore_result=True)
def tick(self: Any) -> str:
    """Run one scheduling tick if this worker holds (or wins) the tick lease."""
    ctx = worker_context()
    me = self.request.hostname or "scheduler"
    interval_s = ctx.settings.scheduler.origin_detection_interval
    cache = snapshot_cache(ctx.store)
    ttl_s = max(10 * interval_s, 1.0)
    held = _take_lease(ctx.store.redis, me, ttl_s=ttl_s)
    taken_at = time.monotonic()
    if held is Lease.OTHER:
        return "standby"
    if held is Lease.TAKEN:  # another scheduler may have ticked since: trust nothing kept
        cache.invalidate()

    started = time.perf_counter()
    phases = TickPhases()
    with collector_paused():
        run_tick(ctx, now_s=time.time(), cache=cache, planner=held_planner(ctx.store),
                 phases=phases, loads=held_loads(ctx.store),
                 holds=lambda: still_holds(ctx.store.redis, me, ttl_s, taken_at))
    _record(ctx.store.redis, time.perf_counter() - started, phases)
    ctx.checkpoint_sweeper.maybe_start(time.time())
    return "ticked"


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic-GC pause inside the tick. A tick builds tens of thousands of records and views;
    every 700 container allocations start a collection, and some of those are full ones over the
    worker's whole heap. Reference counting frees the tick's objects when it ends, and the
    collector, enabled again, catches up between ticks. The control worker (solo pool) runs
    only ticks, so nothing else is paused."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Lease(Enum):
    """What asking for the tick lease found."""

    TAKEN = 1
    """This worker holds it now and did not just before (its snapshot cache may be stale)."""
    RENEWED = 2
    """This worker held it and still does, or took back its own lapsed lease that nobody else
    took meanwhile (a tick longer than the lease: its kept snapshot is still good)."""
    OTHER = 0
    """Another scheduler holds it."""


@functools.cache
def snapshot_cache(store: JobStore) -> SnapshotCache:
    """The worker's snapshot, kept between its ticks (one per store)."""
    return SnapshotCache(store)


@functools.cache
def held_planner(store: JobStore) -> IncrementalPlanner:
    """The worker's planner, kept between its ticks beside the snapshot cache (one per store)."""
    return IncrementalPlanner()


@functools.cache
def held_loads(store: JobStore) -> ExpectedLoads:
    """The waiting jobs' expected loads, kept between the worker's ticks (one per store)."""
    return ExpectedLoads()


def _take_lease(client: redis.Redis, me: str, ttl_s: float) -> Lease:
    """Take or renew the tick lease; another live scheduler keeps it until it stops ticking."""
    return Lease(int(_lease_script(client)(keys=[keys.TICK_LEASE, keys.TICK_LAST_HOLDER],
                                           args=[me, int(ttl_s * 1000)])))


def still_holds(client: redis.Redis, me: str, ttl_s: float, taken_at: float) -> bool:
    """Whether this worker still holds the tick lease it took at ``taken_at`` (monotonic): at
    once while under half its time to live has passed (no round trip: nobody else can have
    taken it), else asked again — renewed if nobody took it meanwhile — so a scheduler that
    hung past its lease (SIGSTOP, a frozen host) and woke finds it lost before applying."""
    if time.monotonic() - taken_at < ttl_s / 2:
        return True
    return _hold_lease(client, me, ttl_s)


def _hold_lease(client: redis.Redis, me: str, ttl_s: float) -> bool:
    """Whether this worker holds the tick lease (taken or renewed)."""
    return _take_lease(client, me, ttl_s) is not Lease.OTHER


@functools.cache
def _lease_script(client: redis.Redis) -> Script:
    """The lease script, registered once per client: every tick sends a bare ``EVALSHA``."""
    return scripts.register(client, "tick_lease")


def _record(client: Any, duration_s: float, phases: TickPhases | None = None) -> None:
    """Tick duration and start time, for the tick p99 and interval jitter figures; its phases'
    milliseconds and what it read (:meth:`TickPhases.stream_fields`)."""
    now = time.time()
    fields = {"duration_ms": f"{duration_s * 1000:.3f}", "ts": repr(now),
              **(phases.stream_fields() if phases is not None else {})}
    client.xadd(keys.TICK_STATS, fields,
                maxlen=20_000, approximate=True)
