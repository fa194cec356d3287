"""Security under fault: pickle and malformed messages are refused by a worker that keeps
serving, the embedded Redis listens on no TCP port, artifact names cannot leave the store."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis

from app.celery import app as celery_app
from app.celery import celery_config
from app.drills.faults import (
    MALFORMED_LOG,
    REFUSAL_LOG,
    publish_malformed,
    publish_pickle,
    tcp_listen_ports,
)
from app.embedded_redis import EmbeddedRedis
from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.artifacts import ArtifactStore, UnsafeArtifactPath
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, wait_for, wait_for_workers
from workers.runner import Artifact

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_pickle_and_malformed_messages_are_refused_and_the_worker_keeps_serving(
    processes: Processes, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # given a worker
    worker = processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    canary = tmp_path / "unpickled"

    # when a pickle message (whose unpickling would create a file), chunk messages with wrong
    # argument types or none, an unregistered task and a non-JSON body reach its queue
    publish_pickle(celery_app, "interactive", canary=canary)
    publish_malformed(celery_app, "interactive")

    # then it refuses each, says so in its log, never unpickles, and still runs a valid job
    wait_for(lambda: REFUSAL_LOG in processes.log("w1"), 20, "the pickle refusal in the log")
    wait_for(lambda: MALFORMED_LOG in processes.log("w1"), 20, "the malformed-message log")
    service = JobService(JobStore(redis_client), current_settings())
    job_id, _ = service.submit(JobSpec(kind="simulated", slo=SloClass.REALTIME,
                                       params={"steps": 3, "step_ms": 5}, deadline_s=60))
    wait_for(lambda: service.store.state(job_id) is JobState.DONE, 30, "a valid job to finish")
    # (the five messages are consumed in any order relative to the job: wait for each log line)
    wait_for(lambda: "unregistered task of type 'os.system'" in processes.log("w1"), 20,
             "the unregistered-task log")
    wait_for(lambda: "Can't decode message body" in processes.log("w1"), 20,
             "the undecodable-body log")
    assert not canary.exists()
    assert worker.poll() is None


def test_every_consumer_accepts_json_only() -> None:
    config = celery_config(current_settings())
    assert config["accept_content"] == ["json"]
    assert config["task_serializer"] == config["event_serializer"] == "json"


def test_the_embedded_redis_listens_on_a_private_unix_socket_and_no_tcp_port(
    redis_server: EmbeddedRedis, redis_client: redis.Redis
) -> None:
    assert redis_client.config_get("port") == {"port": "0"}
    pid = int(redis_client.info("server")["process_id"])
    assert tcp_listen_ports(pid) == []
    assert stat.S_IMODE(redis_server.socket_path.stat().st_mode) & 0o077 == 0


@pytest.mark.parametrize("name", [
    "../escape.json", "../../etc/passwd", "/etc/passwd", "a/../../b.png", "sub/x.png",
    "..%2fx.json", ".hidden.json", "x.json/../../y.json", "x.py", "x.json\x00.png", "",
])
def test_an_artifact_name_that_would_leave_the_store_is_rejected(
    tmp_path: Path, name: str
) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    with pytest.raises(UnsafeArtifactPath):
        store.path(name)
    with pytest.raises(UnsafeArtifactPath):
        store.read(name)


def test_an_artifact_is_written_and_read_back_inside_the_store(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "artifacts")
    name = store.put("0123456789abcdef", Artifact(b"{}", "application/json", "json"))
    assert store.read(name) == b"{}"
    assert store.path(name).parent == (tmp_path / "artifacts").resolve()
    with pytest.raises(UnsafeArtifactPath):
        store.put("../../escape", Artifact(b"{}", "application/json", "json"))
