"""Clairvoyant preemptive oracles (EDF and SRPT) on m identical workers: the simulation's yardstick.

Idealised on purpose: every job's size is known exactly at arrival, preemption and migration
happen at any instant for free, there is no dispatch overhead and no tick delay, and a failed
worker loses no work (its job moves to another worker at once). Global EDF runs the m jobs with
the earliest deadlines; SRPT the m jobs with the least remaining work.

What bound holds (m > 1 workers): neither is optimal in general — global EDF is not optimal for
deadlines on several processors and collapses under overload (it keeps serving jobs already
late), and multi-server SRPT is not optimal for total response time. They are the best simple
clairvoyant schedules, and on traces where every job completes (underload) the policies stay
below them in practice. :func:`mean_response_lower_bound_s` gives a true lower bound on the
mean latency of any schedule of the trace on m workers: SRPT on one worker m times as fast.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Discipline(str, Enum):
    """Which clairvoyant rule the oracle follows."""

    EDF = "edf"
    """Earliest deadline first: the rule that meets deadlines when any single-server schedule
    can."""
    SRPT = "srpt"
    """Shortest remaining processing time: the rule that minimises mean response time on one
    server."""


@dataclass(frozen=True, slots=True)
class OracleJob:
    """One job as the oracle knows it: exact size, absolute deadline."""

    arrival_s: float
    size_s: float
    deadline_s: float


def run_oracle(jobs: Sequence[OracleJob], workers: int, discipline: Discipline, end_s: float,
               fail_at_s: float | None = None) -> list[float | None]:
    """Each job's finish time (None if unfinished at ``end_s``); ``jobs`` sorted by arrival.
    At ``fail_at_s`` one worker is lost for good."""
    return _Oracle(jobs, workers, discipline).run(end_s, fail_at_s)


def mean_response_lower_bound_s(jobs: Sequence[OracleJob], workers: int) -> float:
    """Mean latency of preemptive SRPT on one worker ``workers`` times as fast: no schedule of
    these jobs on ``workers`` workers (whatever its overheads) has a lower mean latency."""
    fast = [OracleJob(j.arrival_s, j.size_s / workers, j.deadline_s) for j in jobs]
    finish = _Oracle(fast, 1, Discipline.SRPT).run(float("inf"), None)
    return sum(f - j.arrival_s for f, j in zip(finish, jobs, strict=True)
               if f is not None) / max(len(jobs), 1)


class _Oracle:
    """Event loop: arrivals, completions and the failure change which m jobs run."""

    def __init__(self, jobs: Sequence[OracleJob], workers: int, discipline: Discipline) -> None:
        self.jobs, self.capacity = jobs, workers
        self.edf = discipline is Discipline.EDF
        self.remaining = [j.size_s for j in jobs]
        self.finish: list[float | None] = [None] * len(jobs)
        self.running: dict[int, tuple[float, int]] = {}  # job → (finish time, token)
        self.completions: list[tuple[float, int, int]] = []
        self.worst: list[tuple[float, int, int]] = []  # max-heap by key, lazily pruned
        self.waiting: list[tuple[float, float, int]] = []
        self.token = 0

    def run(self, end_s: float, fail_at_s: float | None) -> list[float | None]:
        jobs, nxt, n = self.jobs, 0, len(self.jobs)
        fail_s = float("inf") if fail_at_s is None else fail_at_s
        while True:
            done_s = self._next_completion_s()
            arrive_s = jobs[nxt].arrival_s if nxt < n else float("inf")
            now = min(done_s, arrive_s, fail_s)
            if now > end_s or now == float("inf"):
                return self.finish
            if now == fail_s:
                fail_s = float("inf")
                self._lose_worker(now)
            elif done_s <= arrive_s:
                self._complete(now)
            else:
                self._arrive(nxt, now)
                nxt += 1

    def _key(self, i: int, finish_s: float) -> float:
        return self.jobs[i].deadline_s if self.edf else finish_s

    def _next_completion_s(self) -> float:
        heap = self.completions
        while heap and self.running.get(heap[0][2], (0.0, -1))[1] != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def _start(self, i: int, now: float) -> None:
        self.token += 1
        finish_s = now + self.remaining[i]
        self.running[i] = (finish_s, self.token)
        heapq.heappush(self.completions, (finish_s, self.token, i))
        heapq.heappush(self.worst, (-self._key(i, finish_s), self.token, i))

    def _wait(self, i: int) -> None:
        job = self.jobs[i]
        key = job.deadline_s if self.edf else self.remaining[i]
        heapq.heappush(self.waiting, (key, job.arrival_s, i))

    def _worst_running(self) -> tuple[float, int] | None:
        heap = self.worst
        while heap and self.running.get(heap[0][2], (0.0, -1))[1] != heap[0][1]:
            heapq.heappop(heap)
        return (-heap[0][0], heap[0][2]) if heap else None

    def _preempt(self, i: int, now: float) -> None:
        finish_s, _ = self.running.pop(i)
        self.remaining[i] = finish_s - now
        self._wait(i)

    def _arrive(self, i: int, now: float) -> None:
        if len(self.running) < self.capacity:
            self._start(i, now)
            return
        worst = self._worst_running()
        mine = self.jobs[i].deadline_s if self.edf else now + self.remaining[i]
        if worst is not None and mine < worst[0]:
            self._preempt(worst[1], now)
            self._start(i, now)
        else:
            self._wait(i)

    def _complete(self, now: float) -> None:
        _, _, i = heapq.heappop(self.completions)
        del self.running[i]
        self.remaining[i] = 0.0
        self.finish[i] = now
        if self.waiting and len(self.running) < self.capacity:
            self._start(heapq.heappop(self.waiting)[2], now)

    def _lose_worker(self, now: float) -> None:
        self.capacity = max(self.capacity - 1, 0)
        while len(self.running) > self.capacity:
            worst = self._worst_running()
            assert worst is not None
            self._preempt(worst[1], now)
