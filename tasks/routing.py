"""Queue names and how a class maps to its queue."""

from __future__ import annotations

from scheduler.lifecycle import SloClass

REALTIME, INTERACTIVE, BATCH, CONTROL, STANDBY = (
    "realtime", "interactive", "batch", "control", "standby",
)
ALL_QUEUES = (REALTIME, INTERACTIVE, BATCH, CONTROL, STANDBY)
WORK_QUEUES = (REALTIME, INTERACTIVE, BATCH, STANDBY)
"""What a normal worker consumes, in strict priority order."""

CLASS_QUEUE = {
    SloClass.REALTIME: REALTIME, SloClass.INTERACTIVE: INTERACTIVE, SloClass.BATCH: BATCH,
}
FIFO_QUEUE = BATCH
"""Under the fifo baseline every job is one atomic task on this one queue."""
