"""Replays a trace against a running stack under one policy and times every job from the client.

Submit times are taken just before the submit call; completion times when the client reads the
job's end from the store's completion stream (a blocking read, not polling).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from app.bench.workload import Arrival
from app.schemas import JobSpec
from tasks import keys
from tasks.errors import SteplineError
from tasks.submit import JobService

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """One job of a run, as the client saw it."""

    arrival: Arrival
    job_id: str | None = None
    submitted_at: float = 0.0
    finished_at: float | None = None
    final_state: str | None = None
    rejected: str | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass
class CompletionListener:
    """Reads the completion stream in a thread and stamps each job's end on arrival."""

    redis: Any
    seen: dict[str, tuple[float, str]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        last = self.redis.xrevrange(keys.DONE, count=1)
        self._last_id = last[0][0] if last else b"0-0"
        self._thread = threading.Thread(target=self._loop, daemon=True, name="done-listener")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            reply = self.redis.xread({keys.DONE: self._last_id}, block=200, count=500)
            now = time.time()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self.seen[fields[b"id"].decode()] = (now, fields[b"state"].decode())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def replay(
    service: JobService,
    trace: list[Arrival],
    *,
    drain_timeout_s: float,
    on_progress: Callable[[list[Outcome]], None] | None = None,
) -> list[Outcome]:
    """Submit each arrival at its time; wait for every accepted job to end (or the timeout)."""
    listener = CompletionListener(service.store.redis)
    listener.start()
    outcomes = [Outcome(arrival=a) for a in trace]
    start = time.monotonic()
    try:
        for outcome in outcomes:
            _sleep_until(start + outcome.arrival.arrival_s, outcomes, listener, on_progress)
            _submit(service, outcome)
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and not _all_done(outcomes, listener):
            _sleep_until(time.monotonic() + 0.2, outcomes, listener, on_progress)
    finally:
        listener.stop()
    _collect(outcomes, listener)
    return outcomes


def _submit(service: JobService, outcome: Outcome) -> None:
    a = outcome.arrival
    spec = JobSpec(kind=a.kind, slo=a.slo, params=a.params, deadline_s=a.deadline_s)  # type: ignore[arg-type]
    outcome.submitted_at = time.time()
    try:
        outcome.job_id, _ = service.submit(spec, tenant=a.tenant, tier=a.tier)
    except SteplineError as exc:
        outcome.rejected = str(exc)


def _sleep_until(
    target: float, outcomes: list[Outcome], listener: CompletionListener,
    on_progress: Callable[[list[Outcome]], None] | None,
) -> None:
    while (left := target - time.monotonic()) > 0:
        if on_progress is not None:
            _collect(outcomes, listener)
            on_progress(outcomes)
        time.sleep(min(left, 0.1))


def _all_done(outcomes: list[Outcome], listener: CompletionListener) -> bool:
    return all(o.job_id is None or o.job_id in listener.seen for o in outcomes)


def _collect(outcomes: list[Outcome], listener: CompletionListener) -> None:
    for o in outcomes:
        if o.job_id is not None and o.finished_at is None and o.job_id in listener.seen:
            o.finished_at, o.final_state = cast(tuple[float, str], listener.seen[o.job_id])
