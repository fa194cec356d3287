"""The dashboard's worker timeline, built from job event streams as the store writes them."""

from __future__ import annotations

from typing import Any

import pytest

from app.api.stats import OPERATOR, Viewer
from app.api.timeline import JobHistory, build_timeline
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind
from tasks.record import JobRecord

pytestmark = pytest.mark.timeout(30)


def record(job_id: str, slo: SloClass, state: JobState, **fields: Any) -> JobRecord:
    base: dict[str, Any] = dict(
        job_id=job_id, kind=JobKind.SIMULATED, slo=slo, tenant="alice", params={},
        submitted_at_s=0.0, deadline_at_s=60.0, num_chunks=4, cost_key="simulated",
        cost_units=(1.0,) * 4, state=state, next_chunk=0, seq=0, epoch=0, queue=slo.value,
        updated_at_s=0.0)
    return JobRecord(**{**base, **fields})


def state(ts: float, from_: str, to: str, by: str, reason: str = "") -> dict[str, str]:
    return {"kind": "state", "from": from_, "to": to, "by": by, "reason": reason, "ts": str(ts)}


def commit(ts: float, service_s: float, by: str) -> dict[str, str]:
    return {"kind": "commit", "by": by, "service_s": str(service_s), "ts": str(ts)}


def preempted_batch_job() -> JobHistory:
    """A batch job on w1 from 10 s, preempted at 12 s, resumed on w2 from 14 s to 15 s."""
    events = [state(9, "", "PENDING", "submit"), state(9.5, "PENDING", "QUEUED", "submit"),
              state(10, "QUEUED", "RUNNING", "w1"), commit(11, 1.0, "w1"),
              state(11, "RUNNING", "QUEUED", "w1"), state(11.01, "QUEUED", "RUNNING", "w1"),
              commit(12, 1.0, "w1"), state(12, "RUNNING", "PREEMPTED", "w1", "preempt flag"),
              state(13, "PREEMPTED", "QUEUED", "scheduler"), state(14, "QUEUED", "RUNNING", "w2"),
              commit(15, 1.0, "w2"), state(15, "RUNNING", "DONE", "w2", "all chunks ran")]
    return JobHistory(record("batchjob", SloClass.BATCH, JobState.DONE, finished_at_s=15.0),
                      events)


def test_each_worker_shows_the_job_it_held_and_the_preemption_is_marked() -> None:
    # when the timeline of a preempted and resumed job is built over [0, 20]
    timeline = build_timeline([preempted_batch_job()], ["w1", "w2", "w3"], OPERATOR, 0.0, 20.0)

    # then w1 held it from 10 s to 12 s (claims and commits merged), w2 from 14 s to 15 s
    spans = [(s.worker, s.job, s.slo, s.start, s.end, s.running) for s in timeline.spans]
    assert spans == [("w1", "batchjob", "batch", 10.0, 12.0, False),
                     ("w2", "batchjob", "batch", 14.0, 15.0, False)]
    # and the preemption is marked on w1 at 12 s, with the reason
    assert [(p.worker, p.job, p.at, p.reason) for p in timeline.preemptions] == [
        ("w1", "batchjob", 12.0, "preempt flag")]
    # and an idle live worker keeps its lane
    assert timeline.workers == ["w1", "w2", "w3"]


def test_spans_are_clipped_to_the_window_and_a_worker_no_longer_alive_keeps_a_lane() -> None:
    timeline = build_timeline([preempted_batch_job()], ["w2"], OPERATOR, 11.5, 14.5)
    assert [(s.worker, s.start, s.end) for s in timeline.spans] == [("w1", 11.5, 12.0),
                                                                      ("w2", 14.0, 14.5)]
    assert timeline.workers == ["w2", "w1"]


def test_a_running_job_whose_claim_predates_the_events_read_still_shows_as_running() -> None:
    # given a job RUNNING on w1 since 30 s, with no event of that claim in what was read
    job = JobHistory(record("long", SloClass.INTERACTIVE, JobState.RUNNING, running_on="w1",
                            chunk_started_at_s=30.0, updated_at_s=30.0), [])

    # then it holds w1 to the window's end, and is marked running
    timeline = build_timeline([job], ["w1"], OPERATOR, 40.0, 100.0)
    assert [(s.worker, s.start, s.end, s.running) for s in timeline.spans] == [
        ("w1", 40.0, 100.0, True)]


def test_another_tenants_job_shows_its_class_but_not_its_id() -> None:
    timeline = build_timeline([preempted_batch_job()], [], Viewer("bob"), 0.0, 20.0)
    assert {(s.job, s.slo) for s in timeline.spans} == {(None, "batch")}
    assert [p.job for p in timeline.preemptions] == [None]
    own = build_timeline([preempted_batch_job()], [], Viewer("alice"), 0.0, 20.0)
    assert {s.job for s in own.spans} == {"batchjob"}
