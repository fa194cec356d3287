"""Errors raised by the application layer (settings, store, stack, API)."""


class SteplineError(Exception):
    """Raised for any Stepline failure a user can act on; the base of this package's errors."""


class SettingsError(SteplineError):
    """Raised when settings are invalid; the message names the key, the value and the bound."""


class JobNotFound(SteplineError):
    """Raised when a job id is unknown (or belongs to another tenant)."""


class InvalidJob(SteplineError):
    """Raised when a job spec is rejected at submit; the message says what to use instead."""


class Overloaded(SteplineError):
    """Raised when admission sheds a new job under overload; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StackNotRunning(SteplineError):
    """Raised when a command needs a running stack and finds none at the run directory."""


class RedisUnavailable(SteplineError):
    """Raised when Redis cannot be reached; the operation may be retried."""


class HeartbeatError(SteplineError, ValueError):
    """Raised when a worker's heartbeat cannot be read; the message names the worker and entry."""


class AdmissionStatusError(SteplineError, ValueError):
    """Raised when the published admission status cannot be read; the message names the entry."""
