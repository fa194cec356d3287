"""The broker transport: kombu's Redis transport with one client per pool, against a real
redis-server — messages still go out and come back in priority order, and the client object is
built once, not per call."""

from __future__ import annotations

import pytest
import redis
from kombu import Connection, Exchange, Queue

from app.embedded_redis import EmbeddedRedis
from tasks.runtime import kombu_url
from tasks.transport import Channel, install

pytestmark = pytest.mark.timeout(30)


def test_publish_and_consume_reuse_one_client_and_keep_kombus_semantics(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    queue = Queue("t-queue", Exchange("t-queue", type="direct"), routing_key="t-queue")
    options = {"queue_order_strategy": "priority"}
    install()  # as app/celery.py does in every Stepline process
    with Connection(kombu_url(redis_server.url), transport_options=options) as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        producer = conn.Producer(serializer="json")
        for i, priority in enumerate((0, 9, 3)):
            producer.publish({"n": i}, exchange=queue.exchange, routing_key="t-queue",
                             declare=[queue], priority=priority)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second  # one client object, not one per call
        got = []
        with conn.SimpleQueue(queue) as simple:
            for _ in range(3):
                message = simple.get(timeout=5)
                got.append(message.payload["n"])
                message.ack()
        assert got == [0, 2, 1]  # kombu's priority order (0 highest) is unchanged
