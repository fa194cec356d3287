"""The Python client and the CLI, both over HTTP to the API, with real workers behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from app.api.server import ThreadedServer
from app.cli import cli
from app.client import ApiUnreachable, Client, JobMissing, NotReady, Rejected, Unauthorized
from app.schemas import JobSpec
from tasks.runtime import current_settings
from tests.conftest import ROOT, Processes, wait_for_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture()
def api(stack_env: dict[str, str]) -> Iterator[str]:
    """The API with no keys configured: it serves the run directory's development key."""
    with ThreadedServer(current_settings()) as server:
        yield server.url


def test_the_client_submits_waits_and_fetches_the_result_of_a_job(
    api: str, processes: Processes, redis_client: redis.Redis
) -> None:
    processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    with Client(api) as client:  # the key comes from <run_dir>/api-key
        job = client.submit(JobSpec(kind="simulated", params={"steps": 5, "step_ms": 10}))
        assert (job.tenant, job.tier, job.total) == ("default", "standard", 5)

        done = client.wait(job.id, timeout_s=30, progress=True)

        assert done.state.value == "DONE" and done.progress == 5 and done.deadline_met
        assert json.loads(client.result(job.id))["applied"] == [0, 1, 2, 3, 4]
        assert [j.id for j in client.list(state="DONE").jobs] == [job.id]
        stats = client.stats()
        assert stats.classes["interactive"].finished == 1
        assert [w.name for w in stats.workers] == ["w1@test"]
        long = client.submit(kind="simulated", slo="batch", params={"steps": 100, "step_ms": 20})
        client.cancel(long.id)
        assert client.wait(long.id, timeout_s=20).state.value == "CANCELLED"


def test_the_client_submits_a_backlog_in_batches_and_every_job_runs(
    api: str, processes: Processes, redis_client: redis.Redis
) -> None:
    # given more jobs than one batch request of the development key's burst carries
    specs = [JobSpec(kind="simulated", slo="batch", params={"steps": 1, "step_ms": 1})
             for _ in range(35)]
    with Client(api) as client:
        # when the client submits them, then a worker runs them
        entries = client.submit_many(specs, batch_size=15)
        processes.worker("w1")
        wait_for_workers(redis_client, ["w1"])
        # then each has its own new job, and every one of them finishes
        ids = [e.id for e in entries]
        assert len(set(ids)) == len(specs) and all(e.created for e in entries)
        for job_id in ids:
            assert client.wait(job_id, timeout_s=60).state.value == "DONE"
        with pytest.raises(Rejected, match=r"jobs\[1\]"):  # and a bad job is named
            client.submit_many([specs[0], JobSpec(kind="simulated", params={"steps": 0})])


def test_the_client_raises_a_typed_error_for_each_refusal(api: str) -> None:
    with Client(api) as client:
        job = client.submit(kind="simulated", params={"steps": 2})
        with pytest.raises(NotReady, match="QUEUED"):
            client.result(job.id)
        with pytest.raises(JobMissing, match="no job 0000"):
            client.get("0000")
        with pytest.raises(Rejected, match="steps") as rejected:
            client.submit(kind="simulated", params={"steps": "many"})
        assert rejected.value.status == 422
    with Client(api, api_key="wrong-key") as stranger, pytest.raises(Unauthorized):
        stranger.get(job.id)
    with Client("http://127.0.0.1:9") as nowhere, pytest.raises(ApiUnreachable,
                                                                 match="stepline up"):
        nowhere.get(job.id)


def test_the_client_takes_its_key_from_the_argument_then_the_environment_then_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "api-key").write_text("from-file\n")
    monkeypatch.delenv("STEPLINE_API_KEY", raising=False)

    def key_of(**kwargs: object) -> str:
        with Client("http://127.0.0.1:9", run_dir=tmp_path, **kwargs) as client:  # type: ignore[arg-type]
            return client.http.headers["Authorization"]

    assert key_of() == "Bearer from-file"
    monkeypatch.setenv("STEPLINE_API_KEY", "from-env")
    assert key_of() == "Bearer from-env"
    assert key_of(api_key="explicit") == "Bearer explicit"


def test_the_cli_submits_watches_and_downloads_through_the_api(
    api: str, processes: Processes, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPLINE_API_URL", api)
    processes.worker("w1")
    wait_for_workers(redis_client, ["w1"])
    runner = CliRunner()

    submitted = runner.invoke(cli, ["submit", "--steps", "3", "--step-ms", "5", "--wait"])
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.output.split()[0]
    assert f"{job_id} DONE" in submitted.output

    shown = runner.invoke(cli, ["status", job_id])
    assert shown.exit_code == 0 and "3/3" in shown.output and "DONE" in shown.output
    listed = runner.invoke(cli, ["jobs", "--state", "DONE"])
    assert listed.exit_code == 0 and job_id in listed.output
    target = tmp_path / "out.json"
    fetched = runner.invoke(cli, ["result", job_id, "-o", str(target)])
    assert fetched.exit_code == 0, fetched.output
    assert json.loads(target.read_bytes())["applied"] == [0, 1, 2]
    missing = runner.invoke(cli, ["cancel", "ffffffffffffffff"])
    assert missing.exit_code == 1 and "no job ffffffffffffffff" in missing.output


def test_the_cli_says_how_to_start_the_api_when_none_answers(tmp_path: Path) -> None:
    env = {**os.environ, "STEPLINE_API_URL": "http://127.0.0.1:9", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "status", "0123456789abcdef", "--run-dir",
         str(tmp_path)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "cannot reach the Stepline API at http://127.0.0.1:9" in done.stdout
    assert "stepline up" in done.stdout and "Traceback" not in done.stdout + done.stderr
