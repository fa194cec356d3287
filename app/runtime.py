"""Where the running stack is: the run directory and the Redis URL every command agrees on."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import redis

from app.embedded_redis import socket_url
from app.settings import Settings, load_settings


@lru_cache(maxsize=1)
def current_settings() -> Settings:
    """The process-wide settings (files + environment), loaded once."""
    return load_settings()


def redis_url(settings: Settings) -> str:
    """``REDIS_URL`` when set, else the embedded server's socket under the run directory."""
    return settings.redis_url or socket_url(Path(settings.run_dir))


def kombu_url(url: str) -> str:
    """Celery spells a unix-socket Redis ``redis+socket://``; redis-py spells it ``unix://``."""
    if url.startswith("unix://"):
        return "redis+socket://" + url.removeprefix("unix://")
    return url


def connect(url: str) -> redis.Redis:
    """A client for the store (binary-safe: checkpoints are bytes)."""
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                health_check_interval=30)
