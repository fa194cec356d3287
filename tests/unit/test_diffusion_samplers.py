"""Every sampler a recipe offers resumes bit-exactly; every other diffusers scheduler is refused.

The exactness runs put every chunk's state through Checkpoint bytes (safetensors + JSON), stop
once inside a model evaluation at a block-group boundary, rebuild the models from the recipe
there (a "fresh worker"), and reseed the process-wide RNG before every chunk, so a sampler that
drew from it instead of the job's generator would differ. The reference is the diffusers
pipeline run in one go with the same seed; outputs are compared with torch.equal.
"""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import diffusers
import diffusers.schedulers
import numpy as np
import pytest
import torch
import yaml
from diffusers.schedulers import KarrasDiffusionSchedulers

from tests.unit.diffusion_reference import INPUT_IMAGE_DIGEST, reference_run, with_inputs
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, samplers, validate_params
from workers.diffusion.components import DiffusionComponents, clear_component_cache
from workers.diffusion.recipes import DiffusionRecipe, diffusion_recipe, diffusion_recipes
from workers.diffusion.runner import DiffusionRunner
from workers.diffusion.samplers import (
    COMMON_SAMPLERS,
    SCHEDULERS,
    Exact,
    Refused,
    sampler_refusal,
)
from workers.diffusion.scheduler_state import copy_scheduler, save_scheduler_state
from workers.errors import CheckpointError, ModelConfigError, ParamsError
from workers.registry import DEFAULT_MODELS_DIR, ModelRegistry

pytestmark = pytest.mark.timeout(120)

STEPS = 4
RECIPES = [*diffusion_recipes("image"), *diffusion_recipes("video")]
PAIRS = [(r.name, name) for r in RECIPES for name in r.schedulers]
JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 207, "guidance_scale": 4.0}),
    "pixart-tiny": ("image", {"prompt": "A red fox in snow", "negative_prompt": "blurry",
                              "height": 24, "width": 40}),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "negative_prompt": "static",
                           "num_frames": 5, "height": 16, "width": 32}),
    "wan22-tiny": ("video", {"prompt": "a kite over dunes", "negative_prompt": "static",
                             "num_frames": 5, "height": 16, "width": 32, "guidance_scale_2": 2.0}),
    "wan22-i2v-tiny": ("video", {"prompt": "a kite over dunes", "negative_prompt": "static",
                                 "num_frames": 5, "height": 16, "width": 32,
                                 "guidance_scale_2": 2.0, "image": INPUT_IMAGE_DIGEST}),
    "sd35-tiny": ("image", {"prompt": "A lighthouse at dawn", "negative_prompt": "blurry",
                            "height": 32, "width": 64}),
    "flux-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                            "true_cfg_scale": 1.5}),
    "qwen-image-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                                  "true_cfg_scale": 1.5}),
    "zimage-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog"}),
    "flux-kontext-tiny": ("image", {"prompt": "make it dusk", "negative_prompt": "fog",
                                    "true_cfg_scale": 1.5, "image": INPUT_IMAGE_DIGEST}),
    "flux2-klein-tiny": ("image", {"prompt": "a lighthouse at dawn", "negative_prompt": "fog",
                                   "guidance_scale": 2.0}),
    "hunyuan-video15-tiny": ("video", {"prompt": 'a sign that reads "open"',
                                       "negative_prompt": "static", "num_frames": 5,
                                       "height": 16, "width": 32}),
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread, as workers run (torch_threads: 1): on a shared 2-core machine two
    threads per process thrash and these tiny steps take tens of times longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def exported_scheduler_classes() -> set[str]:
    """Every ``*Scheduler`` diffusers exports, at the top level or from ``diffusers.schedulers``."""
    names = {n for module in (diffusers, diffusers.schedulers) for n in dir(module)
             if n.endswith("Scheduler") and not n.startswith("_")}
    return names | {member.name for member in KarrasDiffusionSchedulers}


def _params(model: str, scheduler: str, seed: int, **overrides: Any) -> dict[str, Any]:
    kind, extra = JOBS[model]
    raw = {"model": model, "scheduler": scheduler, "seed": seed, "num_inference_steps": STEPS}
    return with_inputs(validate_params(kind, {**raw, **extra, **overrides}))


def _yield_once_at(call: int) -> Callable[[], bool]:
    calls = iter(range(10_000))
    return lambda: next(calls) == call


