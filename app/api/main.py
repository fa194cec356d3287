"""The FastAPI app: ``python -m uvicorn --factory app.api.main:create_app`` (``stepline up``
runs exactly that), or ``app.api.main:app`` for the process-wide settings."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from app.api import adapters, dashboard, inputs, jobs, observe, openai
from app.api.context import ApiContext
from app.api.errors import install_error_handlers
from app.celery import configure as configure_celery
from tasks.read_model import STORE_UNAVAILABLE
from tasks.runtime import current_settings
from tasks.settings import Settings
from tasks.submit import prepare_submits
from workers.kinds import get_runner
from workers.registry import default_registry
from workers.warm import warm_jobs

log = logging.getLogger(__name__)

DESCRIPTION = """Submit diffusion, MoE and simulated jobs, follow them, fetch their results.

Every /v1 route needs an API key (`Authorization: Bearer <key>` or `X-API-Key: <key>`); a tenant
sees only its own jobs. Errors are `{"detail": "..."}`; 429 and 503 carry Retry-After."""


def create_app(settings: Settings | None = None) -> FastAPI:
    """A new app over ``settings`` (default: the process-wide settings)."""
    if settings is None:
        settings = current_settings()
    configure_celery(settings)  # admitting a job publishes its first chunk
    api = FastAPI(title="Stepline", version="0.1.0", description=DESCRIPTION,
                  lifespan=_prepared)
    api.state.ctx = ApiContext.from_settings(settings)
    api.state.registry = observe.registry_for(api.state.ctx)
    install_error_handlers(api, settings.api.redis_retry_after)
    api.include_router(jobs.router)
    api.include_router(inputs.router)
    api.include_router(observe.router)
    api.include_router(openai.router)
    api.include_router(adapters.router)
    api.include_router(dashboard.router)
    api.state.warm = threading.Event()  # set by the startup once every recipe is planned
    api.state.warm_start = settings.warm_start
    if not settings.warm_start:
        api.state.warm.set()
    return api


@asynccontextmanager
async def _prepared(api: FastAPI) -> AsyncIterator[None]:
    """The app's startup: uvicorn binds its socket only after it, so no request (``/healthz``
    included) waits for these imports, and warming never competes with serving for the GIL. An
    embedded server without lifespan imports on first use."""
    await run_in_threadpool(_rebuild_live_counts, api.state.ctx)
    await run_in_threadpool(import_job_kinds)
    if api.state.warm_start:
        await run_in_threadpool(_warm_submits, api.state.warm)
    yield


def _rebuild_live_counts(ctx: ApiContext) -> None:
    """Count the unfinished jobs once (``tasks.live_counts``): a store written before the
    counters existed then reads right; the scripts keep them from there on."""
    try:
        ctx.limits.live.rebuild()
    except STORE_UNAVAILABLE:
        log.warning("the live counters were not rebuilt: Redis is unavailable")


def import_job_kinds() -> None:
    """Import and build, before the app serves, what validating a job of each model kind loads
    (torch, transformers, diffusers: seconds). Imported by a request instead, even on the thread
    pool, they would hold the GIL for long stretches and stall the event loop, ``/healthz``
    included."""
    for kind in ("text", "image", "video"):
        get_runner(kind)
    registry = default_registry()
    if any(registry.get(name).spec.get("weights") for name in registry.names()
           if registry.get(name).kind == "text"):
        from transformers import PreTrainedTokenizerFast  # noqa: F401  # a chat template's tokenizer


def _warm_submits(done: threading.Event) -> None:
    """Validate and plan one job of every recipe, so the first request of each kind pays no
    import or recipe build (GET /readyz waits for it)."""
    started_s = time.perf_counter()
    try:
        prepare_submits((job.kind, job.params) for job in warm_jobs())
    except Exception:
        log.warning("warming the submit path failed; first submits load what they need",
                    exc_info=True)
    done.set()
    log.info("API warm (every recipe validated and planned) in %.2fs",
             time.perf_counter() - started_s)


def __getattr__(name: str) -> Any:
    if name == "app":  # built on first use, so importing this module builds none
        return create_app()
    raise AttributeError(name)
