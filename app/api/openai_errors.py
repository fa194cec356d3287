"""OpenAI's error shape on the OpenAI-compatible routes: ``{"error": {"message", "type",
"param", "code"}}`` for every failure they can meet, with the statuses the OpenAI SDK maps to
its exceptions (the rest of the API keeps ``{"detail"}``)."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from app.api.errors import TooManyRequests
from app.schemas import OpenAIErrorBody, OpenAIErrorDetail
from scheduler.lifecycle import JobState
from tasks.errors import InvalidJob, JobNotFound, Overloaded
from tasks.inputs import InputTooLarge
from tasks.read_model import STORE_UNAVAILABLE
from tasks.record import JobRecord

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"
NO_RETRY = {"x-should-retry": "false"}
"""Tells the OpenAI SDK not to retry (it retries 409 and 5xx by default): a job that ended so
would end so again, and a retry would submit it again."""


class OpenAIError(Exception):
    """Raised by an OpenAI-compatible route to answer with OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, kind: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        detail = OpenAIErrorDetail(message=self.message, type=self.kind, param=self.param,
                                   code=self.code)
        return OpenAIErrorBody(error=detail).model_dump(mode="json")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def as_openai_error(exc: Exception, redis_retry_after_s: int) -> OpenAIError:
    """The OpenAI-shaped answer to ``exc`` (logging an unexpected one with an incident id)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _invalid_request(exc)
    if isinstance(exc, HTTPException):
        if exc.status_code == 401:
            return OpenAIError(401, str(exc.detail), code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        return OpenAIError(exc.status_code, str(exc.detail))
    if isinstance(exc, InputTooLarge):
        return OpenAIError(413, str(exc), code="input_too_large")
    if isinstance(exc, InvalidJob):
        return OpenAIError(400, str(exc), code="invalid_value")
    if isinstance(exc, JobNotFound):
        return OpenAIError(404, str(exc), code="not_found")
    if isinstance(exc, TooManyRequests):
        return OpenAIError(429, exc.detail, kind="rate_limit_error", code="rate_limit_exceeded",
                           headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, Overloaded):
        return OpenAIError(429, f"shed under overload: {exc}; retry later",
                           kind="rate_limit_error", code="overloaded",
                           headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, STORE_UNAVAILABLE):
        log.warning("redis unavailable: %s", exc)
        return OpenAIError(503, "the job store (Redis) is unavailable; retry shortly",
                           kind="server_error", code="store_unavailable",
                           headers=_retry_after(redis_retry_after_s))
    incident = uuid.uuid4().hex[:8]
    log.error("incident %s on an OpenAI-compatible route", incident, exc_info=exc)
    return OpenAIError(500, f"internal error (incident {incident}); the server log has the "
                       "details", kind="server_error", code="internal_error")


def _invalid_request(exc: RequestValidationError) -> OpenAIError:
    parts, params = [], []
    for error in exc.errors():
        loc = () if error.get("type") == "json_invalid" else error.get("loc", ())
        where = ".".join(str(p) for p in loc if p not in ("body", "header"))
        params.append(where or None)
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return OpenAIError(400, "invalid request: " + "; ".join(parts),
                       param=params[0] if params else None, code="invalid_value")


def job_ended_error(record: JobRecord) -> OpenAIError:
    """The answer for a job that ended without a result (failed, cancelled or shed)."""
    job_id = record.job_id
    headers = {**NO_RETRY, "X-Stepline-Job-Id": job_id}
    if record.state is JobState.CANCELLED:
        return OpenAIError(409, f"job {job_id} was cancelled", code="job_cancelled",
                           headers=headers)
    if record.state is JobState.EXPIRED:
        return OpenAIError(504, f"job {job_id} was shed: it could not meet its deadline "
                           f"(shed_if_late); {record.error or ''}".rstrip("; "),
                           kind="server_error", code="deadline_exceeded", headers=headers)
    return OpenAIError(500, f"job {job_id} failed: {record.error or 'no reason recorded'}",
                       kind="server_error", code="job_failed", headers=headers)


class OpenAIRoute(APIRoute):
    """A route whose every failure, from key check to handler, answers in OpenAI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer_openai_style(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                retry_s = request.app.state.ctx.settings.api.redis_retry_after
                return as_openai_error(exc, retry_s).response()

        return answer_openai_style
