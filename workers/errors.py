"""Errors raised by the device-side code."""


class WorkerError(Exception):
    """Raised when device-side work cannot proceed; the base of every error in ``workers``."""


class CheckpointError(WorkerError):
    """Raised when bytes cannot be decoded as a checkpoint, or state cannot be encoded."""


class ModelConfigError(WorkerError):
    """Raised when a model recipe in ``configs/models`` is missing or invalid."""


class ParamsError(WorkerError):
    """Raised when job parameters do not fit the model; the message says what to use instead."""


class ExpertCacheError(WorkerError):
    """Raised when the expert cache's budget cannot hold what a forward pass needs."""


class ExpertVersionError(WorkerError):
    """Raised when an expert version cannot be loaded or used (missing, unreadable, wrong shape)."""


class NonFiniteOutput(WorkerError):
    """Raised when a model produces NaN or infinite logits (broken weights, e.g. a bad version)."""
