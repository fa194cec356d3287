"""The block every drill drives a fault in: what it records when the fault went as planned, and
when the drill itself failed to drive it."""

from __future__ import annotations

import redis

from app.drills.harness import Fault, recorded, wait_until


def test_a_driven_fault_is_recorded_as_the_block_left_it() -> None:
    faults: list[Fault] = []
    with recorded("link_down_up", faults) as fault:
        fault.injected, fault.survived, fault.detail = True, True, "moved on"
    assert faults == [fault]
    assert (fault.kind, fault.injected, fault.survived, fault.detail) == (
        "link_down_up", True, True, "moved on")
    assert fault.started_at > 0


def test_a_fault_the_drill_could_not_drive_is_reported_not_survived_not_raised() -> None:
    faults: list[Fault] = []
    with recorded("worker_sigstop", faults) as fault:
        fault.detail = "stopped the worker"
        raise RuntimeError("no such process")
    assert faults == [fault]
    assert fault.survived is False
    assert fault.detail == "stopped the worker (drill error: RuntimeError('no such process'))"


def test_a_wait_counts_an_unreachable_service_as_not_yet() -> None:
    answers = iter([redis.ConnectionError("down"), None, "up"])

    def probe() -> str | None:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(probe, timeout_s=60, period_s=0) == "up"
