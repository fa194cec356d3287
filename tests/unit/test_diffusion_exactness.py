"""A chunked, preempted, migrated diffusion job equals the diffusers pipeline run in one go.

Every chunk's state goes through Checkpoint bytes; the job stops once inside a step at a block
boundary and moves to a "fresh worker" (new runner, models rebuilt from the recipe) at random
step boundaries. Outputs are compared with torch.equal: bit-exact, no tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from diffusers import DiTPipeline, PixArtSigmaPipeline, StableDiffusion3Pipeline, WanPipeline

from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.blockwise import full_forward
from workers.diffusion.components import DiffusionComponents, clear_component_cache
from workers.diffusion.pipelines import ADAPTERS
from workers.diffusion.runner import DiffusionRunner

pytestmark = pytest.mark.timeout(120)

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 207, "guidance_scale": 4.0}),
    "pixart-tiny": ("image", {"prompt": "A red fox in snow", "negative_prompt": "blurry",
                              "height": 32, "width": 48}),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "negative_prompt": "static",
                           "num_frames": 9}),
    "wan22-tiny": ("video", {"prompt": "a kite over dunes", "negative_prompt": "static",
                             "num_frames": 9, "guidance_scale": 5.0, "guidance_scale_2": 3.0}),
    "sd35-tiny": ("image", {"prompt": "A lighthouse at dawn", "negative_prompt": "blurry",
                            "height": 64, "width": 96}),
}
CASES = [
    ("dit-tiny", "ddim"), ("dit-tiny", "dpmpp_2m"),
    ("pixart-tiny", "dpmpp_2m"), ("pixart-tiny", "unipc"),
    ("wan-tiny", "unipc"), ("wan-tiny", "flow_match_euler"),
    ("wan22-tiny", "unipc"), ("wan22-tiny", "flow_match_heun"),
    ("sd35-tiny", "flow_match_euler"), ("sd35-tiny", "flow_match_heun"),
]
STEPS = 5


def _params(model: str, scheduler: str, seed: int = 7) -> dict[str, Any]:
    kind, extra = JOBS[model]
    raw = {"model": model, "scheduler": scheduler, "seed": seed, "num_inference_steps": STEPS}
    return validate_params(kind, {**raw, **extra})


def _yield_once_at(call: int) -> Callable[[], bool]:
    calls = iter(range(10_000))
    return lambda: next(calls) == call


def run_preempted_job(params: Mapping[str, Any], rng: random.Random,
                      yield_chunk: int | None = None, crash_chunk: int | None = None
                      ) -> tuple[Checkpoint, DiffusionRunner]:
    """Run every chunk through Checkpoint bytes, yielding once mid-step (in chunk
    ``yield_chunk``, else a random one) and migrating often; chunk ``crash_chunk`` first runs
    on a worker that dies before its result is kept, and reruns from the same checkpoint."""
    kind = "video" if params["num_frames"] > 1 else "image"
    runner = get_runner(kind, block_groups=3)
    evaluations = runner.evaluations(params)
    yield_step = rng.randrange(1, evaluations + 1) if yield_chunk is None else yield_chunk
    state: Checkpoint | None = None
    index, yields = 0, 0
    while index < evaluations + 1:
        should_yield = _yield_once_at(rng.randrange(2)) if index == yield_step else lambda: False
        if index == crash_chunk:
            runner.run_chunk(params, index, state, lambda: False)  # its result is lost
            crash_chunk = None
            clear_component_cache()
            runner = get_runner(kind, block_groups=3)
            state = None if state is None else Checkpoint.decode(state.encode())
        result = runner.run_chunk(params, index, state, should_yield)
        state = Checkpoint.decode(result.state.encode())
        if not result.complete:
            yields += 1
            yield_step = -1  # one mid-step preemption per job
        else:
            index += 1
        if not result.complete or rng.random() < 0.5:
            clear_component_cache()  # resume on a "fresh worker": models rebuilt from the recipe
            runner = get_runner(kind, block_groups=3)
    assert yields == 1, "the job never stopped inside a step"
    assert state is not None
    return state, runner


def _pipeline_latents_and_pixels(c: DiffusionComponents, params: Mapping[str, Any]
                                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(params["seed"]))
    scheduler = c.scheduler(str(params["scheduler"]))
    common = {"num_inference_steps": STEPS, "guidance_scale": params["guidance_scale"],
              "generator": gen}
    if c.recipe.family == "sd3":
        return _sd3_latents_and_pixels(c, params, scheduler, common)
    if c.recipe.family == "dit":
        pipe = DiTPipeline(transformer=c.transformer, vae=c.vae, scheduler=scheduler)
        return None, pipe(class_labels=[params["class_label"]], output_type="pt", **common).images
    captured: dict[str, torch.Tensor] = {}
    if c.recipe.family == "pixart":
        pipe = PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                   transformer=c.transformer, scheduler=scheduler)
        pixels = pipe(
            prompt=params["prompt"], negative_prompt=params["negative_prompt"],
            height=params["height"], width=params["width"], output_type="pt",
            use_resolution_binning=False, clean_caption=False,
            max_sequence_length=c.recipe.text_max_length,
            callback=lambda i, t, lat: captured.update(latents=lat.clone()), **common,
        ).images
        return captured["latents"], pixels

    def keep(_p: Any, _i: int, _t: Any, kw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        captured["latents"] = kw["latents"].clone()
        return {}

    experts: dict[str, Any] = {}
    if c.transformer_2 is not None:  # Wan 2.2: the low-noise expert, its boundary and guidance
        experts = {"transformer_2": c.transformer_2, "boundary_ratio": c.recipe.boundary_ratio}
        common["guidance_scale_2"] = params["guidance_scale_2"]
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                       transformer=c.transformer, scheduler=scheduler, **experts)
    frames = pipe(
        prompt=params["prompt"], negative_prompt=params["negative_prompt"],
        height=params["height"], width=params["width"], num_frames=params["num_frames"],
        output_type="pt", max_sequence_length=c.recipe.text_max_length,
        callback_on_step_end=keep, **common,
    ).frames
    return captured["latents"], frames


def _sd3_latents_and_pixels(c: DiffusionComponents, params: Mapping[str, Any], scheduler: Any,
                            common: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """StableDiffusion3Pipeline run in one go: its last latents and its pixels."""
    captured: dict[str, torch.Tensor] = {}

    def keep(_p: Any, _i: int, _t: Any, kw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        captured["latents"] = kw["latents"].clone()
        return {}

    pipe = StableDiffusion3Pipeline(
        transformer=c.transformer, scheduler=scheduler, vae=c.vae,
        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2, text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3)
    pixels = pipe(
        prompt=params["prompt"], negative_prompt=params["negative_prompt"],
        height=params["height"], width=params["width"], output_type="pt",
        max_sequence_length=c.recipe.text_max_length, callback_on_step_end=keep, **common,
    ).images
    return captured["latents"], pixels


def _boundary_chunks(params: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """A two-expert job's first chunk on ``transformer_2`` and its last on ``transformer``
    (both inside the run), else (None, None)."""
    runner = get_runner("video")
    if not runner.recipe(params).two_experts:
        return None, None
    experts = [runner._planned_expert(params, i) for i in range(1, runner.evaluations(params) + 1)]
    first_low = experts.index("transformer_2") + 1
    assert 1 < first_low <= len(experts), "the boundary must fall inside the run"
    return first_low, first_low - 1


@pytest.mark.parametrize(("model", "scheduler"), CASES)
def test_preempted_migrated_job_equals_uninterrupted_pipeline(model: str, scheduler: str) -> None:
    # given a job and the library's own pipeline built from the same recipe
    params = _params(model, scheduler)
    rng = random.Random(f"{model}/{scheduler}")
    # when the job runs chunk by chunk, preempted inside a step and moved between workers
    # and one chunk lost to a crash and rerun (a two-expert job: preempted inside the first
    # low-noise step, its last high-noise step crashed)
    yield_chunk, crash_chunk = _boundary_chunks(params)
    if crash_chunk is None:  # one transformer: a random denoise chunk lost to a crash, rerun
        crash_chunk = rng.randrange(1, STEPS)
    final_state, runner = run_preempted_job(params, rng, yield_chunk, crash_chunk)
    pixels = runner.decode_pixels(params, final_state)
    # then latents and decoded pixels are bit-identical to the uninterrupted pipeline
    ref_latents, ref_pixels = _pipeline_latents_and_pixels(runner.components(params), params)
    if ref_latents is not None:
        assert torch.equal(final_state.tensors["latents"], ref_latents)
    assert pixels.shape == ref_pixels.shape
    assert torch.equal(pixels, ref_pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


@pytest.mark.parametrize("model", sorted(JOBS))
def test_blockwise_forward_equals_the_models_own_forward(model: str) -> None:
    # given the transformer inputs of the first step of a job
    kind, extra = JOBS[model]
    params = validate_params(kind, {"model": model, **extra})
    runner = get_runner(kind)
    state = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    job = runner._restore(params, 1, state)
    progress = runner._start_step(params, job)
    c = runner.components(params)
    models = [c.transformer] if c.transformer_2 is None else [c.transformer, c.transformer_2]
    for model, inputs in ((m, x) for m in models for x in progress.inputs):
        # when the adapter runs prologue, every block and epilogue (of each expert)
        with torch.no_grad():
            ours = full_forward(ADAPTERS[c.recipe.family], model, inputs)
            kwargs = dict(inputs)
            if c.recipe.family == "pixart":
                kwargs["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
            theirs = model(**kwargs, return_dict=False)[0]
        # then it is bit-identical to the model's forward
        assert torch.equal(ours, theirs)
