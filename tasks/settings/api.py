"""Settings of the REST shim: API keys and tenants, quotas, stats windows, Flower's login
(``api:`` in configs/default.yaml; addresses and ports stay under ``service:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.settings.durations import Seconds

Tier = Literal["gold", "standard"]


class ApiKeySettings(BaseModel):
    """One API key: who it belongs to, their tier and their limits."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    key: str | None = Field(default=None, min_length=16, max_length=256)
    """The key in clear (convenient in development); prefer ``key_sha256`` in shared files."""
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the key: ``printf %s KEY | sha256sum``."""
    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    """The tenant the key acts for; a tenant sees only its own jobs."""
    tier: Tier = "standard"
    """Tenant tier; gold weighs more in the origin score."""
    rate_limit_per_s: float = Field(default=20.0, gt=0, le=100_000)
    """Sustained submissions per second (token bucket refill rate). Submissions per second, in
    (0, 100000]."""
    burst: int = Field(default=40, ge=1, le=1_000_000)
    """Submissions allowed at once before the rate limit applies (bucket size). Submissions,
    in [1, 1000000]."""
    max_queued: int = Field(default=200, ge=1, le=1_000_000)
    """Most jobs of this tenant that may be unfinished at once. Jobs, in [1, 1000000]."""

    @model_validator(mode="after")
    def _one_key_form(self) -> ApiKeySettings:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of 'key' or 'key_sha256'")
        return self


class ApiSettings(BaseModel):
    """The REST shim."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    keys: list[ApiKeySettings] = Field(default_factory=list, max_length=10_000)
    """API keys (at most 10000); empty → a development key for tenant ``default`` in
    ``<run_dir>/api-key``."""
    dev_tier: Tier = "standard"
    """Tier of the development key: standard, the tier of jobs submitted without a key, so a
    configured gold tenant still outranks local traffic."""
    stats_window_jobs: int = Field(default=500, ge=1, le=100_000)
    """Recent jobs over which /v1/stats and /metrics compute SLO attainment. Jobs, in
    [1, 100000]."""
    stats_window: Seconds = Field(default=300.0, gt=0, le=86_400)
    """Sliding window of /v1/stats' ``window``, the ``*_window`` metrics and the dashboard:
    per-class attainment and latency percentiles over the jobs that ended within it. Seconds,
    in (0, 86400]."""
    stats_window_max_jobs: int = Field(default=20_000, ge=1, le=1_000_000)
    """Most ended jobs the sliding window reads (the newest), which bounds one scrape's cost.
    Jobs, in [1, 1000000]."""
    dashboard_token: str | None = Field(default=None, min_length=16, max_length=256)
    """Read-only token for /dashboard (exchanged for a session cookie); unset → generated into
    ``<run_dir>/dashboard-token`` (mode 0600). Set it when several API processes serve one
    stack, so that a session one of them issued is valid at the others."""
    list_scan_limit: int = Field(default=2_000, ge=10, le=1_000_000)
    """Most jobs one GET /v1/jobs examines while filtering, which bounds the request's cost; a
    page whose filter matched too little by then comes back short, with a cursor that goes on
    from there. Jobs, in [10, 1000000]."""
    inference_slo: Literal["realtime", "interactive"] = "interactive"
    """Class of /v1/inference jobs when the request does not say."""
    inference_grace: Seconds = Field(default=0.25, ge=0, le=60)
    """/v1/inference waits this long past the job's deadline before answering 504. Seconds, in
    [0, 60]."""
    poll_interval: Seconds = Field(default=0.02, gt=0, le=5)
    """How often a waiting request re-reads its job. Seconds, in (0, 5]."""
    redis_retry_after: int = Field(default=2, ge=1, le=3600)
    """Retry-After of the 503 sent while Redis is unreachable. Whole seconds, in [1, 3600]."""
    flower_host: str = "127.0.0.1"
    """Interface Flower listens on (its port is ``service.flower_port``)."""
    flower_user: str = Field(default="stepline", min_length=1, max_length=64, pattern=r"^[^:]+$")
    """Flower's basic-auth user."""
    flower_password: str | None = Field(default=None, min_length=8, max_length=256)
    """Flower's password; unset → generated into ``<run_dir>/flower-auth`` (mode 0600)."""
