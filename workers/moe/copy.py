"""Copy engines that move one expert's weights from host memory to its device slot.

A demand load (the layer needs the expert now) copies on the caller's stream and the caller waits;
a prefetch copies on a separate lane so it overlaps compute, and hands back a handle the consumer
waits on when it finally needs the expert:

- :class:`CudaStreamCopier`: a CUDA side stream; the handle holds an event the compute stream
  waits on (the host never blocks).
- :class:`ThreadCopier`: on the CPU, one copy thread (torch releases the GIL while copying), so
  the overlap with the forward pass is real there too.
- :class:`SimulatedCopier`: a virtual clock and one host-to-device link, for replaying routing
  traces: a copy takes ``copy_cost`` time units, demand copies jump the queue of prefetches that
  have not started, and the replay advances the clock by each layer's compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

Weights = tuple[torch.Tensor, ...]  # (gate_up, down[, gate_up bias, down bias]) of one expert


class CopyHandle(Protocol):
    """One copy in flight (or done)."""

    def ready(self) -> bool:
        """True if the weights have arrived (the consumer would not wait)."""
        ...

    def wait(self) -> tuple[Weights, float]:
        """The weights, after waiting for them; and how long the consumer waited, in the
        engine's time unit (0.0 where it cannot tell without blocking the device)."""
        ...


class CopyEngine(Protocol):
    """Moves expert weights to the device."""

    def copy(self, src: Weights, prefetch: bool) -> CopyHandle:
        """Start copying ``src``; a prefetch goes on the side lane, a demand load does not."""
        ...

    def now(self) -> float:
        """The engine's clock (seconds, or the simulator's time units)."""
        ...

    def close(self) -> None:
        """Stop background copying (pending copies finish first)."""
        ...


@dataclass(slots=True)
class _Done:
    weights: Weights

    def ready(self) -> bool:
        return True

    def wait(self) -> tuple[Weights, float]:
        return self.weights, 0.0


def _to_device(src: Weights, device: torch.device, non_blocking: bool = False) -> Weights:
    return tuple(t.to(device, non_blocking=non_blocking, copy=True) for t in src)


class InlineCopier:
    """Every copy synchronous on the caller (prefetches too): no overlap, fully deterministic."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, src: Weights, prefetch: bool) -> CopyHandle:
        return _Done(_to_device(src, self.device))

    def now(self) -> float:
        return time.perf_counter()

    def close(self) -> None:
        return None


@dataclass(slots=True)
class _FutureHandle:
    future: Future[Weights]

    def ready(self) -> bool:
        return self.future.done()

    def wait(self) -> tuple[Weights, float]:
        if self.future.done():
            return self.future.result(), 0.0
        started = time.perf_counter()
        weights = self.future.result()
        return weights, time.perf_counter() - started


class ThreadCopier:
    """Prefetches copy on one background thread; demand loads copy on the caller."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy(self, src: Weights, prefetch: bool) -> CopyHandle:
        if not prefetch:
            return _Done(_to_device(src, self.device))
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-copy")
            pool = self._pool
        return _FutureHandle(pool.submit(_to_device, src, self.device))

    def now(self) -> float:
        return time.perf_counter()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


@dataclass(slots=True)
class _CudaHandle:
    weights: Weights
    event: torch.cuda.Event

    def ready(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> tuple[Weights, float]:
        stream = torch.cuda.current_stream(self.weights[0].device)
        stream.wait_event(self.event)  # the compute stream waits; the host does not
        for tensor in self.weights:
            tensor.record_stream(stream)  # freed only after the compute stream used it
        return self.weights, 0.0


class CudaStreamCopier:
    """Prefetches copy on a CUDA side stream from pinned host memory; the consumer's stream
    waits on the copy's event. Demand loads copy on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def copy(self, src: Weights, prefetch: bool) -> CopyHandle:
        if not prefetch:
            return _Done(_to_device(src, self.device, non_blocking=True))
        with torch.cuda.stream(self._stream):
            weights = _to_device(src, self.device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return _CudaHandle(weights, event)

    def now(self) -> float:
        return time.perf_counter()

    def close(self) -> None:
        self._stream.synchronize()


def copier_for(device: torch.device, overlap: bool = True) -> CopyEngine:
    """The copy engine a live cache on ``device`` uses (overlapping unless ``overlap`` is off)."""
    if not overlap:
        return InlineCopier(device)
    if device.type == "cuda":
        return CudaStreamCopier(device)
    return ThreadCopier(device)


# -- the simulated link, for trace replay -------------------------------------------------------


@dataclass(slots=True)
class VirtualClock:
    """Time in units of one MoE layer's compute (by convention); the replay advances it."""

    t: float = 0.0

    def advance(self, dt: float) -> None:
        self.t += dt


@dataclass(slots=True)
class _SimHandle:
    link: SimulatedCopier
    weights: Weights
    start: float
    finish: float
    prefetch: bool

    def ready(self) -> bool:
        return self.link.clock.t >= self.finish

    def wait(self) -> tuple[Weights, float]:
        if self.start > self.link.clock.t:
            self.link.promote(self)  # needed now: it jumps the prefetch queue like a demand load
        stall = max(0.0, self.finish - self.link.clock.t)
        if stall > 0:
            self.link.clock.advance(stall)
        return self.weights, stall


class SimulatedCopier:
    """One host-to-device link on a virtual clock: copies take ``copy_cost`` each, one at a time.
    A demand copy goes after the copy in progress but before prefetches that have not started
    (they shift back), the way a runtime would order its copy queue."""

    def __init__(self, clock: VirtualClock, copy_cost: float,
                 materialise: Callable[[Weights], Weights] | None = None) -> None:
        self.clock = clock
        self.copy_cost = copy_cost
        self._materialise = materialise or (lambda w: w)
        self._queue: list[_SimHandle] = []  # prefetches not finished, in link order

    def copy(self, src: Weights, prefetch: bool) -> CopyHandle:
        now = self.clock.t
        self._queue = [h for h in self._queue if h.finish > now]
        weights = self._materialise(src)
        if prefetch:
            start = max([now, *(h.finish for h in self._queue)])
            handle = _SimHandle(self, weights, start, start + self.copy_cost, True)
            self._queue.append(handle)
            return handle
        start = self._jump_queue(now)
        # The demand copy blocks its caller right away.
        self.clock.advance(start + self.copy_cost - now)
        return _Done(weights)

    def promote(self, handle: _SimHandle) -> None:
        """``handle`` has not started and is needed now: run it next, before other prefetches."""
        now = self.clock.t
        self._queue.remove(handle)
        self._queue = [h for h in self._queue if h.finish > now]
        handle.start = self._jump_queue(now)
        handle.finish = handle.start + self.copy_cost

    def _jump_queue(self, now: float) -> float:
        """Start time of a copy that goes after the one in progress and before every prefetch
        that has not started (those shift back by one copy)."""
        in_progress = [h for h in self._queue if h.start <= now]
        start = max([now, *(h.finish for h in in_progress)])
        for pending in self._queue:
            if pending.start > now:
                pending.start += self.copy_cost
                pending.finish += self.copy_cost
        return start

    def now(self) -> float:
        return self.clock.t

    def close(self) -> None:
        self._queue.clear()
