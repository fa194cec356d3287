"""Errors raised by the scheduling policy."""


class SchedulerError(Exception):
    """Raised when the policy is given something it cannot plan with; the base of this package."""


class IllegalTransition(SchedulerError):
    """Raised when a job is asked to move between two states the lifecycle table does not link."""

    def __init__(self, job_id: str, current: str, target: str) -> None:
        super().__init__(f"job {job_id}: illegal transition {current} -> {target}")
        self.job_id = job_id
        self.current = current
        self.target = target


class InvalidPolicy(SchedulerError):
    """Raised when a PolicyConfig holds a value outside its bounds; the message names the field."""


class InvalidSnapshot(SchedulerError):
    """Raised when a job or worker view is inconsistent (e.g. more chunks done than it has)."""


class StateDecodeError(SchedulerError):
    """Raised when persisted scheduler state (policy state, cost model) is not the JSON we wrote."""


class PlanInvariantViolated(SchedulerError):
    """Raised when a TickPlan breaks a rule the adapter relies on; the message names the rule."""
