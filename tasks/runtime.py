"""Where the running stack is (the run directory and the Redis URL every command agrees on), and
the Celery app the composition root (``app.celery``) configured for this process."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.errors import SettingsError, SteplineError
from tasks.settings import Settings, load_settings

if TYPE_CHECKING:  # both imported where used: the command line starts without them
    import redis
    from celery import Celery

SOCKET_NAME = "redis.sock"
"""The embedded server's unix socket, under the run directory."""


def socket_url(run_dir: Path) -> str:
    """The redis-py URL of the embedded server under ``run_dir``."""
    return f"unix://{(run_dir / SOCKET_NAME).resolve()}"


@lru_cache(maxsize=1)
def current_settings() -> Settings:
    """The process-wide settings (files + environment), loaded once. Settings that do not load
    end the process with one line per bad value and no traceback: every entry point (the
    ``stepline`` command, ``celery -A app``, the API under uvicorn) loads them while importing
    ``app.celery``, before any error handler of its own exists."""
    try:
        return load_settings()
    except SettingsError as exc:
        raise SystemExit(f"stepline: {exc}") from None


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
    import redis

    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5,
                                health_check_interval=30)


_celery_app: Celery | None = None


def use_celery(celery_app: Celery) -> None:
    """Make ``celery_app`` the one the runtime publishes with and controls workers through."""
    global _celery_app
    _celery_app = celery_app


def celery() -> Celery:
    """The configured Celery app. Never Celery's implicit default app: that one would publish
    to a default AMQP broker, which may exist on the host and silently swallow the jobs."""
    if _celery_app is None:
        raise SteplineError("no Celery app configured in this process: import app.celery first")
    return _celery_app
