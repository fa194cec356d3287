"""/v1/stats, /metrics and /healthz: what the system is doing, for people and for Prometheus."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from app.api.context import ApiContext, api_context, current_tenant
from app.api.jobs import COMMON_RESPONSES
from app.api.metrics import StoreCollector
from app.api.stats import class_stats, queue_depths, read_load, read_workers, recent_jobs
from app.schemas import ErrorBody, StatsView
from app.tenants import Tenant
from tasks.errors import JobNotFound
from tasks.record import UnreadableRecord

router = APIRouter(tags=["observe"])
Ctx = Annotated[ApiContext, Depends(api_context)]


@router.get("/v1/stats", response_model=StatsView, responses=COMMON_RESPONSES,
            summary="SLO attainment, queues, origin, load, workers and cache hit rates")
def stats(ctx: Ctx, tenant: Annotated[Tenant, Depends(current_tenant)]) -> StatsView:
    window = ctx.settings.api.stats_window_jobs
    jobs = recent_jobs(ctx.store, window)
    origin = ctx.store.origin_id()
    workers, counters = read_workers(ctx.store)
    return StatsView(
        classes=class_stats(jobs), queues=queue_depths(ctx.store),
        origin=_own(ctx, tenant, origin), origin_active=origin is not None,
        load=read_load(ctx.store), workers=workers, cache_hit_rates=counters.rates(),
        window_jobs=len(jobs),
    )


def _own(ctx: ApiContext, tenant: Tenant, job_id: str | None) -> str | None:
    """``job_id`` if it is the caller's job: another tenant's origin is only "active"."""
    if job_id is None:
        return None
    try:
        ctx.owned_record(tenant, job_id)
    except (JobNotFound, UnreadableRecord):
        return None
    return job_id


def registry_for(ctx: ApiContext) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(ctx.store, ctx.settings))
    return registry


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}},
                       503: {"model": ErrorBody, "description": "Redis is unavailable."}},
            summary="Prometheus metrics (no key needed)")
def metrics(request: Request) -> PlainTextResponse:
    registry: CollectorRegistry = request.app.state.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", responses={503: {"model": ErrorBody, "description": "Redis is down."}},
            summary="Liveness: the API answers and Redis does")
def healthz(ctx: Ctx) -> dict[str, str]:
    ctx.store.redis.ping()
    return {"status": "ok", "redis": "ok"}