def run_preempted(params: Mapping[str, Any], rng: random.Random) -> tuple[Checkpoint,
                                                                          DiffusionRunner]:
    """Every chunk from Checkpoint bytes on a fresh runner; one stop inside a model evaluation,
    after which the models are rebuilt; the global RNG reseeded before every chunk."""
    kind = "video" if params["num_frames"] > 1 else "image"
    runner = get_runner(kind, block_groups=3)
    last = runner.plan(params).num_chunks - 1
    yield_at = rng.randrange(1, last)
    state: Checkpoint | None = None
    index, yields = 0, 0
    while index < last:
        torch.manual_seed(rng.randrange(2**31))
        stop = _yield_once_at(rng.randrange(2)) if index == yield_at else (lambda: False)
        result = runner.run_chunk(params, index, state, stop)
        state = Checkpoint.decode(result.state.encode())
        if result.complete:
            index += 1
        else:
            yields, yield_at = yields + 1, -1
            clear_component_cache()  # the rest runs on a "fresh worker"
        runner = get_runner(kind, block_groups=3)
    assert yields == 1, "the job never stopped inside a model evaluation"
    assert state is not None
    return state, runner


def _passing_generator(scheduler: Any, gen: torch.Generator) -> Any:
    """DiTPipeline and WanPipeline call ``step`` without their generator, so a stochastic sampler
    would draw from the process RNG; the reference hands it over, as PixArtSigmaPipeline does."""
    if "generator" in inspect.signature(scheduler.step).parameters:
        scheduler.step = functools.partial(type(scheduler).step, scheduler, generator=gen)
    return scheduler


def pipeline_output(c: DiffusionComponents, params: Mapping[str, Any]) -> torch.Tensor:
    """The library pipeline, uninterrupted: final latents, or pixels where it hands out no
    latents (DiT, HunyuanVideo 1.5)."""
    ref = reference_run(c, params, _passing_generator)
    return ref.pixels if ref.latents is None else ref.latents


def assert_equals_pipeline(params: Mapping[str, Any], seed: str) -> None:
    state, runner = run_preempted(params, random.Random(seed))
    ref = pipeline_output(runner.components(params), params)
    # DiT and HunyuanVideo 1.5 hand out no latents: their pixels are compared
    ours = (runner.decode_pixels(params, state)
            if runner.recipe(params).family in ("dit", "hunyuan_video15")
            else state.tensors["latents"])
    assert ours.shape == ref.shape
    assert torch.equal(ours, ref)
    assert ours.std() > 0, "a constant output would make the comparison vacuous"


@pytest.mark.parametrize(("model", "scheduler"), PAIRS)
def test_every_offered_sampler_resumes_to_the_pipelines_own_output(
    model: str, scheduler: str
) -> None:
    # given a job of this recipe and sampler, and the diffusers pipeline as the reference
    params = _params(model, scheduler, seed=11)
    # when it runs chunk by chunk, preempted inside a model evaluation and moved between workers
    # then its output is bit-identical to the pipeline's uninterrupted output
    assert_equals_pipeline(params, f"{model}/{scheduler}")


def run_hot(params: Mapping[str, Any], rng: random.Random) -> tuple[Checkpoint,
                                                                    DiffusionRunner]:
    """Every chunk on one runner from the previous chunk's own Checkpoint object, as a worker
    continuing the job does: the runner resumes from the live state riding on it (each one
    taken once), with one stop inside a model evaluation; the global RNG reseeded before
    every chunk."""
    kind = "video" if params["num_frames"] > 1 else "image"
    runner = get_runner(kind, block_groups=3)
    last = runner.plan(params).num_chunks - 1
    yield_at = rng.randrange(1, last)
    state: Checkpoint | None = None
    index = 0
    while index < last:
        torch.manual_seed(rng.randrange(2**31))
        stop = _yield_once_at(rng.randrange(2)) if index == yield_at else (lambda: False)
        assert state is None or state.live is not None
        result = runner.run_chunk(params, index, state, stop)
        assert state is None or state.live is None, "the live state is taken once"
        state = result.state
        index, yield_at = (index + 1, yield_at) if result.complete else (index, -1)
    assert state is not None
    return state, runner


@pytest.mark.parametrize(("model", "scheduler"), PAIRS)
def test_every_offered_sampler_resumed_from_its_live_state_equals_the_pipeline(
    model: str, scheduler: str
) -> None:
    # given a job run on one worker, each chunk resuming from the state the last one left
    params = _params(model, scheduler, seed=5)
    state, runner = run_hot(params, random.Random(f"hot/{model}/{scheduler}"))
    # then its output is bit-identical to the pipeline's, as the resume from bytes is
    ref = pipeline_output(runner.components(params), params)
    # DiT and HunyuanVideo 1.5 hand out no latents: their pixels are compared
    ours = (runner.decode_pixels(params, state)
            if runner.recipe(params).family in ("dit", "hunyuan_video15")
            else state.tensors["latents"])
    assert torch.equal(ours, ref) and ours.std() > 0


