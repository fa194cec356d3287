"""The floor of a chunk hop: a bare Celery task on the same broker and the same Celery settings
as Stepline's workers (priority queues, acks late, prefetch 1, task events, JSON), doing nothing
but re-publishing itself. `bench_hop.py` runs a worker of this app beside Stepline's."""

from __future__ import annotations

import json
import time

from celery import Celery
from kombu import Exchange, Queue

from app.celery import celery_config
from tasks.runtime import current_settings
from tasks.transport import install as install_transport

FLOOR_TASK = "stepline.bench.floor_hop"
FLOOR_QUEUE = "bench-floor"
"""Its own queue: Stepline's workers must not take (and drop) its messages."""

app = Celery("stepline_floor")
app.conf.update(celery_config(current_settings()))
app.conf.beat_schedule = {}
app.conf.worker_consumer = "celery.worker.consumer:Consumer"  # Celery's own event timing
install_transport(enabled=False)  # stock kombu's channel: the floor is plain Celery
app.conf.task_queues = [Queue(FLOOR_QUEUE, Exchange(FLOOR_QUEUE, type="direct"),
                              routing_key=FLOOR_QUEUE)]
app.conf.task_default_queue = FLOOR_QUEUE


_STARTS: dict[str, list[float]] = {}
"""When each hop of a chain began, per run (every hop of a chain runs in this one process)."""


@app.task(name=FLOOR_TASK, bind=True, acks_late=True)
def floor_hop(self: object, run: str, left: int, step_ms: float) -> None:
    """Sleep one step, then publish the next hop until none is left; the last one records the
    chain's hop start times (JSON) under ``floor:<run>`` in Redis."""
    _STARTS.setdefault(run, []).append(time.time())
    if step_ms > 0:
        time.sleep(step_ms / 1000.0)
    if left > 0:
        app.send_task(FLOOR_TASK, args=[run, left - 1, step_ms], queue=FLOOR_QUEUE)
        return
    _STARTS[run].append(time.time())  # the end of the last step
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        client.set(f"floor:{run}", json.dumps(_STARTS.pop(run)), ex=600)
