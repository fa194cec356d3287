"""The artifact store on a real S3-compatible server (SeaweedFS on loopback): written by a
worker on one host, served by an API on another."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from app.api.server import ThreadedServer
from tasks.artifacts import ArtifactStore, UnsafeArtifactPath
from tasks.redact import mask_url
from tasks.runtime import current_settings
from tasks.settings import load_settings
from tests.conftest import Processes, wait_for, wait_for_workers
from tests.object_store import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3
from workers.runner import Artifact

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

API_KEY = "hosts-key-0123456789"


def s3_store(server: SeaweedS3, secret: str = SECRET_KEY) -> ArtifactStore:
    return ArtifactStore(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", {
        "endpoint_url": server.endpoint_url, "key": ACCESS_KEY, "secret": secret})


def test_an_artifact_written_to_s3_is_read_back_by_another_store_object(
    s3_server: SeaweedS3,
) -> None:
    # given one store writing a result
    writer = s3_store(s3_server)
    name = writer.put("0123456789abcdef", Artifact(b'{"applied": [0]}', "application/json",
                                                   "json"))
    # when another client of the same URL (another host) reads it
    reader = ArtifactStore(writer.url, {"endpoint_url": s3_server.endpoint_url,
                                        "key": ACCESS_KEY, "secret": SECRET_KEY})
    # then it has the same bytes, and a name never written is missing, not empty
    assert reader.read(name) == b'{"applied": [0]}'
    assert reader.exists(name) and not reader.exists("fedcba9876543210.json")
    with pytest.raises(FileNotFoundError):
        reader.read("fedcba9876543210.json")


def test_an_s3_store_rejects_unsafe_names_and_wrong_keys(s3_server: SeaweedS3) -> None:
    store = s3_store(s3_server)
    for name in ("../escape.json", "a/b.json", ".hidden.json"):
        with pytest.raises(UnsafeArtifactPath):
            store.read(name)
    wrong = s3_store(s3_server, secret="not-the-secret")
    with pytest.raises(PermissionError):
        wrong.put("0123456789abcdef", Artifact(b"{}", "application/json", "json"))


def test_the_store_settings_never_show_the_secret(s3_server: SeaweedS3,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_server.storage_env("shown").items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    store = ArtifactStore.from_settings(settings)
    assert SECRET_KEY not in repr(settings) and SECRET_KEY not in repr(store)
    assert mask_url(store.url) == store.url == f"s3://{BUCKET}/shown"


def test_a_job_finished_on_one_host_is_served_by_the_api_of_another(
    s3_server: SeaweedS3, stack_env: dict[str, str], processes: Processes,
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given an API on "host A" and a worker on "host B", each with its own run directory,
    # sharing one Redis and one s3:// artifact store
    shared = s3_server.storage_env(uuid.uuid4().hex[:8])
    for key, value in shared.items():
        monkeypatch.setenv(key, value)
    current_settings.cache_clear()
    host_b = {**shared, "STEPLINE_RUN_DIR": str(tmp_path / "host-b")}
    processes.worker("wb", extra_env=host_b)
    settings = load_settings(run_dir=tmp_path / "host-a",
                             api={"keys": [{"key": API_KEY, "tenant": "ops"}]})
    with ThreadedServer(settings) as api, httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as ops:
        # when a job runs to the end on host B
        created = ops.post("/v1/jobs", json={"kind": "simulated",
                                              "params": {"steps": 4, "step_ms": 5}})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        wait_for_workers(redis_client, ["wb"])
        wait_for(lambda: ops.get(f"/v1/jobs/{job_id}").json()["state"] == "DONE", 60,
                 "the job to finish on host B")
        # then host A's API serves its artifact, and host B's disk holds none
        result = ops.get(f"/v1/jobs/{job_id}/result")
        assert result.status_code == 200, result.text
        assert json.loads(result.content)["applied"] == [0, 1, 2, 3]
        assert not list((tmp_path / "host-b").glob("**/*.json"))
        assert not (tmp_path / "host-a" / "artifacts").exists()
