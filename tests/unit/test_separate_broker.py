"""``broker.url``: Celery's queues on a Redis apart from the job store, read from there, and
published through Celery (a store script cannot write another server); unset, one Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from app.api.stats import queue_depths
from app.autoscale import WorkerRange
from app.celery import celery_config
from app.stack import Stack, up_banner
from tasks import keys
from tasks.dispatch import direct_publish
from tasks.errors import SettingsError
from tasks.read_model import ReadModel
from tasks.redact import MASK
from tasks.runtime import broker_url, kombu_url, redis_url, separate_broker
from tasks.settings import load_settings
from tasks.store import JobStore

pytestmark = pytest.mark.timeout(60)

SECRET = "br0ker-s3cret"


def test_unset_the_broker_is_the_stores_redis_and_hops_publish_directly(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # given no broker.url
    monkeypatch.delenv("STEPLINE_BROKER__URL", raising=False)
    settings = load_settings(REDIS_URL="redis://10.0.0.5:6379/0")
    # then Celery's broker is REDIS_URL, and the commit pushes the next chunk itself
    assert settings.broker.url is None and not separate_broker(settings)
    assert celery_config(settings)["broker_url"] == kombu_url(redis_url(settings))
    assert direct_publish(settings)


def test_a_broker_url_is_celerys_broker_and_turns_direct_publish_off() -> None:
    # given a broker apart from the job store
    settings = load_settings(REDIS_URL="redis://10.0.0.5:6379/0",
                             broker={"url": "redis://10.0.0.6:6379/0"})
    # then Celery publishes there, and a hop publishes through Celery (two round trips)
    assert separate_broker(settings) and broker_url(settings) == "redis://10.0.0.6:6379/0"
    assert celery_config(settings)["broker_url"] == "redis://10.0.0.6:6379/0"
    assert not direct_publish(settings)


def test_a_broker_url_naming_the_store_itself_keeps_one_redis() -> None:
    settings = load_settings(REDIS_URL="redis://10.0.0.5:6379/0",
                             broker={"url": "redis://10.0.0.5:6379/0"})
    assert not separate_broker(settings) and direct_publish(settings)


def test_a_broker_url_of_another_scheme_is_refused_without_its_password(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a broker URL for AMQP, with a password
    monkeypatch.setenv("STEPLINE_BROKER__URL", f"amqp://ops:{SECRET}@mq:5672//")
    # when the settings load, then they fail naming the variable and the forms, not the secret
    with pytest.raises(SettingsError) as refused:
        load_settings()
    message = str(refused.value)
    assert "STEPLINE_BROKER__URL" in message and "redis://" in message
    assert SECRET not in message and MASK in message


def test_the_up_banner_names_the_store_and_the_broker_without_their_passwords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a stack with a password-protected store and broker
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = load_settings(run_dir=tmp_path, REDIS_URL=f"redis://ops:{SECRET}@10.0.0.5:6379/0",
                             broker={"url": f"rediss://ops:{SECRET}@10.0.0.6:6380/0"})
    # when stepline up builds its banner
    banner = up_banner(Stack(settings=settings, run_dir=tmp_path), WorkerRange(2, 2))
    # then both are named, masked
    assert f"redis redis://ops:{MASK}@10.0.0.5:6379/0" in banner
    assert f"broker rediss://ops:{MASK}@10.0.0.6:6380/0" in banner
    assert SECRET not in banner


def test_queue_lengths_and_tails_are_read_from_the_broker_and_flags_from_the_store(
    redis_client: redis.Redis, broker_redis: redis.Redis
) -> None:
    # given a job whose preempt flag is up in the store, and two messages on the broker's
    # interactive queue (none on the store's)
    redis_client.hset(keys.job("j1"), mapping={"preempt": "1"})
    broker_redis.lpush("interactive", b"second", b"first")
    store = JobStore(redis_client, broker=broker_redis)
    # when a running chunk asks its signals, and the API reads the queues
    signals = store.chunk_signals("j1", ahead=("realtime", "interactive"))
    reads = ReadModel(store)
    # then the flag comes from the store, the waiting queue from the broker
    assert signals == (True, "interactive")
    assert reads.list_lengths(["realtime", "interactive"]) == [0, 2]
    assert reads.list_tails(["interactive"], 1) == [[b"second"]]
    assert queue_depths(reads, ["interactive", "batch"]) == {"interactive": 2, "batch": 0}
    assert not redis_client.exists("interactive")


def test_without_a_broker_client_the_store_reads_its_own_queue_lists(
    redis_client: redis.Redis
) -> None:
    # given a message on the store's own interactive queue (one Redis)
    redis_client.lpush("interactive", b"m")
    store = JobStore(redis_client)
    # then the store is its own broker
    assert store.broker is store.redis
    assert store.chunk_signals("j1", ahead=("interactive",)) == (False, "interactive")
    assert ReadModel(store).list_lengths(["interactive"]) == [1]
