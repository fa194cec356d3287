"""Worker lifecycle hooks: advertise the worker once ready, withdraw it on shutdown."""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from tasks.affinity import consume_in_affinity_order
from tasks.context import worker_context
from tasks.routing import AFFINITY_CLASSES, WORK_QUEUES

log = logging.getLogger(__name__)


@worker_ready.connect
def _advertise(sender: Any = None, **_: Any) -> None:
    ctx = worker_context()
    ctx.name = sender.hostname
    try:
        ctx.queues = tuple(q.name for q in sender.task_consumer.queues)
    except AttributeError:
        ctx.queues = ()
    else:
        ctx.consumer = sender
        if ctx.settings.affinity.enabled and set(ctx.queues) & set(AFFINITY_CLASSES):
            ctx.queues = consume_in_affinity_order(sender, ctx.name)
    ctx.heartbeat_once()
    ctx.start_heartbeat()
    if set(ctx.queues) & set(WORK_QUEUES):
        # on the consumer's thread: no chunk runs before the models are warm
        ctx.warm_up()
        ctx.start_stager()
    else:
        ctx.warm = True  # the scheduler's worker runs ticks, never a model
    ctx.heartbeat_once()
    log.info("worker %s ready on %s", ctx.name, ",".join(ctx.queues))


@worker_shutdown.connect
def _withdraw(**_: Any) -> None:
    worker_context().stop()
