"""What every request handler needs, built once per app: store, service, artifacts, tenants."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from app.artifacts import ArtifactStore
from app.errors import JobNotFound
from app.jobs import JobService
from app.runtime import connect, redis_url
from app.settings import Settings
from app.store import JobStore
from app.tenants import Tenant, TenantDirectory, TenantLimits


@dataclass
class ApiContext:
    """The API's long-lived collaborators (one Redis connection pool per process)."""

    settings: Settings
    store: JobStore
    service: JobService
    artifacts: ArtifactStore
    tenants: TenantDirectory
    limits: TenantLimits

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiContext:
        store = JobStore(connect(redis_url(settings)))
        return cls(
            settings=settings, store=store, service=JobService(store, settings),
            artifacts=ArtifactStore(settings.artifacts_path),
            tenants=TenantDirectory.from_settings(settings), limits=TenantLimits(store.redis),
        )

    def owned_fields(self, tenant: Tenant, job_id: str) -> dict[str, str]:
        """The job's fields; :class:`JobNotFound` also for another tenant's job (no leak)."""
        fields = self.store.fields(job_id)
        if fields.get("tenant") != tenant.name:
            raise JobNotFound(f"no job {job_id}")
        return fields


def api_context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: <API key>")

UNAUTHORIZED = (
    "missing or unknown API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>' "
    "(with no keys configured, `stepline up` writes a development key to <run_dir>/api-key)"
)


def current_tenant(
    request: Request,
    bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
    header_key: str | None = Security(_header),
) -> Tenant:
    """The tenant of the request's API key, or 401."""
    key = header_key or (bearer.credentials if bearer is not None else None)
    tenant = api_context(request).tenants.resolve(key)
    if tenant is None:
        raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    return tenant
