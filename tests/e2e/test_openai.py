"""The OpenAI-compatible routes, driven by the official ``openai`` SDK: real Redis, a real
worker process, uvicorn over HTTP. One stack serves the whole module (its worker builds each
model once), so every test here is a few seconds at most."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from typer.testing import CliRunner

from app.api.server import ThreadedServer
from app.cli import cli
from app.embedded_redis import EmbeddedRedis
from tasks.runtime import current_settings
from tasks.settings import load_settings
from tests.conftest import Processes, wait_for, wait_for_workers

# The module's stack imports torch in the API and builds two models on the worker once, which
# the first test's setup pays for: minutes on a shared CPU.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "openai-key-0123456789"
TEXT_MODEL = "mixtral-tiny"
IMAGE_MODEL = "pixart-tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def api(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API over a fresh store, and one worker that has run a text and an image job once."""
    root = tmp_path_factory.mktemp("openai")
    store = redis.Redis.from_url(redis_server.url)
    store.flushall()
    env = {"REDIS_URL": redis_server.url, "STEPLINE_RUN_DIR": str(root / "run"),
           "STEPLINE_BROKER__VISIBILITY_TIMEOUT": "4",
           "STEPLINE_BROKER__UNACKED_RESTORE_INTERVAL": "1", "STEPLINE_BROKER__CHUNK_LEASE": "1.5"}
    keys = [{"key": KEY, "tenant": "acme", "rate_limit_per_s": 1000, "burst": 1000}]
    settings = load_settings(api={"keys": keys}, redis_url=redis_server.url,
                             run_dir=root / "run", warm_start=True)  # the API's own warm-up
    workers = Processes(env, root / "logs")
    workers.worker("w1")
    try:
        with ThreadedServer(settings) as server:
            wait_for_workers(store, ["w1"])
            wait_for(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, 240,
                     "the API to load every recipe's validation (torch)")
            _warm_up(server.url)
            yield server.url
    finally:
        workers.stop_all()
        store.close()


def _warm_up(url: str) -> None:
    """Build both models on the worker (a cold start takes seconds) before any test times."""
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=120) as http:
        ids = [http.post("/v1/jobs", json={"kind": kind, "slo": "batch", "params": params})
               .json()["id"] for kind, params in (
                   ("text", {"inputs": "warm", "max_new_tokens": 2, "model": TEXT_MODEL}),
                   ("image", {"prompt": "warm", "model": IMAGE_MODEL,
                              "num_inference_steps": 2}))]
        wait_for(lambda: all(http.get(f"/v1/jobs/{i}").json()["state"] == "DONE" for i in ids),
                 60, "the warm-up jobs")


@pytest.fixture()
def client(api: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api}/v1", api_key=KEY, max_retries=0, timeout=30) as sdk:
        yield sdk


def test_models_lists_every_configured_recipe_in_openais_list_shape(
    client: openai.OpenAI,
) -> None:
    models = {m.id: m for m in client.models.list()}
    assert {"mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny", "dit-tiny", "pixart-tiny",
            "wan-tiny"} <= set(models)
    assert models[TEXT_MODEL].owned_by == "stepline"
    assert (models[TEXT_MODEL].model_extra or {})["stepline"]["kind"] == "text"
    assert (models[IMAGE_MODEL].model_extra or {})["stepline"]["kind"] == "image"
    assert client.models.retrieve(IMAGE_MODEL).id == IMAGE_MODEL


