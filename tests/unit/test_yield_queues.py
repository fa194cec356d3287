"""Which queues a running chunk yields to (``tasks.protocol.queues_ahead``): exactly those its
worker takes before the job's next chunk — more urgent classes, with their affinity queues."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.queues import RESERVE_WORKER_QUEUES
from tasks.protocol import queues_ahead
from tasks.routing import (
    AFFINITY_CLASSES,
    WORK_QUEUES,
    affinity_queue,
    class_queue_of,
    with_affinity,
)

WORKERS = st.sampled_from(["w1@host", "w2@host", "gpu-0@node.example"])


@given(worker=WORKERS, job_class=st.sampled_from(WORK_QUEUES), own=st.booleans())
def test_a_chunk_yields_only_to_more_urgent_classes(worker: str, job_class: str,
                                                    own: bool) -> None:
    consuming = with_affinity(worker, WORK_QUEUES)
    job_queue = affinity_queue(worker, job_class) if own and job_class in AFFINITY_CLASSES \
        else job_class
    ahead = queues_ahead(consuming, job_queue)
    urgent = WORK_QUEUES[:WORK_QUEUES.index(job_class)]
    assert {class_queue_of(q) for q in ahead} == set(urgent)
    assert ahead == tuple(q for q in consuming if class_queue_of(q) in urgent)


def test_a_realtime_chunk_yields_to_nothing() -> None:
    assert queues_ahead(with_affinity("w1", WORK_QUEUES), "realtime") == ()


def test_a_chunk_of_a_class_its_worker_does_not_consume_is_left_to_the_tick() -> None:
    assert queues_ahead(RESERVE_WORKER_QUEUES, "batch") == ()
    assert queues_ahead(("realtime", "interactive"), "standby") == ()
