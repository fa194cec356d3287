"""Tenants: API keys → (tenant, tier, limits), the development key, and the per-tenant limits
enforced in Redis (a token-bucket rate limit, one Lua script ``tasks/lua/take_token.lua``, and a
quota of unfinished jobs, one read of the live counters ``tasks.live_counts`` keeps).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.run_files import API_KEY_FILE
from tasks import keys, scripts
from tasks.live_counts import LiveCounts
from tasks.settings import Settings
from tasks.settings.api import ApiKeySettings

if TYPE_CHECKING:  # a type only: importing this module needs no redis
    import redis

log = logging.getLogger(__name__)

DEV_TENANT = "default"

def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request acts for, and what it may do."""

    name: str
    tier: str
    rate_limit_per_s: float
    burst: int
    max_queued: int


def _tenant_of(entry: ApiKeySettings) -> Tenant:
    return Tenant(entry.tenant, entry.tier, entry.rate_limit_per_s, entry.burst, entry.max_queued)


class TenantDirectory:
    """Resolves a presented API key to its tenant; keys are held only as SHA-256 digests."""

    def __init__(self, entries: list[ApiKeySettings]) -> None:
        self._by_digest = {
            entry.key_sha256 or hash_key(entry.key or ""): _tenant_of(entry) for entry in entries
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantDirectory:
        """The configured keys, or, with none configured, the run directory's development key."""
        if settings.api.keys:
            return cls(settings.api.keys)
        key = ensure_dev_key(Path(settings.run_dir))
        return cls([ApiKeySettings(key=key, tenant=DEV_TENANT, tier=settings.api.dev_tier)])

    def resolve(self, key: str | None) -> Tenant | None:
        if not key:
            return None
        return self._by_digest.get(hash_key(key))


def read_or_create_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret in ``path``; on first use ``make()`` writes it, readable by its owner only
    (``O_EXCL`` with mode 0600: never world-readable, and two racing processes agree)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(make() + "\n")
    log.info("wrote %s", path)
    return path.read_text().strip()


def ensure_dev_key(run_dir: Path) -> str:
    """The development key of ``run_dir`` (tenant ``default``), created on first use."""
    return read_or_create_secret(run_dir / API_KEY_FILE, lambda: "sl-" + secrets.token_urlsafe(32))


class TenantLimits:
    """Rate limit and queue quota of each tenant, shared by every API process through Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._take = scripts.register(client, "take_token")
        self.live = LiveCounts(client)

    def take_token(self, tenant: Tenant, count: int = 1) -> float:
        """Spend ``count`` submission tokens, all or none; returns 0, or the seconds until
        that many are available."""
        wait = self._take(keys=[keys.tenant_bucket(tenant.name)],
                          args=[repr(tenant.rate_limit_per_s), tenant.burst, count])
        return float(wait)

    def take_token_and_count(self, tenant: Tenant, count: int = 1) -> tuple[float, int]:
        """``take_token`` (of ``count`` tokens) and ``unfinished`` in one round trip (the
        submit path's two checks).
        The script goes as a bare ``EVALSHA`` (a redis-py pipeline would first ask ``SCRIPT
        EXISTS``, one more round trip); refused as ``NOSCRIPT`` it did not run, and the two
        checks are made one by one, which loads it."""
        from redis.exceptions import NoScriptError  # the command line imports no redis

        pipe = self.redis.pipeline(transaction=False)
        pipe.evalsha(self._take.sha, 1, keys.tenant_bucket(tenant.name),
                     repr(tenant.rate_limit_per_s), tenant.burst, count)
        pipe.hget(keys.LIVE_BY_TENANT, tenant.name)
        wait, unfinished = pipe.execute(raise_on_error=False)
        if isinstance(wait, NoScriptError):
            return self.take_token(tenant, count), self.unfinished(tenant)
        for reply in (wait, unfinished):
            if isinstance(reply, Exception):
                raise reply
        return float(wait), 0 if unfinished is None else int(unfinished)

    def unfinished(self, tenant: Tenant) -> int:
        """Jobs of ``tenant`` that have not ended, however they were submitted: one read of a
        counter the state changes keep, whatever the backlog."""
        return self.live.of_tenant(tenant.name)