def test_a_chat_completion_answers_with_text_usage_and_the_jobs_report(
    client: openai.OpenAI, api: str,
) -> None:
    # when a client asks for a completion in the batch class, with a deadline and no seed
    answer = client.chat.completions.create(
        model=TEXT_MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Explain quantum computing"}],
        extra_body={"stepline": {"slo_class": "batch", "deadline_s": 30}})

    # then it has the text, the counts, and Stepline's account of the job that made it
    choice = answer.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > 5
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    report = (answer.model_extra or {})["stepline"]
    assert (report["state"], report["slo_class"], report["model"]) == ("DONE", "batch",
                                                                     TEXT_MODEL)
    assert 0 <= report["seed"] < 2**32  # none was sent: one was drawn for the request
    assert report["metrics"]["activated_experts"]
    assert report["turnaround_s"] > 0 and report["chunks_done"] == report["chunks"]
    assert answer.id == f"chatcmpl-{report['job_id']}"
    job = httpx.get(f"{api}/v1/jobs/{report['job_id']}", headers={"X-API-Key": KEY}).json()
    assert (job["kind"], job["slo"], job["params"]["max_new_tokens"]) == ("text", "batch", 12)
    assert job["deadline_at"] - job["submitted_at"] == pytest.approx(30)
    assert job["params"]["prompt"] == ("system: Be brief.\nuser: Explain quantum computing"
                                       "\nassistant:")


def test_a_streamed_chat_sends_the_text_of_each_commit_then_usage_and_done(
    client: openai.OpenAI,
) -> None:
    # given the answer of a request that is not streamed, decoded one token per chunk: 23
    # commits, each a broker hop apart, so the stream's poll sees more than the last one even
    # when a busy machine runs the worker's chunks back to back
    ask = {"model": TEXT_MODEL, "max_tokens": 24, **GREEDY,
           "messages": [{"role": "user", "content": "Tell me a story"}],
           "extra_body": {"stepline": {"params": {"chunk_tokens": 1}}}}
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]

    # when the same request is streamed, its class set by header
    chunks = list(client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Stepline-SLO-Class": "realtime"}))

    # then the pieces, one per commit seen, add up to the same text, and the stream ends well
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and
              c.choices[0].delta.content]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(pieces) >= 2, pieces
    assert "".join(pieces) == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == [whole.choices[0].finish_reason]
    report = (finish[0].model_extra or {})["stepline"]
    assert (report["slo_class"], report["state"]) == ("realtime", "DONE")
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_fixed_length_stream_carries_the_usage_so_far_on_every_chunk(
    client: openai.OpenAI, api: str,
) -> None:
    # when a benchmark client streams with vLLM's fixed-length knobs and continuous usage,
    # sending vLLM's defaults for the extensions Stepline does not serve
    chunks = list(client.chat.completions.create(
        model=TEXT_MODEL, max_tokens=10, stream=True, **GREEDY,
        messages=[{"role": "user", "content": "Tell me a story"}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True, "min_tokens": 10, "top_k": -1,
                    "repetition_penalty": 1.0, "stepline": {"params": {"chunk_tokens": 3}}}))

    # then every chunk carries counts that only grow, up to exactly max_tokens
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages), usages
    generated = [u.completion_tokens for u in usages if u is not None]
    assert generated == sorted(generated) and generated[-1] == 10
    assert chunks[0].choices[0].delta.role == "assistant" and generated[0] >= 1
    # and the job ran with them
    report = next((c.model_extra or {})["stepline"] for c in chunks if c.model_extra and
                  (c.model_extra or {}).get("stepline"))
    job = httpx.get(f"{api}/v1/jobs/{report['job_id']}", headers={"X-API-Key": KEY}).json()
    assert (job["params"]["ignore_eos"], job["params"]["min_new_tokens"]) == (True, 10)


