"""The lifecycle table: every legal move passes, every other raises."""

from __future__ import annotations

import pytest

from scheduler.errors import IllegalTransition
from scheduler.lifecycle import TERMINAL_STATES, TRANSITIONS, JobState, check_transition


def test_every_state_has_a_row_in_the_table() -> None:
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES, key=lambda s: s.value))
def test_terminal_states_lead_nowhere(state: JobState) -> None:
    for target in JobState:
        with pytest.raises(IllegalTransition):
            check_transition("j", state, target)


def test_a_running_job_can_finish_yield_or_hop_but_not_go_back_to_pending() -> None:
    for target in (JobState.DONE, JobState.PREEMPTED, JobState.QUEUED, JobState.FAILED):
        check_transition("j", JobState.RUNNING, target)
    with pytest.raises(IllegalTransition, match="RUNNING -> PENDING"):
        check_transition("j", JobState.RUNNING, JobState.PENDING)


def test_a_suspended_job_must_be_queued_again_before_it_runs() -> None:
    with pytest.raises(IllegalTransition):
        check_transition("j", JobState.SUSPENDED, JobState.RUNNING)
    check_transition("j", JobState.SUSPENDED, JobState.QUEUED)


def test_every_live_state_can_be_cancelled() -> None:
    for state in set(JobState) - TERMINAL_STATES:
        check_transition("j", state, JobState.CANCELLED)
