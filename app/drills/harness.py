"""What every drill shares: the record of one injected fault (and the block that drives it),
and the bounded wait that polls a service which may still be coming back (``stepline
reliability``, ``stepline reliability --hosts N``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

log = logging.getLogger(__name__)

UNREACHABLE = (redis.RedisError, httpx.HTTPError, OSError)
"""Errors a wait counts as "not yet": a Redis, an API or a socket still coming back."""


@dataclass
class Fault:
    """One injected fault and what became of it."""

    kind: str
    injected: bool = False
    survived: bool | None = None
    recovery_s: float | None = None
    """Seconds from injection until the drill saw the system whole again (None: it did not)."""
    detail: str = ""
    victims: list[str] = field(default_factory=list)
    """Jobs the fault hit directly; survived also requires each of them to end exact."""
    started_at: float = 0.0
    """Wall clock (epoch seconds) when injection began, to line the fault up with the logs."""


def wait_until(predicate: Callable[[], Any], timeout_s: float, period_s: float = 0.1) -> Any:
    """Poll until ``predicate()`` is truthy and return that value (None once ``timeout_s``
    passed): a bound against a hang, not a speed claim. A call that raises one of
    :data:`UNREACHABLE` counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except UNREACHABLE:
            value = None
        if value:
            return value
        time.sleep(period_s)
    return None


@contextmanager
def recorded(kind: str, into: list[Fault]) -> Iterator[Fault]:
    """A new :class:`Fault` of ``kind`` for the block that drives it, appended to ``into``
    when the block ends. An exception the block raises (a fault the drill could not drive) is
    logged and reported in the fault, not survived, instead of ending the drill."""
    fault = Fault(kind, started_at=round(time.time(), 3))
    try:
        yield fault
    except Exception as exc:
        log.exception("fault %s", kind)
        fault.survived = False
        fault.detail += f" (drill error: {exc!r})"
    into.append(fault)
