"""The dashboard's live worker timeline: which job each worker held over the last seconds, and
where a job was preempted — the bench's occupancy timeline (``app.occupancy``), read from the
job event streams of the jobs that ran in the window."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from app.api.stats import WINDOW_SLACK_S, Viewer, ended_since, readable_records
from app.occupancy import Interval, merge, running_intervals
from scheduler.lifecycle import JobState
from tasks.heartbeat import Heartbeat
from tasks.read_model import ReadModel
from tasks.record import JobRecord
from tasks.routing import CONTROL

EVENTS_PER_JOB = 2_000
"""Newest events read per job: a window of a few minutes never holds more for one job."""
JOBS_MAX = 500
"""Most jobs one timeline reads (the newest ended ones and the active ones that ran)."""


class TimelineSpan(BaseModel):
    """A stretch of time a worker held a job (claim to release, or a chunk's compute)."""

    worker: str
    job: str | None = Field(description="The job id; null for another tenant's job.")
    slo: str
    start: float = Field(description="Unix seconds, clipped to the window.")
    end: float = Field(description="Unix seconds, clipped to the window.")
    running: bool = Field(description="The worker still holds the job at the window's end.")


class TimelinePreemption(BaseModel):
    """A job that yielded its worker at a chunk boundary (the ▼ of the bench's timeline)."""

    worker: str
    job: str | None = Field(description="The job id; null for another tenant's job.")
    slo: str
    at: float
    reason: str


class Timeline(BaseModel):
    """Worker occupancy over ``[since, until]``."""

    since: float
    until: float
    workers: list[str] = Field(description="One lane per worker: the live ones, then any other "
                                           "that held a job in the window.")
    spans: list[TimelineSpan]
    preemptions: list[TimelinePreemption]


@dataclass(frozen=True, slots=True)
class JobHistory:
    """One job's record and its events (oldest first) as read for the window."""

    record: JobRecord
    events: Sequence[Mapping[str, str]]


def held_intervals(job: JobHistory, until_s: float) -> dict[str, list[Interval]]:
    """Per worker, when it held the job (merged). A job RUNNING now whose claim is older than
    the events read still shows, from its record, since its chunk began."""
    held: dict[str, list[Interval]] = defaultdict(list)
    for worker, interval in running_intervals(job.events, until_s):
        held[worker].append(interval)
    r = job.record
    if r.state is JobState.RUNNING and r.running_on and r.chunk_running_since_s is not None:
        held[r.running_on].append((r.chunk_running_since_s, max(until_s, r.chunk_running_since_s)))
    return {worker: merge(intervals) for worker, intervals in held.items()}


def build_timeline(jobs: Iterable[JobHistory], live_workers: Sequence[str], viewer: Viewer,
                   since_s: float, until_s: float) -> Timeline:
    """The timeline of ``jobs`` clipped to ``[since_s, until_s]``, as ``viewer`` may see it."""
    spans, preemptions = [], []
    for job in jobs:
        r = job.record
        shown = r.job_id if viewer.sees(r.tenant) else None
        running_on = r.running_on if r.state is JobState.RUNNING else None
        for worker, intervals in held_intervals(job, until_s).items():
            for start, end in intervals:
                if end > since_s and start < until_s:
                    spans.append(TimelineSpan(
                        worker=worker, job=shown, slo=r.slo.value, start=max(start, since_s),
                        end=min(end, until_s), running=end >= until_s and worker == running_on))
        for e in job.events:
            if (e.get("kind"), e.get("from"), e.get("to")) == ("state", JobState.RUNNING.value,
                                                               JobState.PREEMPTED.value):
                at = float(e["ts"])
                if since_s <= at <= until_s:
                    preemptions.append(TimelinePreemption(worker=e.get("by", "?"), job=shown,
                                                          slo=r.slo.value, at=at,
                                                          reason=e.get("reason", "")))
    spans.sort(key=lambda s: (s.worker, s.start))
    preemptions.sort(key=lambda p: p.at)
    seen = dict.fromkeys(live_workers)
    seen.update(dict.fromkeys(sorted({s.worker for s in spans} | {p.worker for p in preemptions})))
    return Timeline(since=since_s, until=until_s, workers=list(seen), spans=spans,
                    preemptions=preemptions)


def chunk_workers(heartbeats: Mapping[str, Heartbeat]) -> list[str]:
    """Live workers that run chunks (a scheduler worker, on ``control``, runs ticks)."""
    return sorted(name for name, beat in heartbeats.items() if CONTROL not in beat.queues)


def read_timeline(reads: ReadModel, viewer: Viewer, since_s: float,
                  until_s: float) -> Timeline:
    """Worker occupancy over ``[since_s, until_s]``: the jobs that ended in it and the active
    jobs that have run, with their events since shortly before ``since_s``."""
    ended, _ = ended_since(reads, since_s, JOBS_MAX)
    records = {r.job_id: r for r in [*_active_that_ran(reads, since_s), *ended][:JOBS_MAX]}
    start_ms = max(int((since_s - WINDOW_SLACK_S) * 1000), 0)
    streams = reads.events_since(list(records), start_ms, EVENTS_PER_JOB)
    jobs = [JobHistory(record, events)
            for record, events in zip(records.values(), streams, strict=True)]
    return build_timeline(jobs, chunk_workers(reads.heartbeats()), viewer, since_s, until_s)


def _active_that_ran(reads: ReadModel, since_s: float) -> list[JobRecord]:
    """Jobs that held a worker at some point since ``since_s`` (RUNNING now, or left RUNNING
    since: a job between two chunks), from the zset the state changes keep: O(jobs that ran in
    the window, at most ``JOBS_MAX``), not a read of every unfinished record."""
    ids = reads.ran_since(since_s - WINDOW_SLACK_S)
    return readable_records(reads, ids[-JOBS_MAX:], "the dashboard timeline")