def test_a_legacy_completion_stops_at_the_first_stop_sequence(client: openai.OpenAI) -> None:
    # given the text a prompt makes without a stop sequence
    full = client.completions.create(model=TEXT_MODEL, prompt="Once upon a time",
                                     max_tokens=16, **GREEDY)
    text = full.choices[0].text
    assert len(text) >= 6 and full.usage is not None and full.usage.completion_tokens == 16
    stop = text[len(text) // 2 : len(text) // 2 + 2]

    # when the same request names a stop sequence from its middle
    cut = client.completions.create(model=TEXT_MODEL, prompt="Once upon a time",
                                    max_tokens=16, stop=[stop, "never-there"], **GREEDY)

    # then the text ends just before it, for the reason "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.id.startswith("cmpl-") and cut.object == "text_completion"


@pytest.mark.parametrize("response_format", ["b64_json", "url"])
def test_an_image_generation_answers_with_the_png_inline_or_at_its_result_url(
    client: openai.OpenAI, response_format: str,
) -> None:
    answer = client.images.generate(
        model=IMAGE_MODEL, prompt="a red fox", size="32x32",
        response_format=response_format,  # type: ignore[arg-type]
        extra_body={"stepline": {"params": {"num_inference_steps": 2}}})
    image = answer.data[0] if answer.data else None
    assert image is not None
    if response_format == "b64_json":
        assert image.b64_json is not None and image.url is None
        png = base64.b64decode(image.b64_json)
    else:
        assert image.url is not None and image.url.endswith("/result")
        png = httpx.get(image.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).content
    assert png.startswith(PNG_MAGIC)
    report = (answer.model_extra or {})["stepline"]
    assert (report["state"], report["model"], answer.size) == ("DONE", IMAGE_MODEL, "32x32")


def test_an_image_on_the_class_conditioned_model_takes_a_prompt_naming_an_imagenet_class(
    client: openai.OpenAI, api: str,
) -> None:
    # when the prompt names a class, then the job runs on that class's label
    answer = client.images.generate(
        model="dit-tiny", prompt="golden retriever", size="32x32", response_format="b64_json",
        extra_body={"stepline": {"params": {"num_inference_steps": 2}}})
    assert answer.data and base64.b64decode(answer.data[0].b64_json or "").startswith(PNG_MAGIC)
    job_id = (answer.model_extra or {})["stepline"]["job_id"]
    job = httpx.get(f"{api}/v1/jobs/{job_id}", headers={"X-API-Key": KEY}).json()
    assert job["params"]["class_label"] == 207
    # and a prompt that names none is a 400 naming the closest classes
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="dit-tiny", prompt="golden retreiver")
    assert "'golden retriever'" in refused.value.message


def test_errors_come_in_openais_shape_and_map_to_the_sdks_exceptions(
    client: openai.OpenAI, api: str,
) -> None:
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-17", messages=hello)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as several:
        client.chat.completions.create(model=TEXT_MODEL, messages=hello, n=2)  # type: ignore[arg-type]
    assert several.value.param == "n" and "one choice" in several.value.message
    with pytest.raises(openai.BadRequestError) as wrong_kind:
        client.completions.create(model=IMAGE_MODEL, prompt="hello")
    assert "images/generations" in wrong_kind.value.message
    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model=TEXT_MODEL, messages=hello,  # type: ignore[arg-type]
                                       temperature=3)
    assert hot.value.param == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api}/v1", api_key="nope", max_retries=0).models.list()
    raw = httpx.post(f"{api}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": TEXT_MODEL, "messages": hello, "tools": [{"type": "x"}]})
    assert raw.status_code == 400
    assert raw.json() == {"error": {"message": "tools is not supported by Stepline; leave it "
                                    "unset", "type": "invalid_request_error",
                                    "param": "tools", "code": "unsupported_parameter"}}


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"top_k": 5}, "top_k", "unsupported_parameter"),
    ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ({"guided_regex": "a+"}, "guided_regex", "unsupported_parameter"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", None),
    ({"stream_options": {"sometimes": True}}, "stream_options.sometimes", "unknown_parameter"),
    ({"stepline": {"params": {"ignore_eos": True}}}, "stepline.params.ignore_eos", None),
])
def test_a_parameter_stepline_does_not_serve_is_a_400_naming_it_never_ignored(
    api: str, extra: dict[str, object], param: str, code: str | None,
) -> None:
    body = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}
    answer = httpx.post(f"{api}/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert param.rsplit(".", 1)[-1] in error["message"]


def test_a_client_that_disconnects_mid_stream_cancels_its_job(api: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": TEXT_MODEL, "max_tokens": 1000, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Write a long story"}],
            "stepline": {"params": {"chunk_tokens": 2}}}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as http:
        # given a long streamed job that has started sending text
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            job_id = stream.headers["X-Stepline-Job-Id"]
            for line in stream.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"] \
                        .get("content"):
                    break
        # when the client has gone, then the job stops at its next chunk, CANCELLED
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "CANCELLED", 15,
                 "the abandoned job to be cancelled")
        job = http.get(f"/v1/jobs/{job_id}").json()
    assert job["progress"] < job["total"]



