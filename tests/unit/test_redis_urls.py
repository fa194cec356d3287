"""REDIS_URL forms: a socket, TCP, and kombu's Sentinel list, read the same by broker and store."""

from __future__ import annotations

import pytest

from app.celery import broker_connection_options
from tasks.errors import SettingsError
from tasks.runtime import SentinelAddress, is_sentinel_url
from tasks.settings import load_settings


def test_a_sentinel_url_names_every_sentinel_and_the_masters_password_and_db() -> None:
    address = SentinelAddress.parse(
        "sentinel://:pw%40x@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://10.0.0.3")
    assert address.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (address.password, address.db) == ("pw@x", 2)


def test_a_malformed_sentinel_url_is_refused_without_showing_its_password() -> None:
    with pytest.raises(SettingsError) as refused:
        SentinelAddress.parse("sentinel://:hunter2@h1:26379;redis://h2:6379")
    assert "hunter2" not in str(refused.value) and "sentinel://host:port" in str(refused.value)


def test_the_broker_asks_sentinel_for_the_configured_master_with_keepalives() -> None:
    settings = load_settings(broker={"sentinel_master": "prod"})
    url = "sentinel://h1:26379;sentinel://h2:26379"
    assert is_sentinel_url(url)
    options = broker_connection_options(url, settings)
    assert options["master_name"] == "prod" and options["socket_keepalive"] is True
    tcp = broker_connection_options("redis://h1:6379/0", settings)
    assert tcp["socket_keepalive"] is True and "master_name" not in tcp
    assert broker_connection_options("redis+socket:///run/redis.sock", settings) == {}
