"""Step-level batching of diffusion jobs: shared forwards that leave each job's own run intact."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from PIL import Image

from workers.checkpoint import Checkpoint
from workers.diffusion import validate_params
from workers.diffusion.batching import batch_groups
from workers.diffusion.blockwise import ADAPTERS, full_forward
from workers.diffusion.components import load_components
from workers.diffusion.recipes import diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.runner import BatchItem, BatchRunner, ChunkResult

pytestmark = pytest.mark.timeout(60)

RELATIVE_TOLERANCE = 1e-4
"""Batched against alone, max |difference| over max |latent|. Measured on CPU after 10 steps: up
to 9e-6 (dit), 4e-7 (pixart), 8e-7 (wan); jobs with CFG (two rows) came out bit-identical, one-row
jobs not, as a lone row takes other matmul kernels than rows inside a batch."""

MIXED_JOBS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "dit-tiny": ("image", [
        {"class_label": 1}, {"class_label": 7, "guidance_scale": 1.0},
        {"class_label": 3, "scheduler": "dpmpp_2m"}, {"class_label": 9, "scheduler": "unipc"}]),
    "pixart-tiny": ("image", [
        {"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0},
        {"prompt": "a red car", "scheduler": "euler"}, {"prompt": "sky", "scheduler": "ddim"}]),
    "wan-tiny": ("video", [
        {"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0},
        {"prompt": "a red car", "scheduler": "flow_match_euler"}, {"prompt": "sky"}]),
}


def _never() -> bool:
    return False


def _params(kind: str, raw: dict[str, Any], seed: int, steps: int = 2) -> dict[str, Any]:
    return validate_params(kind, {**raw, "seed": seed, "num_inference_steps": steps})


def _wire(state: Checkpoint) -> Checkpoint:
    """The state as the next worker reads it: through bytes."""
    return Checkpoint.decode(state.encode())


def _run_alone(runner: DiffusionRunner, params: dict[str, Any], state: Checkpoint | None,
               start: int, stop: int) -> Checkpoint | None:
    for index in range(start, stop):
        state = _wire(runner.run_chunk(params, index, state, _never).state)
    return state


def _batched_until_done(runner: DiffusionRunner, jobs: list[tuple[dict[str, Any], int]],
                        states: list[Checkpoint]) -> tuple[list[Checkpoint], list[ChunkResult]]:
    """Every job's remaining denoise chunks, one batched call per tick; jobs are (params, next)."""
    states, cursors, seen = list(states), [nxt for _, nxt in jobs], []
    while pending := [j for j, (p, _) in enumerate(jobs) if cursors[j] <= runner.evaluations(p)]:
        items = [BatchItem(jobs[j][0], cursors[j], states[j]) for j in pending]
        for j, result in zip(pending, runner.run_batch(items), strict=True):
            states[j], cursors[j] = _wire(result.state), cursors[j] + 1
            seen.append(result)
    return states, seen


def _relative_error(batched: Checkpoint, alone: Checkpoint) -> float:
    a, b = alone.tensors["latents"], batched.tensors["latents"]
    return float((a - b).abs().max() / a.abs().max())


def test_a_diffusion_runner_is_a_batch_runner() -> None:
    runner: BatchRunner = DiffusionRunner("image")
    params = _params("image", {"class_label": 1}, seed=0)
    assert runner.batch_key(params, 0) is None and runner.batch_key(params, 3) is None
    assert runner.batch_key(params, 1) == runner.batch_key(
        _params("image", {"class_label": 9, "scheduler": "pndm", "guidance_scale": 1.0}, 5), 2)