def test_the_cli_prints_a_text_jobs_text_and_with_json_its_whole_result(
    api: str, tmp_path: Path,
) -> None:
    runner = CliRunner()
    env = {"STEPLINE_API_URL": api, "STEPLINE_API_KEY": KEY,
           "STEPLINE_RUN_DIR": str(tmp_path / "run")}
    job = ["submit", "--kind", "text", "--inputs", "hello", "-p", "max_new_tokens=4",
           "-p", f"model={TEXT_MODEL}"]
    try:
        # when a text job is submitted and awaited, then its text is printed after its status
        waited = runner.invoke(cli, [*job, "--wait"], env=env)
        assert waited.exit_code == 0, waited.output
        job_id = waited.output.split()[0]
        status = f"{job_id} DONE in "
        text = waited.output[waited.output.index(status):].split("\n", 1)[1]
        # and `result` prints the same text, and --json the whole result document
        assert runner.invoke(cli, ["result", job_id], env=env).output == text
        document = json.loads(runner.invoke(cli, ["result", job_id, "--json"], env=env).output)
        assert document["output"] + "\n" == text and document["metrics"]["tokens"] == 4
        # and submit --json prints nothing but the result document
        printed = runner.invoke(cli, [*job, "--json"], env=env)
        assert printed.exit_code == 0, printed.output
        assert json.loads(printed.output)["metrics"]["tokens"] == 4
    finally:
        current_settings.cache_clear()  # the CLI loaded this test's environment


def test_a_client_that_gives_up_on_a_non_streamed_answer_cancels_its_job(api: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": TEXT_MODEL, "max_tokens": 1000, **GREEDY,
            "messages": [{"role": "user", "content": "Write a long story"}],
            "stepline": {"params": {"chunk_tokens": 2}}}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as http:
        # given a client whose patience ends long before its job would
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body, timeout=0.5)
        job_id = http.get("/v1/jobs", params={"limit": 1}).json()["jobs"][0]["id"]
        # then the job stops at its next chunk, CANCELLED
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "CANCELLED", 15,
                 "the abandoned job to be cancelled")
        job = http.get(f"/v1/jobs/{job_id}").json()
    assert job["progress"] < job["total"] and job["params"]["max_new_tokens"] == 1000


# image inputs ---------------------------------------------------------------------------------
def _png(side: int, mode: str = "RGB") -> bytes:
    """A PNG of a gradient (not flat), ``side`` pixels square."""
    import io

    from PIL import Image

    image = Image.linear_gradient("L").resize((side, side)).convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("model", [IMAGE_MODEL, "flux-tiny", "sd35-tiny", "flux-kontext-tiny"])
def test_an_image_edit_through_the_sdk_answers_with_a_png_made_from_the_stored_image(
        client: openai.OpenAI, api: str, model: str) -> None:
    # given an input image
    image = _png(32)
    # when the official SDK sends it to images.edit of a model that does img2img (or edits:
    # Flux Kontext), inline answer asked
    answer = client.images.edit(image=("in.png", image, "image/png"), prompt="a red fox",
                                model=model, size="32x32", response_format="b64_json")
    # then the answer is a PNG of the finished job, whose params name the image by digest
    assert answer.data and answer.data[0].b64_json is not None
    assert base64.b64decode(answer.data[0].b64_json).startswith(PNG_MAGIC)
    report = (answer.model_extra or {})["stepline"]
    job = httpx.get(f"{api}/v1/jobs/{report['job_id']}", headers={"X-API-Key": KEY}).json()
    # (an edit model's image conditions every step: it has no strength)
    strength = None if model == "flux-kontext-tiny" else 0.8
    assert (job["state"], job["params"].get("strength")) == ("DONE", strength)
    assert job["params"]["image"].startswith("sha256:")


