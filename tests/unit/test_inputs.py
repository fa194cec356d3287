"""A job's input images: checked with Pillow against bounded caps, stored once by content
digest, read back by any worker as the very bytes, so a job resumed elsewhere makes the same
output."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.artifacts import ArtifactStore
from tasks.errors import InvalidJob
from tasks.inputs import (
    InputStore,
    InputTooLarge,
    check_input,
    read_inputs,
    store_inputs,
)
from tasks.settings.artifacts import ArtifactSettings
from tasks.spec import JobSpec
from tests.unit.test_diffusion_img2img import png_bytes
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.components import clear_component_cache
from workers.diffusion.inputs import INPUT_BYTES

LIMITS = ArtifactSettings()


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def job(image: object, mask: object = None, strength: float = 0.5) -> JobSpec:
    params = {"model": "pixart-tiny", "prompt": "a harbour", "num_inference_steps": 4,
              "strength": strength, "image": image}
    return JobSpec(kind="image", params=params | ({} if mask is None else {"mask": mask}))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_png_jpeg_or_webp_input_is_taken_with_its_size_and_mode(fmt: str) -> None:
    # given an RGB image encoded in each taken format, when it is checked
    checked = check_input(encoded(Image.new("RGB", (24, 16), (9, 80, 200)), fmt), "image", LIMITS)
    # then its format, size and mode are read from it
    assert (checked.format, checked.width, checked.height, checked.mode) == (fmt, 24, 16, "RGB")


@pytest.mark.parametrize(("data", "error", "problem"), [
    (b"not an image at all", InvalidJob, "not a PNG, JPEG or WebP"),
    (encoded(Image.new("RGB", (8, 8)), "GIF"), InvalidJob, "GIF images are not taken"),
    (png_bytes(16, 16)[:400], InvalidJob, "does not decode"),
    (encoded(Image.new("L", (300, 300)), "PNG"), InputTooLarge, "input_max_pixels"),
    (png_bytes(64, 64), InputTooLarge, "input_max_bytes"),
])
def test_an_input_that_is_not_a_readable_image_within_the_caps_is_refused_naming_why(
        data: bytes, error: type[Exception], problem: str) -> None:
    # given caps of 1 KiB... 64 Ki pixels and an input that breaks one rule
    limits = ArtifactSettings(input_max_bytes=4096 if problem == "input_max_pixels" else 1024,
                              input_max_pixels=256 * 256)
    # when it is checked, then the refusal names the rule
    with pytest.raises(error, match=problem):
        check_input(data, "image", limits)


def test_the_caps_are_bounded_settings() -> None:
    # given caps outside their bounds, when they are set, then they are refused
    with pytest.raises(ValueError, match="input_max_bytes"):
        ArtifactSettings(input_max_bytes=1 << 30)
    with pytest.raises(ValueError, match="input_max_pixels"):
        ArtifactSettings(input_max_pixels=0)


@pytest.mark.parametrize(("mask", "problem"), [
    (Image.new("L", (16, 8)), "is not the image's size"),
    (Image.new("RGB", (16, 16)), "colour channels"),
])
def test_a_mask_of_another_size_or_of_colour_channels_is_refused(
        tmp_path: Path, mask: Image.Image, problem: str) -> None:
    # given an image and a mask that does not fit it
    image = base64.b64encode(png_bytes(16, 16)).decode()
    spec = job(image, base64.b64encode(encoded(mask, "PNG")).decode())
    # when the job's inputs are stored, then the mask is refused naming why
    with pytest.raises(InvalidJob, match=problem):
        store_inputs(spec, InputStore(ArtifactStore(tmp_path)), LIMITS)


def test_a_base64_input_is_stored_once_by_digest_and_the_job_names_only_the_digest(
        tmp_path: Path) -> None:
    # given the same image sent by two jobs, once as a data URL
    data = png_bytes(16, 16)
    store = InputStore(ArtifactStore(tmp_path))
    plain = base64.b64encode(data).decode()
    # when their inputs are stored
    specs = [store_inputs(job(text), store, LIMITS)
             for text in (plain, "data:image/png;base64," + plain)]
    # then both name one digest, the store holds the bytes once under it
    digest = specs[0].params["image"]
    assert digest == specs[1].params["image"] == check_input(data, "image", LIMITS).digest
    assert [p.name for p in (tmp_path / "inputs").iterdir()] == [digest.removeprefix("sha256:")]
    assert store.read(digest) == data


def test_a_digest_the_store_lacks_or_whose_bytes_changed_is_refused(tmp_path: Path) -> None:
    # given a stored input whose bytes are then altered, and a digest never stored
    store = InputStore(ArtifactStore(tmp_path))
    digest = store_inputs(job(base64.b64encode(png_bytes(16, 16)).decode()), store,
                          LIMITS).params["image"]
    (tmp_path / "inputs" / digest.removeprefix("sha256:")).write_bytes(b"tampered")
    # when each is read back, then each is refused naming the problem
    with pytest.raises(InvalidJob, match="does not hash to its name"):
        store.read(digest)
    with pytest.raises(InvalidJob, match="is not in"):
        store_inputs(job("sha256:" + "0" * 64), store, LIMITS)


def _run(params: dict[str, object], store: InputStore, crash_encode: bool) -> torch.Tensor:
    """The job's pixels, its encode chunk reading the inputs from ``store`` as a worker does;
    with ``crash_encode``, a first worker's encode is lost and a fresh worker reruns it."""
    runner = get_runner("image")
    if crash_encode:
        runner.run_chunk({**params, INPUT_BYTES: read_inputs(store, params)}, 0, None,
                         lambda: False)
        clear_component_cache()
        runner = get_runner("image")
    state = runner.run_chunk({**params, INPUT_BYTES: read_inputs(store, params)}, 0, None,
                             lambda: False).state
    for index in range(1, runner.evaluations(params) + 1):
        clear_component_cache()  # every step on a fresh worker, from the checkpoint's bytes
        state = get_runner("image").run_chunk(params, index, Checkpoint.decode(state.encode()),
                                              lambda: False).state
    return get_runner("image").decode_pixels(params, Checkpoint.decode(state.encode()))


def test_a_job_resumed_on_a_fresh_worker_reads_the_same_input_and_makes_the_same_image(
        tmp_path: Path) -> None:
    # given an img2img job whose image the API stored by digest
    image = np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    spec = store_inputs(job(base64.b64encode(encoded(Image.fromarray(image), "PNG")).decode()),
                        InputStore(ArtifactStore(tmp_path)), LIMITS)
    params = validate_params("image", spec.params)
    # when it runs uninterrupted, and again with its encode crashed and every chunk on a fresh
    # worker, each worker opening the store anew
    whole = _run(params, InputStore(ArtifactStore(tmp_path)), crash_encode=False)
    resumed = _run(params, InputStore(ArtifactStore(str(tmp_path))), crash_encode=True)
    # then the two outputs are the same, bit for bit
    assert torch.equal(whole, resumed)
    assert whole.std() > 0