def test_given_keys_when_grouped_then_groups_keep_order_and_respect_max_batch() -> None:
    keys = ["a", "b", None, "a", "a", None, "b", "a"]
    assert batch_groups(keys, 8) == [[0, 3, 4, 7], [1, 6], [2], [5]]
    assert batch_groups(keys, 3) == [[0, 3, 4], [7], [1, 6], [2], [5]]


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny", "wan-tiny"])
def test_given_integer_or_float_timesteps_when_run_then_the_forward_is_identical(
        model: str) -> None:
    # given the model's own inputs with an int64 timestep
    c = load_components(diffusion_recipe(model))
    gen = torch.Generator().manual_seed(0)
    cfg = c.transformer.config
    if model == "dit-tiny":
        inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=gen),
                  "class_labels": torch.tensor([3, 1000])}
    elif model == "pixart-tiny":
        inputs = {"hidden_states": torch.randn(2, 4, 8, 8, generator=gen),
                  "encoder_hidden_states": torch.randn(2, 16, cfg.caption_channels, generator=gen),
                  "encoder_attention_mask": torch.ones(2, 16, dtype=torch.int64)}
    else:
        inputs = {"hidden_states": torch.randn(2, 16, 3, 4, 4, generator=gen),
                  "encoder_hidden_states": torch.randn(2, 16, cfg.text_dim, generator=gen)}
    adapter, ints = ADAPTERS[c.recipe.family], torch.tensor([666, 333])
    # when the timestep joins a batch as float32 (as batching does)
    with torch.no_grad():
        as_int = full_forward(adapter, c.transformer, {**inputs, "timestep": ints})
        as_float = full_forward(adapter, c.transformer, {**inputs, "timestep": ints.float()})
    # then the model embeds it the same
    assert torch.equal(as_int, as_float)


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny", "wan-tiny"])
def test_given_mixed_jobs_when_batched_then_each_stays_close_to_its_alone_run(model: str) -> None:
    # given four jobs: CFG on and off, three schedulers, one a step ahead of the others
    kind, raws = MIXED_JOBS[model]
    runner = DiffusionRunner(kind)
    params = [_params(kind, raw, seed=10 + i) for i, raw in enumerate(raws)]
    encoded = [_run_alone(runner, p, None, 0, 1) for p in params]
    starts = [1, 1, 1, 2]
    ready = [_run_alone(runner, p, s, 1, start) for p, s, start in zip(
        params, encoded, starts, strict=True)]
    assert all(s is not None for s in ready)
    # when the rest of their denoise chunks run batched, and separately alone
    batched, results = _batched_until_done(
        runner, list(zip(params, starts, strict=True)), [s for s in ready if s is not None])
    alone = [_run_alone(runner, p, s, start, runner.evaluations(p) + 1)
             for p, s, start in zip(params, ready, starts, strict=True)]
    # then the first tick shared one forward, and every job stays within float32 noise
    assert [r.metrics["batch_size"] for r in results[:4]] == [4, 4, 4, 4]
    assert {r.metrics["chunk"] for r in results[:4]} == {"denoise[0]", "denoise[1]"}
    for b, a in zip(batched, alone, strict=True):
        assert a is not None and b.meta["next_chunk"] == a.meta["next_chunk"]
        assert _relative_error(b, a) < RELATIVE_TOLERANCE


def test_given_the_same_items_when_batched_twice_then_the_results_are_bit_identical() -> None:
    # given three pixart jobs at their first denoise chunk
    runner = DiffusionRunner("image")
    raws = MIXED_JOBS["pixart-tiny"][1][:3]
    params = [_params("image", raw, seed=i) for i, raw in enumerate(raws)]
    items = [BatchItem(p, 1, _run_alone(runner, p, None, 0, 1)) for p in params]
    # when the same items run batched twice
    first, second = runner.run_batch(items), runner.run_batch(items)
    # then every tensor of every state is the same, bit for bit
    for a, b in zip(first, second, strict=True):
        assert a.state.meta == b.state.meta and a.state.tensors.keys() == b.state.tensors.keys()
        assert all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors)


