"""Idle capacity while work waited, on hand-made timelines: a worker idle while a job waits
counts, idle with nothing waiting does not, overlapping intervals count once."""

from __future__ import annotations

import pytest

from app.occupancy import (
    JobSpan,
    idle_while_waiting,
    merge,
    running_intervals,
    subtract,
)

pytestmark = pytest.mark.timeout(10)


def job(runnable_at_s: float, finished_at_s: float | None,
        *running: tuple[str, float, float]) -> JobSpan:
    return JobSpan(runnable_at_s, finished_at_s, tuple((w, (a, b)) for w, a, b in running))


def test_a_worker_idle_while_a_job_waits_counts() -> None:
    # given two workers; w1 runs A for 10 s, B arrives at 2 s and waits for w1; w2 never works
    jobs = [job(0, 10, ("w1", 0, 10)), job(2, 12, ("w1", 10, 12))]
    # when
    idle = idle_while_waiting(jobs, workers=2, window=(0, 12))
    # then w2 idled the 8 s B waited, and that is a third of the 24 worker-seconds
    assert idle.idle_worker_s == pytest.approx(8)
    assert idle.servable_worker_s == pytest.approx(8)
    assert idle.share == pytest.approx(8 / 24)


def test_idle_with_nothing_waiting_does_not_count() -> None:
    # given two workers, one job that runs at once, then an empty stretch
    jobs = [job(0, 5, ("w1", 0, 5))]
    # when
    idle = idle_while_waiting(jobs, workers=2, window=(0, 20))
    # then w2 idled all along and both idled after 5 s, but nothing ever waited
    assert idle.idle_worker_s == 0
    assert idle.capacity_worker_s == pytest.approx(40)


def test_overlapping_intervals_of_one_worker_count_as_one_busy_worker() -> None:
    # given w1 holding two jobs over overlapping stretches while C waits for 10 s
    jobs = [job(0, 6, ("w1", 0, 6)), job(0, 10, ("w1", 4, 10)), job(0, 12, ("w1", 10, 12))]
    # when
    idle = idle_while_waiting(jobs, workers=2, window=(0, 12))
    # then w1 is one busy worker, not two: w2 idled the 10 s C waited (minus nothing)
    assert idle.idle_worker_s == pytest.approx(10)


def test_a_job_held_by_two_workers_at_once_does_not_wait() -> None:
    # given a duplicate delivery: w1 and w2 both hold J over overlapping stretches
    jobs = [job(0, 6, ("w1", 0, 4), ("w2", 2, 6))]
    # then J never waited, so nothing counts
    assert idle_while_waiting(jobs, workers=2, window=(0, 6)).idle_worker_s == 0


def test_the_hop_between_two_chunks_counts_as_waiting() -> None:
    # given one worker running a chunked job with a 0.5 s dispatch gap between its chunks
    jobs = [job(0, 2.5, ("w1", 0, 1), ("w1", 1.5, 2.5))]
    # then the gap is idle capacity while the job waited
    assert idle_while_waiting(jobs, workers=1, window=(0, 2.5)).idle_worker_s == pytest.approx(
        0.5)


def test_servable_idle_counts_at_most_one_worker_per_waiting_job() -> None:
    # given three idle workers and a single job that waits 2 s before running
    jobs = [job(0, 3, ("w1", 2, 3))]
    # when
    idle = idle_while_waiting(jobs, workers=3, window=(0, 3))
    # then all three idled while it waited, but only one could have served it
    assert (idle.idle_worker_s, idle.servable_worker_s) == pytest.approx((6, 2))


def test_an_unfinished_job_waits_until_the_window_ends() -> None:
    jobs = [job(1, None)]
    assert idle_while_waiting(jobs, workers=1, window=(0, 4)).idle_worker_s == pytest.approx(3)


def test_running_intervals_span_each_claim_and_each_commit() -> None:
    # given a two-chunk job: claimed by w1, committed, hopped; claimed by w2, committed, done
    events = [
        {"kind": "state", "from": "PENDING", "to": "QUEUED", "by": "scheduler", "ts": "9.0"},
        {"kind": "state", "from": "QUEUED", "to": "RUNNING", "by": "w1", "ts": "10.0"},
        {"kind": "commit", "by": "w1", "service_s": "0.8", "ts": "11.0"},
        {"kind": "state", "from": "RUNNING", "to": "QUEUED", "by": "w1", "ts": "11.0"},
        {"kind": "state", "from": "QUEUED", "to": "RUNNING", "by": "w2", "ts": "11.3"},
        {"kind": "commit", "by": "w2", "service_s": "0.5", "ts": "12.0"},
        {"kind": "state", "from": "RUNNING", "to": "DONE", "by": "w2", "ts": "12.0"},
    ]
    # when
    held = running_intervals(events, until_s=20)
    # then each worker held it from its claim to the job leaving RUNNING (its commit's compute
    # interval lies inside that)
    assert len(held) == 4
    assert merge(i for w, i in held if w == "w1") == [(10.0, 11.0)]
    assert merge(i for w, i in held if w == "w2") == [(11.3, 12.0)]


def test_a_claim_still_open_lasts_until_observation_ends() -> None:
    events = [{"kind": "state", "from": "QUEUED", "to": "RUNNING", "by": "w1", "ts": "3"}]
    assert running_intervals(events, until_s=7) == [("w1", (3.0, 7.0))]


def test_interval_union_and_difference() -> None:
    assert merge([(4, 6), (0, 2), (1, 3), (5, 5)]) == [(0, 3), (4, 6)]
    assert subtract((0, 10), [(2, 3), (8, 12), (-1, 1)]) == [(1, 2), (3, 8)]
    assert subtract((0, 10), [(-1, 11)]) == []
