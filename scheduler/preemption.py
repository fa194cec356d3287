"""Choosing which running jobs yield their worker."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from scheduler.model import JobView


def pick_victims(running: Iterable[tuple[JobView, float]], count: int, max_preemptions: int,
                 protected: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Up to ``count`` jobs to preempt, lowest score first, among ``(job, score)`` pairs.

    A job already preempted ``max_preemptions`` times, one already flagged, or a protected one
    (the origin) is never chosen. Ties go to the latest arrival, so older jobs keep their place.
    """
    if count <= 0:
        return ()
    eligible = (
        (score, -job.submitted_at_s, job.job_id)
        for job, score in running
        if job.preemptions < max_preemptions
        and not job.preempt_requested
        and job.job_id not in protected
    )
    return tuple(job_id for _, _, job_id in heapq.nsmallest(count, eligible))
