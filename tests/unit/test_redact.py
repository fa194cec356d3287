"""Credentials never shown: every URL Stepline prints or logs has its password masked."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.autoscale import WorkerRange
from app.stack import Stack, up_banner
from tasks.redact import MASK, mask_url
from tasks.settings import load_settings

SECRET = "s3cr3t-p@ss:w/rd"


@pytest.mark.parametrize(("url", "shown"), [
    (f"redis://stepline:{SECRET}@10.0.0.5:6379/0", f"redis://stepline:{MASK}@10.0.0.5:6379/0"),
    (f"rediss://:{SECRET}@redis.internal:6380", f"rediss://:{MASK}@redis.internal:6380"),
    (f"sentinel://:{SECRET}@h1:26379;sentinel://:{SECRET}@h2:26379",
     f"sentinel://:{MASK}@h1:26379;sentinel://:{MASK}@h2:26379"),
    (f"unix:///run/redis.sock?db=0&password={SECRET}", f"unix:///run/redis.sock?db=0&password={MASK}"),
    ("s3://bucket/artifacts?key=AKIA123&secret=xyz", f"s3://bucket/artifacts?key={MASK}&secret={MASK}"),
])
def test_a_url_is_shown_with_its_password_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert "s3cr3t" not in mask_url(url) and "xyz" not in mask_url(url)


@pytest.mark.parametrize("url", [
    "redis://10.0.0.5:6379/0", "redis://stepline@10.0.0.5:6379", "unix:///run/redis.sock",
    "file:///srv/artifacts", "s3://bucket/prefix",
])
def test_a_url_without_a_password_is_shown_unchanged(url: str) -> None:
    assert mask_url(url) == url


def test_the_up_banner_names_redis_without_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a stack configured with a password-protected Redis
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = load_settings(run_dir=tmp_path, REDIS_URL=f"redis://ops:{SECRET}@10.0.0.5:6379/0")
    stack = Stack(settings=settings, run_dir=tmp_path)
    # when stepline up builds its banner
    banner = up_banner(stack, WorkerRange(2, 2))
    # then it says where Redis is, and never the password
    assert f"redis redis://ops:{MASK}@10.0.0.5:6379/0" in banner
    assert SECRET not in banner and "s3cr3t" not in banner
