"""/v1/stats, /metrics and /healthz: what the system is doing, for people and for Prometheus."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from app.api.context import ApiContext, api_context, current_tenant
from app.api.jobs import COMMON_RESPONSES
from app.api.metrics import StoreCollector
from app.api.stats import LiveStatsView, Viewer, live_stats
from app.schemas import ErrorBody, Readiness, WorkerWarmth
from app.tenants import Tenant
from tasks.routing import WORK_QUEUES

router = APIRouter(tags=["observe"])
Ctx = Annotated[ApiContext, Depends(api_context)]


@router.get("/v1/stats", response_model=LiveStatsView, responses=COMMON_RESPONSES,
            summary="SLO attainment (recent and over a sliding window), queues and their oldest "
                    "waits, origin, load, workers and cache hit rates")
def stats(ctx: Ctx, tenant: Annotated[Tenant, Depends(current_tenant)]) -> LiveStatsView:
    """Another tenant's job ids (the origin, a worker's busy job) read as null."""
    return live_stats(ctx.reads, ctx.settings, Viewer(tenant.name), time.time())


def registry_for(ctx: ApiContext) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(ctx.reads, ctx.settings))
    return registry


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}},
                       503: {"model": ErrorBody, "description": "Redis is unavailable."}},
            summary="Prometheus metrics (no key needed)")
def metrics(request: Request) -> PlainTextResponse:
    registry: CollectorRegistry = request.app.state.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "No chunk worker is alive, or "
                                                                "one is still warming up."}},
            summary="Readiness: every chunk worker alive is warm (no key needed)")
def readyz(ctx: Ctx, request: Request) -> JSONResponse:
    """Ready (200) once this API process has validated and planned a job of every recipe and
    at least one chunk worker is alive and every one has run its warm-up (``warm_start``), so
    no first job pays for an import or a model build; else 503 saying which."""
    api_warm = request.app.state.warm.is_set()
    workers = {name: WorkerWarmth(warm=beat.warm, warmed=list(beat.warmed))
               for name, beat in ctx.reads.heartbeats().items()
               if set(beat.queues) & set(WORK_QUEUES)}
    status: Literal["ready", "warming", "no_workers"] = "no_workers"
    if workers:
        ready = api_warm and all(w.warm for w in workers.values())
        status = "ready" if ready else "warming"
    body = Readiness(status=status, api_warm=api_warm, workers=workers)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if status == "ready" else 503)


@router.get("/healthz", responses={503: {"model": ErrorBody, "description": "Redis is down."}},
            summary="Liveness: the API answers and Redis does")
def healthz(ctx: Ctx) -> dict[str, str]:
    ctx.reads.ping()
    return {"status": "ok", "redis": "ok"}
