"""Exception handlers: every failure becomes a JSON ``{"detail": "..."}`` with a fitting status,
never a stack trace. A Redis outage is a 503 with Retry-After; a job shed by admission under
overload (its message naming the effective and compute loads) and a tenant over its own limits
get a 429 with Retry-After."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tasks.artifacts import UnsafeArtifactPath
from tasks.errors import InvalidJob, JobNotFound, Overloaded
from tasks.inputs import InputTooLarge
from tasks.read_model import STORE_UNAVAILABLE

log = logging.getLogger(__name__)


class TooManyRequests(Exception):
    """Raised when a tenant is over its rate limit or queue quota (answered 429)."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after_s = retry_after_s


class ResultNotReady(Exception):
    """Raised when a job's result is asked for before the job is DONE (answered 409)."""


class JobUnfinished(Exception):
    """Raised when a waiting request gives up on its job (answered with ``status``)."""

    def __init__(self, detail: str, job_id: str, status: int) -> None:
        super().__init__(detail)
        self.detail, self.job_id, self.status = detail, job_id, status


def _body(detail: str, status: int, headers: dict[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": detail, **extra}, status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Map Stepline's and Redis's exceptions to HTTP answers on ``app``."""

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _body(_describe_validation(exc), 422)

    @app.exception_handler(InvalidJob)
    async def _invalid_job(_: Request, exc: InvalidJob) -> JSONResponse:
        return _body(str(exc), 422)

    @app.exception_handler(InputTooLarge)
    async def _too_large(_: Request, exc: InputTooLarge) -> JSONResponse:
        return _body(str(exc), 413)

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound) -> JSONResponse:
        return _body(str(exc), 404)

    @app.exception_handler(UnsafeArtifactPath)
    async def _unsafe(_: Request, exc: UnsafeArtifactPath) -> JSONResponse:
        return _body(str(exc), 404)

    @app.exception_handler(ResultNotReady)
    async def _not_ready(_: Request, exc: ResultNotReady) -> JSONResponse:
        return _body(str(exc), 409)

    @app.exception_handler(JobUnfinished)
    async def _unfinished(_: Request, exc: JobUnfinished) -> JSONResponse:
        return _body(exc.detail, exc.status, job_id=exc.job_id)

    @app.exception_handler(TooManyRequests)
    async def _too_many(_: Request, exc: TooManyRequests) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _body(exc.detail, 429, {"Retry-After": retry})

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _body(f"shed under overload: {exc}; retry later", 429, {"Retry-After": retry})

    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", exc)
        return _body("the job store (Redis) is unavailable; retry shortly", 503,
                     {"Retry-After": str(retry_after_s)})

    for kind in STORE_UNAVAILABLE:
        app.add_exception_handler(kind, _redis_down)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        incident = uuid.uuid4().hex[:8]
        log.error("incident %s on %s %s", incident, request.method, request.url.path,
                  exc_info=exc)
        return _body(f"internal error (incident {incident}); the server log has the details", 500)
