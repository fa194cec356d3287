"""Kombu's Redis transport, with one client object per connection pool instead of one per call.

Stock kombu builds a new ``redis.Redis`` for every publish, ack and event (``conn_or_acquire``);
redis-py's constructor copies its table of response callbacks each time, ~0.15 ms of Python per
call, and a chunk hop makes four or five such calls (publish, task events, ack). A client is
only a handle on the pool, and redis-py's clients are safe to share between threads, so the
channel keeps one per pool. Everything else — queues, priorities, acks, visibility — is kombu's.
Installed by :func:`install` (``app/celery.py`` calls it, so every Celery process of Stepline
— workers, beat, the API, Flower — uses it): kombu picks its transport from the broker URL's
scheme (``redis://``, ``redis+socket://``), and Flower reads the same URL, so the channel class of
kombu's own Redis transport is swapped rather than the URL. ``tests/bench/bench_hop.py`` measures
it against stock Celery.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """A Redis channel that reuses its synchronous client."""

    _shared_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._shared_client
        if client is None or client.connection_pool is not self.pool:
            client = super()._create_client(asynchronous=False)
            self._shared_client = client
        return client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """The Redis transport with :class:`Channel` (for a connection built explicitly)."""

    Channel = Channel


_STOCK_CHANNEL = kombu_redis.Transport.Channel


def install(enabled: bool = True) -> None:
    """Make kombu's Redis transport use :class:`Channel` in this process (or the stock one
    again with ``enabled=False``); channels opened before keep their class."""
    kombu_redis.Transport.Channel = Channel if enabled else _STOCK_CHANNEL