def test_given_a_member_with_a_partial_step_when_batched_then_it_runs_alone_exactly() -> None:
    # given a job that yielded inside its first step, and two fresh jobs of the same shape
    runner = DiffusionRunner("image", block_groups=2)
    params = [_params("image", {"class_label": i}, seed=i) for i in range(3)]
    states = [_run_alone(runner, p, None, 0, 1) for p in params]
    partial = runner.run_chunk(params[0], 1, states[0], lambda: True)
    assert not partial.complete
    states[0] = _wire(partial.state)
    # when all three run batched
    results = runner.run_batch([BatchItem(p, 1, s) for p, s in zip(params, states, strict=True)])
    # then the partial one finished alone, exactly as run_chunk finishes it
    expected = runner.run_chunk(params[0], 1, states[0], _never).state
    assert torch.equal(results[0].state.tensors["latents"], expected.tensors["latents"])
    assert [r.metrics["batch_size"] for r in results] == [1, 2, 2]
    assert all(r.complete for r in results)


def test_given_encode_and_decode_items_when_batched_then_they_equal_run_chunk() -> None:
    # given a job to encode, a job to decode and two denoise chunks between them
    runner = DiffusionRunner("image")
    fresh, done = (_params("image", {"prompt": t}, seed=3) for t in ("new", "old"))
    last = runner.evaluations(done) + 1
    denoised = _run_alone(runner, done, None, 0, last)
    mid = [_params("image", {"prompt": "mid"}, seed=s) for s in (4, 5)]
    mid_states = [_run_alone(runner, p, None, 0, 1) for p in mid]
    items = [BatchItem(fresh, 0, None), BatchItem(mid[0], 1, mid_states[0]),
             BatchItem(done, last, denoised), BatchItem(mid[1], 1, mid_states[1])]
    # when they run as one batch
    results = runner.run_batch(items)
    # then encode and decode are what run_chunk gives, and only the denoise chunks shared
    encoded = runner.run_chunk(fresh, 0, None, _never).state
    assert all(torch.equal(results[0].state.tensors[k], t) for k, t in encoded.tensors.items())
    decoded = runner.run_chunk(done, last, denoised, _never).artifact
    assert results[2].artifact is not None and decoded is not None
    assert results[2].artifact.data == decoded.data
    assert [r.metrics["batch_size"] for r in results] == [1, 2, 1, 2]
    assert [r.metrics["chunk"] for r in results] == ["encode", "denoise[0]", "decode",
                                                     "denoise[0]"]


def test_given_a_job_batched_then_alone_when_decoded_then_the_image_is_valid() -> None:
    # given a pixart job and a partner, its first step batched, the rest alone on the wire format
    runner = DiffusionRunner("image")
    job, partner = (_params("image", {"prompt": t}, seed=s, steps=3) for t, s in (("a", 1),
                                                                                  ("b", 2)))
    states = [_run_alone(runner, p, None, 0, 1) for p in (job, partner)]
    first = runner.run_batch([BatchItem(job, 1, states[0]), BatchItem(partner, 1, states[1])])
    assert first[0].metrics["batch_size"] == 2
    # when the job finishes alone and is decoded
    last = runner.evaluations(job) + 1
    state = _run_alone(runner, job, _wire(first[0].state), 2, last)
    result = runner.run_chunk(job, last, state, _never)
    # then it is a 32 px PNG close to the job's entirely alone run
    assert result.artifact is not None and result.artifact.media_type == "image/png"
    assert Image.open(io.BytesIO(result.artifact.data)).size == (32, 32)
    alone = _run_alone(runner, job, None, 0, last)
    assert state is not None and alone is not None
    assert _relative_error(state, alone) < RELATIVE_TOLERANCE


def test_given_more_jobs_than_max_batch_when_batched_then_they_split_in_order() -> None:
    # given five jobs of one key and a cap of two per forward
    runner = DiffusionRunner("image", max_batch=2)
    params = [_params("image", {"class_label": i}, seed=i, steps=1) for i in range(5)]
    items = [BatchItem(p, 1, _run_alone(runner, p, None, 0, 1)) for p in params]
    # when they run batched
    results = runner.run_batch(items)
    # then they ran as two pairs and a single, each pair the same as batched on its own
    assert [r.metrics["batch_size"] for r in results] == [2, 2, 2, 2, 1]
    pair = runner.run_batch(items[2:4])
    assert all(torch.equal(a.state.tensors["latents"], b.state.tensors["latents"])
               for a, b in zip(results[2:4], pair, strict=True))
