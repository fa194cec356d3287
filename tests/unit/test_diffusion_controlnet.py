"""A ControlNet job (SD 3.5 with an ``SD3ControlNetModel``), chunked, preempted inside a step,
crash-resumed and migrated, equals ``StableDiffusion3ControlNetPipeline`` (called in
``diffusion_reference``) run in one go on the same tiny modules, bit for bit; its ControlNet is
a residency item of its own; its parameters are checked and batched by ControlNet.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.unit.diffusion_reference import (
    CONTROL_CALLS,
    CONTROL_IMAGE_DIGEST,
    INPUT_IMAGE_DIGEST,
    reference_run,
    with_inputs,
)
from tests.unit.test_diffusion_batching import _batched_until_done, _relative_error, _run_alone
from tests.unit.test_diffusion_exactness import JOBS, run_preempted_job, run_uninterrupted_job
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.blockwise import full_forward
from workers.diffusion.components import clear_component_cache
from workers.diffusion.pipelines import ADAPTERS
from workers.diffusion.recipes import CONTROLNET_FAMILIES, diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.sd3_controlnet import (
    CONTROL_KEY,
    SAMPLE_PREFIX,
    build_controlnet,
    controlnet_key,
    load_controlnet,
)
from workers.errors import ModelConfigError, ParamsError
from workers.registry import ModelRegistry
from workers.residency import process_residency

pytestmark = pytest.mark.timeout(300)

MODEL, CONTROLNET = "sd35-tiny", "tiny-edges"
STEPS = 5
CASES = [
    (MODEL, "flow_match_euler", {}),
    (MODEL, "flow_match_heun", {}),
    (
        MODEL,
        "flow_match_euler",
        {
            "controlnet_conditioning_scale": 0.6,
            "control_guidance_start": 0.2,
            "control_guidance_end": 0.7,
            "guidance_scale": 1.0,
        },
    ),
]
"""Model, sampler and ControlNet settings: the defaults (CFG on), a second-order sampler (one
denoise chunk per evaluation, as the pipeline's ``controlnet_keep`` counts them), and a scale
with a guidance window that drops the first and last steps, without CFG."""
WAYS = ("uninterrupted", "preempted, migrated and crash-resumed")


def control_params(
    model: str = MODEL, scheduler: str = "flow_match_euler", seed: int = 7, **extra: Any
) -> dict[str, Any]:
    _, job, _ = JOBS[model]
    raw = {
        **job,
        "model": model,
        "scheduler": scheduler,
        "seed": seed,
        "num_inference_steps": STEPS,
        "controlnet": CONTROLNET,
        "control_image": CONTROL_IMAGE_DIGEST,
        **extra,
    }
    return with_inputs(validate_params("image", raw))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("model", "scheduler", "extra"), CASES)
def test_a_controlnet_job_run_any_way_equals_the_librarys_controlnet_pipeline(
    model: str, scheduler: str, extra: dict[str, Any], way: str
) -> None:
    # given a ControlNet job and the library's ControlNet pipeline on the same modules
    params = control_params(model, scheduler, **extra)
    rng = random.Random(f"{model}/{scheduler}/{sorted(extra)}")
    # when it runs in one go, or chunk by chunk through checkpoint bytes, stopped inside a
    # step, a chunk lost to a crash and rerun, moved between fresh workers
    if way == WAYS[0]:
        state, runner = run_uninterrupted_job(params)
    else:
        crash = rng.randrange(1, get_runner("image").evaluations(params) + 1)
        state, runner = run_preempted_job(params, rng, crash_chunk=crash)
    pixels = runner.decode_pixels(params, state)
    # then its latents and pixels equal the pipeline's, bit for bit
    ref = reference_run(runner.components(params), params)
    assert torch.equal(state.tensors["latents"], ref.latents)
    assert torch.equal(pixels, ref.pixels)
    assert pixels.std() > 0, "a constant output would make the comparison vacuous"


def test_the_controlnet_and_its_image_change_the_output() -> None:
    # given one prompt and seed: without a ControlNet, with it, and at scale 0
    base = {**JOBS[MODEL][1], "model": MODEL, "seed": 3, "num_inference_steps": 3}
    plain = with_inputs(validate_params("image", base))
    controlled = control_params(seed=3, num_inference_steps=3)
    zero = control_params(seed=3, num_inference_steps=3, controlnet_conditioning_scale=0.0)
    # when each runs to the end
    outputs = []
    for params in (plain, controlled, zero):
        state, runner = run_uninterrupted_job(params)
        outputs.append(runner.decode_pixels(params, state))
    # then the ControlNet changed the image, and at scale 0 its residuals add nothing
    assert not torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0], outputs[2])


def test_a_checkpoint_carries_the_control_latents_and_a_mid_step_one_the_samples() -> None:
    # given a ControlNet job's encode chunk and its first step stopped after one block group
    params = control_params()
    runner = get_runner("image", block_groups=3)
    encoded = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    stopped = runner.run_chunk(params, 1, encoded, lambda: True)
    decoded = Checkpoint.decode(stopped.state.encode())
    # then the encoded control image is in the conditioning (CFG: two rows of latents) and the
    # stopped step holds the controlnet's block samples in its pass inputs
    assert not stopped.complete
    assert encoded.tensors[f"cond.{CONTROL_KEY}"].shape == (2, 16, 8, 12)
    samples = [k for k in decoded.tensors if k.startswith(f"partial.in.0.{SAMPLE_PREFIX}")]
    assert len(samples) == 2  # the ControlNet's two blocks


def test_the_blockwise_forward_with_block_samples_equals_the_transformers_own() -> None:
    # given the first step's transformer inputs of a ControlNet job
    params = control_params()
    runner = get_runner("image")
    state = runner.run_chunk(params, 0, None, lambda: False).state
    inputs = runner._start_step(params, runner._restore(params, 1, state)).inputs[0]
    c = runner.components(params)
    samples = [inputs[f"{SAMPLE_PREFIX}{i}"] for i in range(2)]
    plain = {k: v for k, v in inputs.items() if not k.startswith(SAMPLE_PREFIX)}
    # when the adapter runs it, and the transformer with block_controlnet_hidden_states
    with torch.no_grad():
        ours = full_forward(ADAPTERS["sd3"], c.transformer, inputs)
        theirs = c.transformer(**plain, block_controlnet_hidden_states=samples, return_dict=False)[
            0
        ]
        without = c.transformer(**plain, return_dict=False)[0]
    # then they are bit-identical, and the samples changed the output
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, without)


def test_the_controlnet_is_a_residency_item_of_its_own_loaded_on_demand() -> None:
    # given a fresh worker that ran a job without a ControlNet
    clear_component_cache()
    residency = process_residency()
    plain = with_inputs(
        validate_params("image", {**JOBS[MODEL][1], "model": MODEL, "num_inference_steps": 2})
    )
    run_uninterrupted_job(plain)
    recipe = diffusion_recipe(MODEL)
    key = controlnet_key(recipe, CONTROLNET, "cpu")
    assert residency.tier_of(key) == "disk"
    # when a ControlNet job runs
    run_uninterrupted_job(control_params(num_inference_steps=2))
    # then the ControlNet is held under its own key, its bytes measured, evictable alone
    assert residency.tier_of(key) == "device"
    size = residency.summary()["device"][key]
    module = load_controlnet(get_runner("image").components(plain), CONTROLNET)
    assert size == sum(
        t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
    )
    residency.forget(key)
    assert residency.tier_of(key) == "disk"


def test_a_controlnet_loads_from_a_local_save_pretrained_folder(tmp_path: Path) -> None:
    # given the tiny ControlNet written with save_pretrained, and a recipe naming it by weights:
    recipe = diffusion_recipe(MODEL)
    seeded = build_controlnet(recipe, CONTROLNET).module
    seeded.save_pretrained(tmp_path / "controlnet")
    spec = yaml.safe_load((Path("configs/models") / f"{MODEL}.yaml").read_text())
    spec["controlnets"] = {"local-edges": {"weights": "controlnet"}}
    (tmp_path / "sd35-local.yaml").write_text(yaml.safe_dump({**spec, "name": "sd35-local"}))
    local = diffusion_recipe("sd35-local", ModelRegistry(tmp_path))
    # when it is built from the folder
    loaded = build_controlnet(local, "local-edges").module
    # then its weights are the seeded ones, its key names the folder's content, and it differs
    # from the seeded one's key only by that
    for (name, a), (_, b) in zip(
        seeded.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert controlnet_key(local, "local-edges", "cpu") != controlnet_key(recipe, CONTROLNET, "cpu")
    # and a job naming it makes what the same job on the seeded ControlNet makes
    registry, runs = ModelRegistry(tmp_path), []
    for model, name, reg in (("sd35-local", "local-edges", registry), (MODEL, CONTROLNET, None)):
        raw = {
            **JOBS[MODEL][1],
            "model": model,
            "num_inference_steps": 2,
            "controlnet": name,
            "control_image": CONTROL_IMAGE_DIGEST,
        }
        params = with_inputs(validate_params("image", raw, registry=reg))
        runner = DiffusionRunner("image", registry=reg)
        state = None
        for index in range(runner.evaluations(params) + 1):
            state = runner.run_chunk(params, index, state, lambda: False).state
        assert state is not None
        runs.append(runner.decode_pixels(params, state))
    assert torch.equal(runs[0], runs[1])
    shutil.rmtree(tmp_path / "controlnet")
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        build_controlnet(local, "local-edges")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"controlnet": "nope", "control_image": CONTROL_IMAGE_DIGEST}, "use one of tiny-edges"),
        ({"controlnet": CONTROLNET}, "pass both"),
        ({"control_image": CONTROL_IMAGE_DIGEST}, "pass both"),
        (
            {
                "controlnet": CONTROLNET,
                "control_image": CONTROL_IMAGE_DIGEST,
                "control_guidance_start": 0.5,
                "control_guidance_end": 0.4,
            },
            "act on no step",
        ),
        (
            {
                "controlnet": CONTROLNET,
                "control_image": CONTROL_IMAGE_DIGEST,
                "controlnet_conditioning_scale": 11,
            },
            "less than or equal to 10",
        ),
        ({"controlnet": CONTROLNET, "control_image": "sha256:nothex"}, "control_image"),
        (
            {
                "controlnet": CONTROLNET,
                "control_image": CONTROL_IMAGE_DIGEST,
                "image": INPUT_IMAGE_DIGEST,
            },
            "takes no image",
        ),
    ],
)
def test_bad_controlnet_parameters_are_refused_naming_the_problem(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ParamsError, match=message):
        validate_params("image", {**JOBS[MODEL][1], "model": MODEL, **extra})


def test_a_control_image_on_a_model_without_controlnets_is_refused() -> None:
    _, job, _ = JOBS["flux-tiny"]
    with pytest.raises(ParamsError, match="has no ControlNets"):
        validate_params(
            "image", {**job, "model": "flux-tiny", "control_image": CONTROL_IMAGE_DIGEST}
        )


def test_controlnet_jobs_batch_only_with_their_own_controlnet() -> None:
    # given a ControlNet job, one of another scale, and one without a ControlNet
    runner = get_runner("image")
    keys = [
        runner.batch_key(p, 1)
        for p in (
            control_params(),
            control_params(controlnet_conditioning_scale=0.5, seed=9),
            with_inputs(
                validate_params(
                    "image", {**JOBS[MODEL][1], "model": MODEL, "num_inference_steps": STEPS}
                )
            ),
        )
    ]
    # then the ControlNet jobs share a key (the scale is each job's own residual), the plain
    # job does not
    assert keys[0] == keys[1] != keys[2]


def test_every_controlnet_family_has_a_pipeline_call() -> None:
    assert set(CONTROL_CALLS) == CONTROLNET_FAMILIES


def test_two_controlnet_jobs_batched_stay_close_to_their_alone_runs() -> None:
    # given two ControlNet jobs of one model, shape and ControlNet, other seeds and scales
    runner = DiffusionRunner("image")
    params = [control_params(seed=5), control_params(seed=6, controlnet_conditioning_scale=0.5)]
    encoded = [_run_alone(runner, p, None, 0, 1) for p in params]
    assert all(s is not None for s in encoded)
    # when their denoise chunks run batched, and separately alone
    batched, results = _batched_until_done(
        runner, [(p, 1) for p in params], [s for s in encoded if s is not None]
    )
    alone = [
        _run_alone(runner, p, s, 1, runner.evaluations(p) + 1)
        for p, s in zip(params, encoded, strict=True)
    ]
    # then they shared forwards, and each ends within float32 noise of its alone run
    assert {r.metrics["batch_size"] for r in results} == {2}
    for b, a in zip(batched, alone, strict=True):
        assert a is not None and b.meta["next_chunk"] == a.meta["next_chunk"]
        assert _relative_error(b, a) < 1e-4