def test_an_image_edit_with_a_mask_on_a_model_without_inpainting_is_a_400_naming_the_mask(
        client: openai.OpenAI) -> None:
    # given an image and a mask of its size, when the edit goes to a model that does img2img
    # only, then the SDK raises a 400 that says the model takes no mask
    with pytest.raises(openai.BadRequestError, match="takes no mask"):
        client.images.edit(image=("in.png", _png(32), "image/png"), prompt="a fox",
                           mask=("m.png", _png(32, "L"), "image/png"), model=IMAGE_MODEL)


@pytest.mark.parametrize("model", ["flux-tiny", "sd35-tiny", "qwen-image-tiny"])
def test_an_image_edit_with_a_mask_through_the_sdk_inpaints_the_stored_image(
        client: openai.OpenAI, api: str, model: str) -> None:
    # given an input image and a mask of its size by its alpha channel (OpenAI's convention)
    image, mask = _png(32), _png(32, "RGBA")
    # when the official SDK sends both to images.edit of a model that inpaints
    answer = client.images.edit(image=("in.png", image, "image/png"), prompt="a red fox",
                                mask=("m.png", mask, "image/png"), model=model, size="32x32",
                                response_format="b64_json")
    # then the answer is a PNG of the finished job, whose params name image and mask by digest
    assert answer.data and answer.data[0].b64_json is not None
    assert base64.b64decode(answer.data[0].b64_json).startswith(PNG_MAGIC)
    report = (answer.model_extra or {})["stepline"]
    job = httpx.get(f"{api}/v1/jobs/{report['job_id']}", headers={"X-API-Key": KEY}).json()
    assert job["state"] == "DONE"
    assert job["params"]["mask"].startswith("sha256:") and job["params"]["mask"] != \
        job["params"]["image"]


@pytest.mark.parametrize(("mask", "problem"), [
    (_png(16, "L"), "mask: 16x16 is not the image's size"),
    (_png(32), "mask: mode RGB has 3 colour channels"),
])
def test_an_image_edit_with_a_mask_that_does_not_fit_is_a_400_naming_why(
        client: openai.OpenAI, mask: bytes, problem: str) -> None:
    # given an image and a mask of another size or of colour channels, when the edit goes to a
    # model that inpaints, then the SDK raises a 400 that says what is wrong with the mask
    with pytest.raises(openai.BadRequestError, match=problem):
        client.images.edit(image=("in.png", _png(32), "image/png"), prompt="a fox",
                           mask=("m.png", mask, "image/png"), model="flux-tiny")


def test_the_cli_submits_an_inpaint_job_with_image_and_mask_files(api: str,
                                                                  tmp_path: Path) -> None:
    # given an image and a one-channel mask of its size on disk
    (tmp_path / "in.png").write_bytes(_png(32))
    (tmp_path / "m.png").write_bytes(_png(32, "L"))
    env = {"STEPLINE_API_URL": api, "STEPLINE_API_KEY": KEY,
           "STEPLINE_RUN_DIR": str(tmp_path / "run")}
    try:
        # when `stepline submit --image --mask` sends them to a model that inpaints, and waits
        done = CliRunner().invoke(cli, [
            "submit", "--kind", "image", "--prompt", "a fox", "--steps", "2",
            "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "m.png"),
            "-p", "model=sd35-tiny", "-p", "height=32", "-p", "width=32", "--json"], env=env)
    finally:
        current_settings.cache_clear()  # the CLI loaded this test's environment
    # then the job is DONE, its params naming both inputs by digest
    assert done.exit_code == 0, done.output
    record = json.loads(done.output)
    assert record["state"] == "DONE"
    assert record["params"]["mask"].startswith("sha256:")