def test_every_diffusers_scheduler_class_is_run_exactly_or_refused_with_a_reason() -> None:
    # given every scheduler class diffusers exports
    exported = exported_scheduler_classes()
    # then each is in the table: exact, or refused with a reason
    missing = sorted(exported - SCHEDULERS.keys())
    assert not missing, f"new diffusers schedulers to classify in samplers.py: {missing}"
    assert not SCHEDULERS.keys() - exported, "the table names classes diffusers no longer has"
    offered = {spec.class_name for r in RECIPES for spec in r.schedulers.values()}
    for name, support in SCHEDULERS.items():
        if isinstance(support, Refused):
            assert len(support.reason) > 20, name
        else:
            # and an exact class is offered by a recipe, so the exactness test above covers it
            assert name in offered, f"{name} is marked exact but no recipe offers it"


@pytest.mark.parametrize("class_name", sorted(n for n, s in SCHEDULERS.items()
                                              if isinstance(s, Exact)))
def test_each_exact_class_is_described_as_the_library_builds_it(class_name: str) -> None:
    support = SCHEDULERS[class_name]
    assert isinstance(support, Exact)
    scheduler = getattr(diffusers, class_name)()
    scheduler.set_timesteps(STEPS)
    init_sigma = float(getattr(scheduler, "init_noise_sigma", 1.0))
    assert (init_sigma == 1.0) == support.unit_init_noise
    params = inspect.signature(type(scheduler).__init__).parameters
    for key in (support.seeded, support.step_limit_key):
        assert key is None or key in params
    fresh = vars(getattr(diffusers, class_name)())
    for attr in support.derived:
        assert attr in fresh
        # one the class builds lazily draws from a source the job's seed fixes
        assert fresh[attr] is not None or support.seeded is not None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_common_sampler_a_recipe_lacks_is_refused_at_submit_with_the_reason(
    recipe: DiffusionRecipe,
) -> None:
    kind, extra = JOBS[recipe.name]
    for name in sorted(COMMON_SAMPLERS.keys() - recipe.schedulers.keys()):
        reason = sampler_refusal(recipe.family, name)
        assert reason is not None, f"{recipe.name} could offer {name}: add it to the recipe"
        with pytest.raises(ParamsError) as caught:
            validate_params(kind, {"model": recipe.name, "scheduler": name, **extra})
        message = str(caught.value)
        assert reason in message and "use one of" in message


def test_dit_refuses_sigma_space_samplers_because_its_pipeline_never_scales_the_noise() -> None:
    with pytest.raises(ParamsError, match="init_noise_sigma, which DiTPipeline never applies"):
        validate_params("image", {"model": "dit-tiny", "class_label": 1, "scheduler": "heun"})


def test_wan_refuses_a_ddpm_sampler_and_names_the_flow_ones() -> None:
    with pytest.raises(ParamsError, match=r"flow-matching model.*flow_match_euler"):
        validate_params("video", {"prompt": "x", "scheduler": "euler_a"})


def test_hunyuan_video15_offers_its_pipelines_own_euler_and_refuses_another_sampler() -> None:
    assert set(diffusion_recipe("hunyuan-video15-tiny").schedulers) == {"flow_match_euler"}
    with pytest.raises(ParamsError, match="HunyuanVideo15Pipeline ships FlowMatchEuler"):
        validate_params("video", {"model": "hunyuan-video15-tiny", "prompt": "x",
                                  "scheduler": "unipc"})


def test_a_second_order_sampler_plans_one_chunk_per_model_evaluation() -> None:
    # given a 5-step Heun job (two model evaluations per step but the first)
    params = validate_params("image", {"prompt": "x", "scheduler": "heun",
                                       "num_inference_steps": 5})
    # when planned
    plan = get_runner("image").plan(params)
    # then it has 2·5 − 1 denoise chunks, each a full denoise cost
    assert plan.names[1:-1] == tuple(f"denoise[{i}]" for i in range(9))
    assert plan.cost_units[1:-1] == (1.0,) * 9
    pndm = validate_params("image", {"prompt": "x", "scheduler": "pndm",
                                     "num_inference_steps": 5})
    assert get_runner("image").plan(pndm).num_chunks == 1 + 6 + 1


def test_lcm_refuses_more_steps_than_its_original_schedule_has() -> None:
    with pytest.raises(ParamsError, match="use 1 to 50"):
        validate_params("image", {"prompt": "x", "scheduler": "lcm", "num_inference_steps": 60})


