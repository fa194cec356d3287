"""The diffusion runner's contract: chunk plan, artifacts per output format, state checks."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.artifacts import to_uint8, video_artifact
from workers.diffusion.blockwise import group_bounds
from workers.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


def _run(kind: str, raw: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    params = validate_params(kind, raw)
    runner = get_runner(kind)
    results, state = [], None
    for index in range(runner.plan(params).num_chunks):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = Checkpoint.decode(result.state.encode())
        results.append(result)
    return params, results


def test_given_a_video_job_when_planned_then_chunks_are_named_and_decode_is_heavy() -> None:
    params = validate_params("video", {"prompt": "x", "num_inference_steps": 3})
    plan = get_runner("video").plan(params)
    assert plan.names == ("encode", "denoise[0]", "denoise[1]", "denoise[2]", "decode")
    assert plan.cost_units[-1] > plan.cost_units[1] > plan.cost_units[0]
    assert plan.cost_key == "wan-tiny:32x32x9"


def test_given_blocks_when_grouped_then_groups_cover_them_in_order() -> None:
    assert group_bounds(4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert group_bounds(2, 8) == [(0, 1), (1, 2)]


def test_given_an_image_job_when_decoded_then_the_png_holds_the_decoded_pixels() -> None:
    params, results = _run("image", {"class_label": 5, "num_inference_steps": 2})
    artifact = results[-1].artifact
    assert artifact is not None
    assert (artifact.media_type, artifact.extension) == ("image/png", "png")
    runner = get_runner("image")
    pixels = runner.decode_pixels(params, results[-2].state)
    png = torch.from_numpy(np.array(Image.open(io.BytesIO(artifact.data))))  # writable copy
    assert torch.equal(png, torch.from_numpy(to_uint8(pixels)[0]))


@pytest.mark.parametrize(("fmt", "media"), [("mp4", "video/mp4"), ("gif", "image/gif"),
                                            ("webp", "image/webp")])
def test_given_frames_when_encoded_then_each_video_format_is_produced(fmt: str, media: str) -> None:
    frames = torch.rand(1, 9, 3, 32, 32)
    artifact, used = video_artifact(frames, fmt)
    assert (used, artifact.media_type) == (fmt, media) and len(artifact.data) > 100
    if fmt == "mp4":
        assert artifact.data[4:8] == b"ftyp"


def test_given_a_state_for_another_chunk_when_run_then_it_is_refused() -> None:
    params, results = _run("image", {"prompt": "x", "num_inference_steps": 1})
    with pytest.raises(CheckpointError, match="chunk 1"):
        get_runner("image").run_chunk(params, 2, results[0].state, lambda: False)


def test_given_a_yield_request_at_every_boundary_then_the_step_still_completes() -> None:
    # given a two-pass (CFG) video step split into 2 groups: three boundaries per step
    params = validate_params("video", {"prompt": "x", "num_inference_steps": 1})
    runner = get_runner("video", block_groups=2)
    state = runner.run_chunk(params, 0, None, lambda: False).state
    # when every boundary asks to yield
    stops = 0
    while True:
        result = runner.run_chunk(params, 1, Checkpoint.decode(state.encode()), lambda: True)
        state = result.state
        if result.complete:
            break
        stops += 1
    # then each call makes one group of progress and the step finishes
    assert stops == 3
    assert state.meta["next_chunk"] == 2 and state.meta["partial"] is None


def test_a_chunks_name_is_its_entry_in_the_plans_names() -> None:
    from workers.diffusion.runner import chunk_name, chunk_names

    for evaluations in (1, 2, 7, 50):
        names = chunk_names(evaluations)
        assert [chunk_name(evaluations, i) for i in range(len(names))] == list(names)
