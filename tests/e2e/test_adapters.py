"""LoRA adapters as a user drives them: registered in the adapter folder, listed over REST, the
CLI and the Python client, named by jobs that real workers run, refused by name when unknown."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from typer.testing import CliRunner

from app.api.server import ThreadedServer
from app.cli import cli
from app.client import Client, Rejected, find_api_key
from tasks.runtime import current_settings
from tests.conftest import Processes, wait_for_workers
from workers.diffusion.lora import make_random_adapter
from workers.diffusion.recipes import diffusion_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ADAPTERS_ENV = "STEPLINE_DIFFUSION__ADAPTERS_DIR"
FOX = {"model": "pixart-tiny", "prompt": "a red fox", "num_inference_steps": 3, "seed": 4}


@pytest.fixture()
def adapter_folder(stack_env: dict[str, str], tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "adapters"
    make_random_adapter(diffusion_recipe("pixart-tiny"), "fox-style", folder)
    monkeypatch.setenv(ADAPTERS_ENV, str(folder))
    current_settings.cache_clear()
    return folder


@pytest.fixture()
def api(adapter_folder: Path) -> Iterator[str]:
    with ThreadedServer(current_settings()) as server:
        yield server.url


def test_a_registered_adapter_is_listed_and_a_job_naming_it_runs_with_it(
    api: str, adapter_folder: Path, processes: Processes, redis_client: redis.Redis
) -> None:
    # given an adapter registered for pixart-tiny and a worker that sees the same folder
    processes.worker("w1", extra_env={ADAPTERS_ENV: str(adapter_folder)})
    wait_for_workers(redis_client, ["w1"])
    with Client(api) as client:
        # when the user lists adapters and models, then the adapter shows with its model
        assert [(a.name, a.base) for a in client.adapters().data] == [("fox-style",
                                                                       "pixart-tiny")]
        models = client.http.get("/v1/models").json()["data"]
        fits = {m["id"]: m["stepline"].get("adapters") for m in models}
        assert fits["pixart-tiny"] == ["fox-style"] and fits["dit-tiny"] == []
        # when jobs with and without the adapter run on the worker
        styled = client.submit(kind="image", params=FOX, adapters=[("fox-style", 0.8)])
        plain = client.submit(kind="image", params=FOX)
        outputs = []
        for job in (styled, plain):
            assert client.wait(job.id, timeout_s=60).state.value == "DONE"
            outputs.append(hashlib.sha256(client.result(job.id)).hexdigest())
        # then the job carries its adapters, and they changed its image
        carried = client.get(styled.id).params["adapters"]
        assert [(a["name"], a["scale"]) for a in carried] == [("fox-style", 0.8)]
        assert outputs[0] != outputs[1]
    # and the OpenAI images route applies the adapters of its stepline field the same way
    sdk = openai.OpenAI(base_url=f"{api}/v1", api_key=find_api_key(), max_retries=0)
    image = sdk.images.generate(
        model="pixart-tiny", prompt=FOX["prompt"], response_format="b64_json",
        extra_body={"stepline": {"adapters": [{"name": "fox-style", "scale": 0.8}],
                                 "params": {"seed": FOX["seed"],
                                            "num_inference_steps": FOX["num_inference_steps"]}}})
    assert image.data is not None and image.data[0].b64_json is not None
    assert hashlib.sha256(base64.b64decode(image.data[0].b64_json)).hexdigest() == outputs[0]


def test_an_unknown_adapter_is_refused_by_name_over_rest_the_client_and_the_cli(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given the API, when jobs name an adapter that is not registered
    with Client(api) as client:
        raw = client.http.post("/v1/jobs", json={
            "kind": "image", "params": {**FOX, "adapters": [{"name": "nope"}]}})
        # then REST answers 422 naming it, and the client raises Rejected naming it
        assert raw.status_code == 422 and "unknown adapter 'nope'" in raw.json()["detail"]
        with pytest.raises(Rejected, match=r"unknown adapter 'nope'.*fox-style"):
            client.submit(kind="image", params=FOX, adapters=[("nope", 1.0)])
    # and the CLI exits 2 saying the same
    monkeypatch.setenv("STEPLINE_API_URL", api)
    submitted = CliRunner().invoke(cli, ["submit", "--kind", "image", "--prompt", "a red fox",
                                         "-p", "model=pixart-tiny", "--adapter", "nope:0.5"])
    assert submitted.exit_code == 2 and "unknown adapter 'nope'" in submitted.output
