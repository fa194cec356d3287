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
from typing import Any

import redis
from celery import shared_task
from redis.commands.core import Script

from tasks import keys, scripts
from tasks.adapter import run_tick
from tasks.context import worker_context
from tasks.routing import TICK_TASK

log = logging.getLogger(__name__)


@shared_task(name=TICK_TASK, bind=True, ignore_result=True)
def tick(self: Any) -> str:
    """Run one scheduling tick if this worker holds (or wins) the tick lease."""
    ctx = worker_context()
    me = self.request.hostname or "scheduler"
    interval_s = ctx.settings.scheduler.origin_detection_interval
    if not _hold_lease(ctx.store.redis, me, ttl_s=max(10 * interval_s, 1.0)):
        return "standby"

    started = time.perf_counter()
    with collector_paused():
        run_tick(ctx, now_s=time.time())
    _record(ctx.store.redis, time.perf_counter() - started)
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


def _hold_lease(client: redis.Redis, me: str, ttl_s: float) -> bool:
    """Take or renew the tick lease; another live scheduler keeps it until it stops ticking."""
    return bool(_lease_script(client)(keys=[keys.TICK_LEASE], args=[me, int(ttl_s * 1000)]))


@functools.cache
def _lease_script(client: redis.Redis) -> Script:
    """The lease script, registered once per client: every tick sends a bare ``EVALSHA``."""
    return scripts.register(client, "tick_lease")


def _record(client: Any, duration_s: float) -> None:
    """Tick duration and start time, for the tick p99 and interval jitter figures."""
    now = time.time()
    client.xadd(keys.TICK_STATS, {"duration_ms": f"{duration_s * 1000:.3f}", "ts": repr(now)},
                maxlen=20_000, approximate=True)