@pytest.mark.parametrize(("model", "scheduler", "height", "width"), [
    ("pixart-tiny", "kdpm2_a", 64, 16),
    ("pixart-tiny", "dpmpp_sde", 56, 48),
    ("wan-tiny", "flow_match_heun", 48, 32),
    ("flux-tiny", "dpmpp_2m", 64, 16),  # a shift mu of another size than the default's
    ("zimage-tiny", "flow_match_lcm", 16, 64),
    ("flux2-klein-tiny", "dpmpp_2m", 64, 16),  # Flux.2's mu of another size than the default's
])
def test_non_square_and_non_native_sizes_resume_exactly(
    model: str, scheduler: str, height: int, width: int
) -> None:
    params = _params(model, scheduler, seed=5, height=height, width=width)
    assert_equals_pipeline(params, f"{model}/{height}x{width}")


def test_dit_offers_its_native_size_only_and_says_so() -> None:
    assert validate_params("image", {"class_label": 1})["height"] == 32
    with pytest.raises(ParamsError, match=r"makes 32 px images only.*use 32"):
        validate_params("image", {"class_label": 1, "height": 64, "width": 64})


def test_a_recipe_offering_a_refused_scheduler_does_not_load(tmp_path: Path) -> None:
    spec: dict[str, Any] = yaml.safe_load((DEFAULT_MODELS_DIR / "pixart-tiny.yaml").read_text())
    spec["schedulers"]["fast"] = {"class": "DDIMParallelScheduler"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "name": "bad"}))
    with pytest.raises(ModelConfigError, match="'fast' is refused: DDIMParallelScheduler"):
        diffusion_recipe("bad", ModelRegistry(tmp_path))


def test_a_scheduler_outside_the_exact_table_is_never_checkpointed() -> None:
    scheduler = diffusers.DDIMParallelScheduler()
    with pytest.raises(CheckpointError, match="cannot be checkpointed exactly"):
        save_scheduler_state(scheduler, diffusers.DDIMParallelScheduler())


def test_a_sampler_whose_package_is_missing_is_set_aside_and_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given a machine without torchsde
    monkeypatch.setattr(samplers, "package_available", lambda name: name != "torchsde")
    spec = yaml.safe_load((DEFAULT_MODELS_DIR / "pixart-tiny.yaml").read_text())
    (tmp_path / "pixart-here.yaml").write_text(yaml.safe_dump({**spec, "name": "pixart-here"}))
    registry = ModelRegistry(tmp_path)
    # when the recipe loads, then its other samplers stay offered
    recipe = diffusion_recipe("pixart-here", registry)
    assert "dpmpp_sde" not in recipe.schedulers and "heun" in recipe.schedulers
    # and a job asking for it is refused at submit, saying what to install
    with pytest.raises(ParamsError, match="needs the torchsde package; pip install torchsde"):
        validate_params("image", {"model": "pixart-here", "prompt": "x",
                                  "scheduler": "dpmpp_sde"}, registry)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and (a.dtype, a.shape, a.device) == (b.dtype, b.shape,
                b.device) and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_value(x, y) for x, y in zip(a, b, strict=True)))
    if inspect.isfunction(a):  # SA-Solver's tau_func: the same lambda of its constructor
        return inspect.isfunction(b) and a.__code__ is b.__code__
    return a is b or bool(a == b)


def assert_same_state(a: Any, b: Any) -> None:
    assert vars(a).keys() == vars(b).keys()
    for key, value in vars(a).items():
        assert _same_value(value, vars(b)[key]), key


@pytest.mark.parametrize(("model", "scheduler"), PAIRS)
def test_a_chunk_resumes_on_a_copy_of_the_baseline_that_shares_nothing_a_step_changes(
    model: str, scheduler: str
) -> None:
    # given the job's baseline scheduler (shared by every chunk of every job like it)
    params = _params(model, scheduler, seed=3)
    runner = get_runner(JOBS[model][0])
    c, family = runner.components(params), runner._family(params)
    baseline = runner._baseline(params)
    fresh = c.scheduler(scheduler, 3)
    family.set_timesteps(c, fresh, STEPS)
    # when a copy of it takes steps, drawing noise
    twin = copy_scheduler(baseline)
    assert_same_state(twin, fresh)
    gen = torch.Generator().manual_seed(0)
    sample = family.init_latents(c, params, twin, gen)
    shape = sample.shape
    for t in twin.timesteps[:3]:
        sample = family.step(twin, torch.randn(shape, generator=gen), t, sample, gen)
    # then the baseline still equals a freshly built, freshly set-up scheduler
    assert_same_state(baseline, fresh)
