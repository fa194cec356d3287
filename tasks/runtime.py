"""Where the running stack is (the run directory and the Redis URL every command agrees on), and
the Celery app the composition root (``app.celery``) configured for this process."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from tasks.errors import SettingsError, SteplineError
from tasks.redact import mask_url
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


@contextmanager
def settings_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment (a stack started inside inherits it) with
    :func:`current_settings` reloaded from it; the environment and settings as they were after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    current_settings.cache_clear()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        current_settings.cache_clear()


def redis_url(settings: Settings) -> str:
    """``REDIS_URL`` when set, else the embedded server's socket under the run directory."""
    return settings.redis_url or socket_url(Path(settings.run_dir))


def broker_url(settings: Settings) -> str:
    """Celery's broker: ``broker.url`` when set, else the store's Redis (:func:`redis_url`)."""
    return settings.broker.url or redis_url(settings)


def separate_broker(settings: Settings) -> bool:
    """Whether the broker's queues live on another Redis than the job store: then no store
    script or transaction can write a queue, and queue lists are read from the broker."""
    return settings.broker.url is not None and settings.broker.url != redis_url(settings)


def kombu_url(url: str) -> str:
    """Celery spells a unix-socket Redis ``redis+socket://``; redis-py spells it ``unix://``."""
    if url.startswith("unix://"):
        return "redis+socket://" + url.removeprefix("unix://")
    return url


def is_sentinel_url(url: str) -> bool:
    """kombu's Sentinel form: ``sentinel://[:password@]host:port[/db];sentinel://host:port``."""
    return url.startswith("sentinel://")


@dataclass(frozen=True)
class SentinelAddress:
    """The sentinels of a Sentinel URL, and the master's password and database."""

    sentinels: tuple[tuple[str, int], ...]
    password: str | None
    db: int

    @classmethod
    def parse(cls, url: str) -> SentinelAddress:
        parts = [urlsplit(part) for part in url.split(";") if part]
        if not parts or any(p.scheme != "sentinel" or not p.hostname for p in parts):
            raise SettingsError(f"{mask_url(url)} is not sentinel://host:port;sentinel://...")
        password = next((unquote(p.password) for p in parts if p.password), None)
        path = next((p.path.strip("/") for p in parts if p.path.strip("/")), "0")
        return cls(tuple((p.hostname or "", p.port or 26379) for p in parts), password,
                   int(path))


# A hung master (or one behind a dead link) is noticed within ~socket_timeout: TCP keepalive
# probes an idle connection after 10 s, every 5 s, 3 times, so a half-open one is dropped too.
KEEPALIVE_OPTIONS = {socket.TCP_KEEPIDLE: 10, socket.TCP_KEEPINTVL: 5, socket.TCP_KEEPCNT: 3}
# Any-valued: spread into redis-py's constructors, whose typed parameters (Sentinel's
# ``force_master_ip`` since redis-py 8.2) a dict of ints would appear to fill
_TIMEOUTS: dict[str, Any] = {"socket_timeout": 10, "socket_connect_timeout": 5,
                             "health_check_interval": 30}
_KEEPALIVE: dict[str, Any] = {"socket_keepalive": True,
                              "socket_keepalive_options": KEEPALIVE_OPTIONS}


def connect(url: str, *, sentinel_master: str = "stepline") -> redis.Redis:
    """A client for the store (binary-safe: checkpoints are bytes). A Sentinel URL gives a
    client of the current master of ``sentinel_master``, which follows a failover."""
    import redis  # imported here: the command line starts without it
    from redis.sentinel import Sentinel

    if is_sentinel_url(url):
        address = SentinelAddress.parse(url)
        sentinel = Sentinel(list(address.sentinels), sentinel_kwargs={**_TIMEOUTS, **_KEEPALIVE},
                            **_TIMEOUTS, **_KEEPALIVE)
        return sentinel.master_for(sentinel_master, redis_class=redis.Redis,
                                   password=address.password, db=address.db)
    tcp = not url.startswith("unix://")
    return redis.Redis.from_url(url, **_TIMEOUTS, **(_KEEPALIVE if tcp else {}))


def store_client(settings: Settings) -> redis.Redis:
    """The store's client for ``settings`` (a plain URL, a socket or Sentinel)."""
    return connect(redis_url(settings), sentinel_master=settings.broker.sentinel_master)


def broker_client(settings: Settings) -> redis.Redis | None:
    """A client for the broker's queue lists when they live apart (:func:`separate_broker`);
    None when they are the store's own."""
    if not separate_broker(settings):
        return None
    return connect(broker_url(settings), sentinel_master=settings.broker.sentinel_master)


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
