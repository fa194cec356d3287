"""Step-level batching of diffusion jobs: shared forwards that leave each job's own run intact."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.unit.test_diffusion_exactness import INPUT_IMAGE_DIGEST, with_inputs
from workers.checkpoint import Checkpoint
from workers.diffusion import validate_params
from workers.diffusion.batching import batch_groups, decode_together
from workers.diffusion.blockwise import full_forward
from workers.diffusion.components import load_components
from workers.diffusion.families import decode_job
from workers.diffusion.pipelines import ADAPTERS, FAMILIES
from workers.diffusion.recipes import diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.runner import BatchItem, BatchRunner, ChunkResult

pytestmark = pytest.mark.timeout(60)

RELATIVE_TOLERANCE = 1e-4
"""Batched against alone, max |difference| over max |latent|. Measured on CPU after 10 steps: up
to 9e-6 (dit), 4e-7 (pixart), 8e-7 (wan); jobs with CFG (two rows) came out bit-identical, one-row
jobs not, as a lone row takes other matmul kernels than rows inside a batch."""

ENCODE_TOLERANCE = 1e-5
"""Conditioning encoded in a batch against alone, max |difference| over max |value|. Measured on
CPU at 8 jobs: 0 for every family (bit-identical); the tokenizer pads every row to max_length, so
only the matmul kernels of a bigger batch could differ."""

MIN_PSNR_DB = 110.0
"""Pixels decoded in one VAE call with other jobs against alone. Measured on CPU at 8 jobs: at
least 132 dB (dit), 138 dB (pixart), 141 dB (wan), max |difference| 1.2e-6: not bit-identical,
as convolutions over a bigger batch take other kernels; a few uint8 pixels may round apart."""

MIN_ARTIFACT_PSNR_DB = 60.0
"""A PNG of a job encoded and decoded in batches against its lone run's PNG. Measured: the same
PNG (dit, pixart); at 8 jobs a few pixels one uint8 step apart, and one such step in one channel
of one pixel of a 32×32 image is 83 dB."""

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
    "sd35-tiny": ("image", [
        {"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0},
        {"prompt": "a red car", "scheduler": "unipc"},
        {"prompt": "sky", "negative_prompt": "sea"}]),
    "flux-tiny": ("image", [{"model": "flux-tiny", **raw} for raw in (
        {"prompt": "a cat"}, {"prompt": "a dog", "negative_prompt": "fog", "true_cfg_scale": 2.0},
        {"prompt": "a red car", "scheduler": "unipc", "guidance_scale": 5.0}, {"prompt": "sky"})]),
    "zimage-tiny": ("image", [{"model": "zimage-tiny", **raw} for raw in (
        {"prompt": "a cat"}, {"prompt": "a dog", "negative_prompt": "fog", "guidance_scale": 3.0},
        {"prompt": "a red car", "scheduler": "flow_match_lcm", "guidance_scale": 1.0},
        {"prompt": "sky", "negative_prompt": "sea", "guidance_scale": 2.0})]),
    "qwen-image-tiny": ("image", [{"model": "qwen-image-tiny", **raw} for raw in (
        # prompts of one length: their embeddings (unpadded) share a forward
        {"prompt": "a cat"}, {"prompt": "a dog", "negative_prompt": "fog", "true_cfg_scale": 2.0},
        {"prompt": "a car", "scheduler": "unipc"}, {"prompt": "a sky"})]),
    "flux-kontext-tiny": ("image", [  # an edit model: each job with its input image
        {"model": "flux-kontext-tiny", "image": INPUT_IMAGE_DIGEST, **raw} for raw in (
            {"prompt": "a cat"},
            {"prompt": "a dog", "negative_prompt": "fog", "true_cfg_scale": 2.0},
            {"prompt": "a red car", "scheduler": "unipc", "guidance_scale": 5.0},
            {"prompt": "sky"})]),
    "flux2-klein-tiny": ("image", [{"model": "flux2-klein-tiny", **raw} for raw in (
        {"prompt": "a cat"}, {"prompt": "a dog", "negative_prompt": "fog", "guidance_scale": 1.0},
        {"prompt": "a red car", "scheduler": "unipc", "guidance_scale": 5.0},
        {"prompt": "sky", "negative_prompt": "sea"})]),
    "hunyuan-video15-tiny": ("video", [{"model": "hunyuan-video15-tiny", **raw} for raw in (
        {"prompt": "a cat"}, {"prompt": "a dog", "guidance_scale": 1.0},
        {"prompt": 'a sign "open"', "negative_prompt": "fog"}, {"prompt": "sky"})]),
}


def _never() -> bool:
    return False


def _params(kind: str, raw: dict[str, Any], seed: int, steps: int = 2) -> dict[str, Any]:
    return with_inputs(validate_params(kind, {**raw, "seed": seed, "num_inference_steps": steps}))


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


def _psnr_db(a: torch.Tensor, b: torch.Tensor, peak: float = 1.0) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def _png_pixels(result: ChunkResult) -> torch.Tensor:
    assert result.artifact is not None and result.artifact.media_type == "image/png"
    return torch.from_numpy(np.array(Image.open(io.BytesIO(result.artifact.data))))


def _mixed_params(model: str, seed: int, steps: int = 2) -> list[dict[str, Any]]:
    kind, raws = MIXED_JOBS[model]
    return [_params(kind, {"model": model, **raw}, seed=seed + i, steps=steps)
            for i, raw in enumerate(raws)]


def test_a_diffusion_runner_is_a_batch_runner() -> None:
    runner: BatchRunner = DiffusionRunner("image")
    params = _params("image", {"class_label": 1}, seed=0)
    assert runner.batch_key(params, 1) == runner.batch_key(
        _params("image", {"class_label": 9, "scheduler": "pndm", "guidance_scale": 1.0}, 5), 2)
    keys = [runner.batch_key(params, index) for index in (0, 1, 3)]
    assert keys == ["dit-tiny:32x32x1:encode", "dit-tiny:32x32x1", "dit-tiny:32x32x1:decode"]
    assert runner.batch_key(params, 4) is None


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


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny", "wan-tiny", "sd35-tiny",
                                   "flux-tiny", "zimage-tiny", "qwen-image-tiny",
                                   "flux-kontext-tiny", "flux2-klein-tiny",
                                   "hunyuan-video15-tiny"])
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


def test_given_a_lone_encode_and_decode_when_batched_then_they_equal_run_chunk() -> None:
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


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny", "wan-tiny", "sd35-tiny",
                                   "flux-tiny", "zimage-tiny", "qwen-image-tiny",
                                   "flux-kontext-tiny", "flux2-klein-tiny",
                                   "hunyuan-video15-tiny"])
def test_given_jobs_encoded_together_then_conditioning_is_close_and_noise_is_their_own(
        model: str) -> None:
    # given four jobs of one model: CFG on and off, several prompts and schedulers
    kind = MIXED_JOBS[model][0]
    runner = DiffusionRunner(kind)
    params = _mixed_params(model, seed=20)
    # when their encode chunks run as one batch, and each alone
    batched = runner.run_batch([BatchItem(p, 0, None) for p in params])
    alone = [runner.run_chunk(p, 0, None, _never).state for p in params]
    # then each conditioning is the lone one within tolerance, noise and RNG bit-identical
    assert [r.metrics["batch_size"] for r in batched] == [4] * 4
    for result, lone in zip(batched, alone, strict=True):
        b, a = result.state.tensors, lone.tensors
        assert result.state.meta == lone.meta and b.keys() == a.keys()
        for key in (k for k in a if k.startswith("cond.")):
            assert (b[key].dtype, b[key].shape) == (a[key].dtype, a[key].shape)
            difference = float((b[key].double() - a[key].double()).abs().max())
            assert difference <= ENCODE_TOLERANCE * max(float(a[key].abs().max()), 1.0)
        assert torch.equal(b["latents"], a["latents"]) and torch.equal(b["rng"], a["rng"])


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny", "wan-tiny", "sd35-tiny",
                                   "flux-tiny", "zimage-tiny", "qwen-image-tiny",
                                   "flux-kontext-tiny", "flux2-klein-tiny",
                                   "hunyuan-video15-tiny"])
def test_given_final_latents_decoded_together_then_each_job_gets_its_lone_pixels(
        model: str) -> None:
    # given four denoised jobs of one model, CFG on and off
    kind = MIXED_JOBS[model][0]
    runner = DiffusionRunner(kind)
    params = _mixed_params(model, seed=30, steps=1)
    c, family = load_components(diffusion_recipe(model)), FAMILIES[diffusion_recipe(model).family]
    latents = []
    for p in params:
        last = runner.evaluations(p) + 1
        state = _run_alone(runner, p, None, 0, last)
        assert state is not None
        latents.append(state.tensors["latents"])
    # when their latents go through one VAE decode, and each through its own
    with torch.no_grad():
        together = decode_together(family, c, params, latents)
        alone = [decode_job(family, c, p, x) for p, x in zip(params, latents, strict=True)]
    # then each job gets its own pixels, within float32 rounding
    for b, a in zip(together, alone, strict=True):
        assert b.shape == a.shape and float(b.min()) >= 0.0 and float(b.max()) <= 1.0
        assert _psnr_db(b, a) > MIN_PSNR_DB


@pytest.mark.parametrize("model", ["dit-tiny", "pixart-tiny"])
def test_given_a_job_encoded_and_decoded_in_batches_when_denoised_alone_then_its_image_is_close(
        model: str) -> None:
    # given a job encoded together with a partner, then denoised alone on the wire format
    job, first_partner, second_partner = _mixed_params(model, seed=40, steps=3)[:3]
    runner = DiffusionRunner("image")
    encoded = runner.run_batch([BatchItem(job, 0, None), BatchItem(first_partner, 0, None)])
    last = runner.evaluations(job) + 1
    state = _run_alone(runner, job, _wire(encoded[0].state), 1, last)
    partner_last = runner.evaluations(second_partner) + 1
    partner_state = _run_alone(runner, second_partner, None, 0, partner_last)
    # when it is decoded together with another job
    decoded = runner.run_batch([BatchItem(second_partner, partner_last, partner_state),
                                BatchItem(job, last, state)])
    # then it is a valid 32 px PNG close to the job's entirely lone run
    assert [r.metrics["batch_size"] for r in (*encoded, *decoded)] == [2, 2, 2, 2]
    assert decoded[1].metrics["chunk"] == "decode" and decoded[1].state.meta["done"]
    batched = _png_pixels(decoded[1])
    assert batched.shape == (32, 32, 3)
    lone = _png_pixels(runner.run_chunk(job, last, _run_alone(runner, job, None, 0, last), _never))
    assert _psnr_db(batched.float(), lone.float(), peak=255.0) > MIN_ARTIFACT_PSNR_DB


def test_given_encode_denoise_and_decode_items_in_one_call_then_each_kind_batches_apart() -> None:
    # given three pixart jobs to encode, two to denoise and two to decode, interleaved
    runner = DiffusionRunner("image")
    fresh = [_params("image", {"prompt": t}, seed=50 + i) for i, t in enumerate("abc")]
    mid = [_params("image", {"prompt": t}, seed=60 + i) for i, t in enumerate("de")]
    done = [_params("image", {"prompt": t}, seed=70 + i) for i, t in enumerate("fg")]
    last = runner.evaluations(done[0]) + 1
    encode = [BatchItem(p, 0, None) for p in fresh]
    denoise = [BatchItem(p, 1, _run_alone(runner, p, None, 0, 1)) for p in mid]
    decode = [BatchItem(p, last, _run_alone(runner, p, None, 0, last)) for p in done]
    items = [encode[0], denoise[0], decode[0], encode[1], denoise[1], decode[1], encode[2]]
    # when they run as one batch
    results = runner.run_batch(items)
    # then each kind shared its own call, and every result is its item's, in item order
    assert [r.metrics["batch_size"] for r in results] == [3, 2, 2, 3, 2, 2, 3]
    assert [r.metrics["chunk"] for r in results] == [
        "encode", "denoise[0]", "decode", "encode", "denoise[0]", "decode", "encode"]
    by_kind = {0: runner.run_batch(encode), 1: runner.run_batch(denoise),
               last: runner.run_batch(decode)}
    for item, result in zip(items, results, strict=True):
        expected = by_kind[item.index].pop(0)
        assert result.state.meta == expected.state.meta
        assert all(torch.equal(t, expected.state.tensors[k])
                   for k, t in result.state.tensors.items())
        assert (result.artifact is None) == (item.index != last)
        if result.artifact is not None and expected.artifact is not None:
            assert result.artifact.data == expected.artifact.data


def test_given_wan22_jobs_either_side_of_the_boundary_when_batched_then_each_expert_batches_apart(
) -> None:
    # given four Wan 2.2 jobs: two at their first (high-noise) step, two at their third step,
    # past the boundary (4 UniPC steps: t = 999, 900 | 750, 500 against a boundary of 875)
    runner = DiffusionRunner("video")
    raws = [{"prompt": "a kite"}, {"prompt": "a dune", "guidance_scale_2": 2.0},
            {"prompt": "sea", "guidance_scale_2": 3.0}, {"prompt": "sky", "guidance_scale": 1.0}]
    params = [_params("video", {"model": "wan22-tiny", **raw}, seed=70 + i, steps=4)
              for i, raw in enumerate(raws)]
    starts = [1, 1, 3, 3]
    ready = [_run_alone(runner, p, None, 0, start) for p, start in zip(params, starts, strict=True)]
    items = [BatchItem(p, start, s) for p, start, s in zip(params, starts, ready, strict=True)]
    # when their next denoise chunks run as one batch, and each alone
    keys = [runner.batch_key(item.params, item.index) for item in items]
    batched = runner.run_batch(items)
    alone = [_run_alone(runner, p, s, start, start + 1)
             for p, s, start in zip(params, ready, starts, strict=True)]
    # then the high-noise pair and the low-noise pair each shared a forward on its own expert
    assert keys[0] == keys[1] == "wan22-tiny:32x32x9"
    assert keys[2] == keys[3] == "wan22-tiny:32x32x9:transformer_2"
    assert [r.metrics["batch_size"] for r in batched] == [2, 2, 2, 2]
    for result, lone in zip(batched, alone, strict=True):
        assert lone is not None and _relative_error(result.state, lone) < RELATIVE_TOLERANCE
