"""What every request handler needs, built once per app: store, service, artifacts, tenants."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from app.tenants import Tenant, TenantDirectory, TenantLimits
from tasks.artifacts import ArtifactStore
from tasks.errors import JobNotFound
from tasks.read_model import ReadModel
from tasks.record import JobRecord, UnreadableRecord
from tasks.runtime import broker_client, store_client
from tasks.settings import Settings
from tasks.store import JobStore
from tasks.submit import JobService


@dataclass
class ApiContext:
    """The API's long-lived collaborators (one Redis connection pool per process): it reads
    through ``reads`` and changes jobs through ``service`` and ``store``'s commands."""

    settings: Settings
    store: JobStore
    reads: ReadModel
    service: JobService
    artifacts: ArtifactStore
    tenants: TenantDirectory
    limits: TenantLimits

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiContext:
        client = store_client(settings)
        store = JobStore(client, commit_replicas=settings.broker.commit_replicas,
                         commit_replica_timeout_s=settings.broker.commit_replica_timeout,
                         broker=broker_client(settings))
        return cls(
            settings=settings, store=store, reads=ReadModel(store),
            service=JobService(store, settings), artifacts=ArtifactStore.from_settings(settings),
            tenants=TenantDirectory.from_settings(settings), limits=TenantLimits(client),
        )

    def owned_record(self, tenant: Tenant, job_id: str) -> JobRecord:
        """The job's record; :class:`JobNotFound` also for another tenant's job, so a caller
        cannot learn that someone else's job id exists."""
        try:
            record = self.reads.record(job_id)
        except UnreadableRecord:
            if not self._tenant_field_is(job_id, tenant):
                raise JobNotFound(f"no job {job_id}") from None
            raise
        if record.tenant != tenant.name:
            raise JobNotFound(f"no job {job_id}")
        return record

    def _tenant_field_is(self, job_id: str, tenant: Tenant) -> bool:
        """Whether an unparseable job is ``tenant``'s, from its raw tenant field: it must read as
        missing to any other tenant, as a readable one does (its owner gets the parse error)."""
        return self.reads.owners([job_id]).get(job_id) == tenant.name


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