def test_models_say_which_inputs_each_recipe_takes(client: openai.OpenAI) -> None:
    # when the models are listed, then each says what it takes
    inputs = {m.id: (m.model_extra or {})["stepline"]["inputs"] for m in client.models.list()}
    assert inputs[IMAGE_MODEL] == ["text", "image"]
    assert inputs["qwen-image-tiny"] == ["text", "image", "mask"]
    assert inputs["flux-tiny"] == ["text", "image", "mask"]
    assert inputs["sd35-tiny"] == ["text", "image", "mask", "control_image"]  # its ControlNets
    sd35 = next(m for m in client.models.list() if m.id == "sd35-tiny")
    assert [c["name"] for c in (sd35.model_extra or {})["stepline"]["controlnets"]] == \
        ["tiny-edges"]
    # and an edit model says it cannot run without its image
    kontext = next(m for m in client.models.list() if m.id == "flux-kontext-tiny")
    assert (kontext.model_extra or {})["stepline"]["requires"] == ["text", "image"]
    assert inputs["flux-kontext-tiny"] == ["text", "image"]
    assert inputs["dit-tiny"] == ["class"]
    assert inputs[TEXT_MODEL] == ["text"]
    assert inputs["wan22-i2v-tiny"] == ["text", "image"]  # image-to-video: the first frame
    requires = {m.id: (m.model_extra or {})["stepline"]["requires"] for m in client.models.list()}
    assert requires["wan22-i2v-tiny"] == ["text", "image"] and requires[IMAGE_MODEL] == ["text"]


def test_an_uploaded_input_is_named_by_digest_and_a_json_job_may_carry_it_or_base64(
        api: str) -> None:
    # given an image uploaded as multipart, and the same image as base64 in a job's JSON
    image = _png(32)
    with httpx.Client(base_url=api, headers={"X-API-Key": KEY}, timeout=60) as http:
        stored = http.post("/v1/inputs", files={"file": ("in.png", image, "image/png")})
        inline = http.post("/v1/jobs", json={"kind": "image", "params": {
            "model": IMAGE_MODEL, "prompt": "a boat", "num_inference_steps": 2, "strength": 1.0,
            "image": base64.b64encode(image).decode()}})
        # when a job names the uploaded digest
        named = http.post("/v1/jobs", json={"kind": "image", "params": {
            "model": IMAGE_MODEL, "prompt": "a boat", "num_inference_steps": 2, "strength": 1.0,
            "image": stored.json()["digest"]}})
        # then both jobs are stored naming the one digest, and both finish
        assert stored.status_code == 201, stored.text
        assert (stored.json()["format"], stored.json()["width"]) == ("PNG", 32)
        ids = [r.json()["id"] for r in (inline, named)]
        digests = {http.get(f"/v1/jobs/{i}").json()["params"]["image"] for i in ids}
        assert digests == {stored.json()["digest"]}
        wait_for(lambda: all(http.get(f"/v1/jobs/{i}").json()["state"] == "DONE" for i in ids),
                 120, "both img2img jobs")


def test_an_input_that_is_no_image_is_a_422_and_one_over_the_byte_cap_a_413(api: str) -> None:
    # given bytes that are no image, and an upload over the byte cap
    cap = current_settings().artifacts.input_max_bytes
    with httpx.Client(base_url=api, headers={"X-API-Key": KEY}, timeout=60) as http:
        bad = http.post("/v1/jobs", json={"kind": "image", "params": {
            "model": IMAGE_MODEL, "prompt": "x", "image": base64.b64encode(b"text").decode()}})
        big = http.post("/v1/inputs", files={"file": ("big.png", b"\0" * (cap + 1))})
    # when each is sent, then each refusal names its problem
    assert bad.status_code == 422 and "not a PNG, JPEG or WebP" in bad.json()["detail"]
    assert big.status_code == 413 and "input_max_bytes" in big.json()["detail"]
