"""Celery task events, coalesced: every event still goes to Flower, fewer publishes carry them.

A worker's task events (received, started, succeeded, …) are buffered by Celery and flushed on
the event loop's next turn, which for a chunk task is once per task: one ``PUBLISH`` and its
JSON per hop, ~0.5 ms of a hop (``tests/bench/bench_hop.py --no-task-events``). This consumer
flushes them at most every ``broker.task_events_flush`` instead (and at once when Celery's
buffer of 24 fills), so a job's hops share publishes; Flower shows each event that much later,
and nothing is dropped — a worker flushes what it holds when it shuts down. Set through
``worker_consumer`` in ``app/celery.py``; ``task_events_flush: 0`` keeps Celery's own timing.
"""

from __future__ import annotations

from celery.worker.consumer import Consumer

FLUSH_KEY = "stepline_task_events_flush_s"
"""The Celery setting holding ``broker.task_events_flush`` (seconds; 0: Celery's own)."""


class CoalescingConsumer(Consumer):  # type: ignore[misc]
    """Celery's worker consumer, flushing buffered task events on a timer."""

    _flush_pending = False

    def on_send_event_buffered(self) -> None:
        interval_s = float(self.app.conf.get(FLUSH_KEY) or 0.0)
        if not self.hub or interval_s <= 0:
            super().on_send_event_buffered()
            return
        if not self._flush_pending:
            self._flush_pending = True
            self.hub.call_later(interval_s, self._flush_coalesced)

    def _flush_coalesced(self) -> None:
        self._flush_pending = False
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()  # what the timer had not sent yet
        super().shutdown()


def consumer_path() -> str:
    """What ``worker_consumer`` names."""
    return f"{__name__}:{CoalescingConsumer.__name__}"


__all__ = ["FLUSH_KEY", "CoalescingConsumer", "consumer_path"]
