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


@pytest.mark.parametrize("queue", ["interactive", "w1@host.interactive"])
@pytest.mark.parametrize("batch", [False, True], ids=["chunk", "batch"])
def test_the_message_a_commit_pushes_is_the_one_celery_sends(
        stack_env: dict[str, str], redis_client: redis.Redis, queue: str, batch: bool) -> None:
    """``dispatch.wire_message`` (what the commit script pushes) against ``send_task`` on the
    same broker: every header, property and the decoded body equal; only the delivery tag, a
    fresh uuid per message, differs."""
    import base64
    import json
    import uuid

    from tasks.dispatch import declared_queue, wire_message
    from tasks.routing import BATCH_TASK, CHUNK_TASK
    from tasks.runtime import celery

    task: str = BATCH_TASK if batch else CHUNK_TASK
    args: list[object] = (["0123456789abcdef.a1b2c3", [["0123456789abcdef", 3, 1],
                                                       ["fedcba9876543210", 5, 0]]]
                          if batch else ["0123456789abcdef", 3, 1])
    kwargs = {"chunk_name": "denoise[2]", "slo": "interactive", "kind": "image"}
    celery().send_task(task, args=args, kwargs=kwargs, queue=declared_queue(queue),
                       task_id="t-1", argsrepr=repr(args), kwargsrepr=repr(kwargs))
    raw = redis_client.lpop(queue)
    assert raw is not None
    sent = json.loads(raw)
    built = json.loads(wire_message(task, "t-1", args, kwargs).for_queue(queue))
    for message in (sent, built):
        uuid.UUID(message["properties"].pop("delivery_tag"))
        message["body"] = json.loads(base64.b64decode(message["body"]))
    assert built == sent
    assert built["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}
