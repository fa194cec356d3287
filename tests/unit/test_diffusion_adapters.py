"""LoRA adapters on the diffusion recipes: a job with adapters, preempted and migrated, equals the
diffusers pipeline with the same adapters applied (Wan and SD 3.5 through their pipelines' LoRA
loaders, DiT and PixArt through PEFT on the transformer); adapters switch on a resident base
without a rebuild.

Adapters are made locally with PEFT (random weights); nothing is downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import StableDiffusion3Pipeline, WanPipeline, ZImagePipeline
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file

from tests.unit.test_diffusion_samplers import pipeline_output
from workers.checkpoint import Checkpoint
from workers.diffusion import validate_params
from workers.diffusion.adapters import AdapterRegistry, AdapterSpec
from workers.diffusion.components import (
    DiffusionComponents,
    build_components,
    clear_component_cache,
)
from workers.diffusion.lora import loaded_adapters, make_random_adapter
from workers.diffusion.recipes import diffusion_recipe
from workers.diffusion.runner import DiffusionRunner
from workers.errors import CheckpointError, ParamsError
from workers.runner import BatchItem

pytestmark = pytest.mark.timeout(180)

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tiny": ("image", {"class_label": 207, "scheduler": "dpmpp_2m"}),
    "pixart-tiny": ("image", {"prompt": "A red fox in snow", "negative_prompt": "blurry",
                              "height": 32, "width": 48, "scheduler": "dpmpp_2m"}),
    "wan-tiny": ("video", {"prompt": "waves at dusk", "num_frames": 9, "scheduler": "unipc"}),
    "sd35-tiny": ("image", {"prompt": "a lighthouse", "negative_prompt": "fog",
                            "scheduler": "flow_match_euler"}),
    "zimage-tiny": ("image", {"prompt": "a lighthouse", "negative_prompt": "fog",
                              "guidance_scale": 2.0}),
}
ADAPTERS = {"dit-tiny": ["dit-a"], "pixart-tiny": ["pixart-a", "pixart-b"],
            "wan-tiny": ["wan-a", "wan-b"], "sd35-tiny": ["sd35-a", "sd35-b"],
            "zimage-tiny": ["zimage-a", "zimage-b"]}
STEPS = 4


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> AdapterRegistry:
    folder = tmp_path_factory.mktemp("adapters")
    for model, names in ADAPTERS.items():
        for seed, name in enumerate(names):
            make_random_adapter(diffusion_recipe(model), name, folder, rank=4, alpha=2 + seed,
                                seed=seed)
    return AdapterRegistry(folder)


@pytest.fixture(autouse=True)
def _fresh_models() -> Iterator[None]:
    clear_component_cache()
    yield
    clear_component_cache()


def _params(model: str, registry: AdapterRegistry, adapters: Sequence[tuple[str, float]],
            seed: int = 7) -> dict[str, Any]:
    kind, extra = JOBS[model]
    raw = {"model": model, "seed": seed, "num_inference_steps": STEPS, **extra,
           "adapters": [{"name": name, "scale": scale} for name, scale in adapters]}
    return validate_params(kind, raw, adapters=registry)


def _runner(params: Mapping[str, Any], registry: AdapterRegistry) -> DiffusionRunner:
    kind = "video" if params["num_frames"] > 1 else "image"
    return DiffusionRunner(kind, block_groups=3, adapters=registry)


def _never() -> bool:
    return False


def _yield_once_at(call: int) -> Callable[[], bool]:
    calls = iter(range(10_000))
    return lambda: next(calls) == call


def run_preempted(params: Mapping[str, Any], registry: AdapterRegistry, rng: random.Random
                  ) -> tuple[Checkpoint, DiffusionRunner]:
    """Every chunk through Checkpoint bytes; one stop inside a step, often a "fresh worker"."""
    runner = _runner(params, registry)
    yield_at, index, yields, state = rng.randrange(1, STEPS + 1), 0, 0, None
    while index < STEPS + 1:
        should_yield = _yield_once_at(rng.randrange(2)) if index == yield_at else _never
        result = runner.run_chunk(params, index, state, should_yield)
        state = Checkpoint.decode(result.state.encode())
        if result.complete:
            index += 1
        else:
            yields, yield_at = yields + 1, -1
        if not result.complete or rng.random() < 0.5:
            clear_component_cache()  # resume on a "fresh worker": base and adapters built again
            runner = _runner(params, registry)
    assert yields == 1, "the job never stopped inside a step"
    assert state is not None
    return state, runner


def with_peft_adapters(c: DiffusionComponents, specs: Sequence[tuple[AdapterSpec, float]]
                        ) -> None:
    """PEFT alone on the transformer (DiT and PixArt pipelines have no LoRA loader)."""
    for spec, _ in specs:
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha,
                            target_modules=list(spec.target_modules))
        inject_adapter_in_model(config, c.transformer, adapter_name=spec.name)
        weights = {k.removeprefix("transformer."): v for k, v in
                   load_file(spec.weights_path).items()}
        set_peft_model_state_dict(c.transformer, weights, adapter_name=spec.name)
    for module in c.transformer.modules():
        if isinstance(module, LoraLayer):
            module.set_adapter([spec.name for spec, _ in specs])
            for spec, scale in specs:
                module.set_scale(spec.name, scale)


def reference(params: Mapping[str, Any], registry: AdapterRegistry) -> torch.Tensor:
    """The library's pipeline, uninterrupted, on freshly built modules with the adapters applied
    the library's way: the pipeline's own LoRA loader where it has one, else PEFT."""
    c = build_components(diffusion_recipe(str(params["model"])))
    chosen = [(registry.get(a["name"]), float(a["scale"])) for a in params.get("adapters", [])]
    specs = [(spec, scale) for spec, scale in chosen if spec is not None]
    pipe: Any = None
    if c.recipe.family == "wan":
        pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                           transformer=c.transformer, scheduler=c.scheduler("unipc"))
    elif c.recipe.family == "sd3":
        pipe = StableDiffusion3Pipeline(
            transformer=c.transformer, scheduler=None, vae=c.vae, text_encoder=c.text_encoder,
            tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
            text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3)
    elif c.recipe.family == "zimage":
        pipe = ZImagePipeline(scheduler=None, vae=c.vae, text_encoder=c.text_encoder,
                              tokenizer=c.tokenizer, transformer=c.transformer)
    if pipe is not None:  # the pipeline's own LoRA loader, on the transformer it shares with c
        for spec, _ in specs:
            pipe.load_lora_weights(spec.source_dir, weight_name=spec.weights,
                                   adapter_name=spec.name)
        if specs:
            pipe.set_adapters([spec.name for spec, _ in specs],
                              adapter_weights=[scale for _, scale in specs])
    else:
        with_peft_adapters(c, specs)
    return pipeline_output(c, params)


def _ours(runner: DiffusionRunner, params: Mapping[str, Any], state: Checkpoint) -> torch.Tensor:
    if runner.recipe(params).family == "dit":
        return runner.decode_pixels(params, state)
    return state.tensors["latents"]


CASES = [("dit-tiny", [("dit-a", 1.0)]),
         ("pixart-tiny", [("pixart-a", 0.7), ("pixart-b", -0.4)]),
         ("wan-tiny", [("wan-b", 0.8)]),
         ("wan-tiny", [("wan-a", 1.0), ("wan-b", 0.5)]),
         ("sd35-tiny", [("sd35-a", 0.9), ("sd35-b", -0.5)]),
         ("zimage-tiny", [("zimage-a", 0.9), ("zimage-b", -0.5)])]


@pytest.mark.parametrize(("model", "adapters"), CASES)
def test_a_preempted_migrated_adapter_job_equals_the_pipeline_with_the_same_adapters(
    model: str, adapters: list[tuple[str, float]], registry: AdapterRegistry
) -> None:
    # given a job naming adapters of its model
    params = _params(model, registry, adapters)
    # when it runs chunk by chunk, stopped inside a step and moved between workers
    state, runner = run_preempted(params, registry, random.Random(f"{model}{adapters}"))
    ours = _ours(runner, params, state)
    # then it is bit-identical to the library's pipeline with those adapters applied
    expected = reference(params, registry)
    assert torch.equal(ours, expected)
    # and the adapters changed the output (the comparison is not of two base runs)
    assert not torch.equal(ours, reference({**params, "adapters": []}, registry))


def _run_whole(runner: DiffusionRunner, params: Mapping[str, Any]) -> torch.Tensor:
    state = None
    for index in range(STEPS + 1):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    return _ours(runner, params, state)


def _run_batched(runner: DiffusionRunner, jobs: list[dict[str, Any]]
                 ) -> tuple[list[Any], set[int]]:
    """Every chunk of ``jobs`` through one ``run_batch`` call per step: their final latents,
    and the batch sizes the denoise steps (chunk 1 on) reported."""
    states: list[Any] = [None] * len(jobs)
    sizes: set[int] = set()
    for index in range(STEPS + 1):
        results = runner.run_batch([BatchItem(params=p, index=index, state=s)
                                    for p, s in zip(jobs, states, strict=True)])
        if index > 0:
            sizes.update(r.metrics["batch_size"] for r in results)
        states = [r.state for r in results]
    return [state.tensors["latents"] for state in states], sizes


def test_adapters_switch_on_one_resident_base_without_a_rebuild(registry: AdapterRegistry) -> None:
    # given one runner whose resident PixArt serves jobs with different adapter sets in turn
    runner = _runner(_params("pixart-tiny", registry, []), registry)
    jobs = [_params("pixart-tiny", registry, adapters) for adapters in
            ([("pixart-a", 1.0)], [], [("pixart-b", 0.5), ("pixart-a", 0.25)], [("pixart-a", 1.0)])]
    base = runner.components(jobs[0]).transformer
    # when each job runs to the end on it
    outputs = [_run_whole(runner, params) for params in jobs]
    # then the base module was never rebuilt, each adapter was loaded once onto it
    assert runner.components(jobs[0]).transformer is base
    assert sorted(loaded_adapters(base)) == ["pixart-a", "pixart-b"]
    # and each job's output is the pipeline's with exactly its adapters (none: the base model)
    for params, output in zip(jobs, outputs, strict=True):
        assert torch.equal(output, reference(params, registry))


def test_a_workers_adapter_loads_are_counted_timed_announced_and_advertised(
        registry: AdapterRegistry) -> None:
    """What placement and /metrics read of a diffusion worker's adapters: the heartbeat's
    residency names the adapters on each base and counts their loads and seconds; a chunk that
    loads one announces it (after the first, as long as the last measured adapter load)."""
    from workers.diffusion.components import component_key
    from workers.residency import process_residency

    residency = process_residency()
    told: list[Any] = []
    residency.on_load = lambda: told.append(residency.summary().get("loading"))
    try:
        runner = _runner(_params("pixart-tiny", registry, []), registry)
        before = residency.summary()["adapter_loads"]
        one = _params("pixart-tiny", registry, [("pixart-a", 1.0)])
        runner.transformer(one)
        runner.transformer(one)  # loaded: nothing announced, nothing counted
        runner.transformer(_params("pixart-tiny", registry, [("pixart-b", 0.5),
                                                             ("pixart-a", 1.0)]))
    finally:
        residency.on_load = None
    key = component_key(diffusion_recipe("pixart-tiny"))
    summary = residency.summary()
    assert summary["adapter_loads"] - before == 2 and summary["adapter_load_s"] > 0.0
    assert sorted(summary["adapters"][key]) == ["pixart-a", "pixart-b"]
    assert [r["adapter"] for r in summary["recent"] if r["tier"] == "adapter"][-2:] == [
        "pixart-a", "pixart-b"]
    announced = [t for t in told if t is not None and t["model"] == key]
    assert len(announced) == 3  # the base's build, pixart-a's load, then pixart-b's
    assert announced[2]["expected_s"] > 0.0  # by the adapter loads measured before


def test_jobs_batch_only_with_jobs_of_the_same_adapters_and_scales(
    registry: AdapterRegistry
) -> None:
    # given jobs of one model and shape that differ only in their adapters
    one = _params("pixart-tiny", registry, [("pixart-a", 1.0)])
    runner = _runner(one, registry)
    same = _params("pixart-tiny", registry, [("pixart-a", 1.0)], seed=8)
    scaled = _params("pixart-tiny", registry, [("pixart-a", 0.5)])
    plain = _params("pixart-tiny", registry, [])
    # when their batch keys are taken
    keys = [runner.batch_key(p, 1) for p in (one, same, scaled, plain)]
    # then only jobs of equal adapter sets (names and scales) share one
    assert keys[0] == keys[1]
    assert len({keys[0], keys[2], keys[3]}) == 3


def test_a_batch_of_same_adapter_jobs_matches_their_lone_runs_within_rounding(
    registry: AdapterRegistry
) -> None:
    # given two jobs with the same adapter, run alone and as one batch
    jobs = [_params("pixart-tiny", registry, [("pixart-b", 0.6)], seed=s) for s in (1, 2)]
    runner = _runner(jobs[0], registry)
    alone = [_run_whole(runner, p) for p in jobs]
    # when their chunks run through run_batch together
    latents, sizes = _run_batched(runner, jobs)
    assert sizes == {2}  # every denoise step one forward of both
    # then each job's output is its lone run's, within float rounding of the shared forward
    for out, expected in zip(latents, alone, strict=True):
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def test_unknown_and_misfitting_adapters_are_refused_by_name(registry: AdapterRegistry) -> None:
    # given adapters that are not registered, or made for another model
    # when jobs name them, then the error names the adapter and what fits instead
    with pytest.raises(ParamsError, match=r"unknown adapter 'nope'.*pixart-a, pixart-b"):
        _params("pixart-tiny", registry, [("nope", 1.0)])
    with pytest.raises(ParamsError, match=r"adapter 'wan-a' is made for model 'wan-tiny', "
                                          r"not 'pixart-tiny'"):
        _params("pixart-tiny", registry, [("wan-a", 1.0)])
    with pytest.raises(ParamsError, match=r"adapter 'pixart-a' is named twice"):
        _params("pixart-tiny", registry, [("pixart-a", 1.0), ("pixart-a", 0.5)])


def test_a_job_without_adapters_keeps_its_parameters_as_before(registry: AdapterRegistry) -> None:
    # given a job that names no adapters, when its parameters are validated
    params = _params("pixart-tiny", registry, [])
    # then they carry no adapters key: stored jobs and plans read as before adapters existed
    assert "adapters" not in params


def test_a_checkpoint_refuses_to_resume_under_another_adapter_set(
    registry: AdapterRegistry
) -> None:
    # given a job's state written with one adapter
    params = _params("pixart-tiny", registry, [("pixart-a", 1.0)])
    runner = _runner(params, registry)
    state = Checkpoint.decode(runner.run_chunk(params, 0, None, lambda: False).state.encode())
    # when a chunk of the same job is asked to run under another scale
    other = _params("pixart-tiny", registry, [("pixart-a", 0.5)])
    # then the resume is refused rather than blended
    with pytest.raises(CheckpointError, match="adapters"):
        runner.run_chunk(other, 1, state, lambda: False)


def test_a_registered_adapter_is_seen_without_a_restart(tmp_path: Path) -> None:
    # given a registry over an empty folder that has been read
    registry = AdapterRegistry(tmp_path)
    assert registry.all() == []
    # when an adapter is made into the folder
    make_random_adapter(diffusion_recipe("dit-tiny"), "late", tmp_path)
    # then the registry lists it for its base
    assert registry.for_base("dit-tiny") == ["late"]


def test_an_adapter_replaced_after_submit_fails_the_job_naming_it_rather_than_blending(
    tmp_path: Path
) -> None:
    # given a job accepted with an adapter, and its first chunk run
    registry = AdapterRegistry(tmp_path)
    make_random_adapter(diffusion_recipe("dit-tiny"), "swap", tmp_path, seed=1)
    params = _params("dit-tiny", registry, [("swap", 1.0)])
    runner = _runner(params, registry)
    state = runner.run_chunk(params, 0, None, lambda: False).state
    # when the adapter's weights file is replaced by other weights under the same name
    make_random_adapter(diffusion_recipe("dit-tiny"), "swap", tmp_path, seed=2)
    # then the job's next chunk refuses to run with them, naming the adapter
    with pytest.raises(ParamsError, match="adapter 'swap': its weights file is not the version"):
        runner.run_chunk(params, 1, state, lambda: False)
    # and a job that pins the old version is refused at submit
    pinned = {"name": "swap", "sha256": params["adapters"][0]["sha256"]}
    with pytest.raises(ParamsError, match="adapter 'swap'"):
        validate_params("image", {"model": "dit-tiny", "class_label": 1, "adapters": [pinned]},
                        adapters=registry)


def test_one_batch_call_over_jobs_of_different_adapter_sets_gives_each_its_lone_output(
    registry: AdapterRegistry
) -> None:
    # given jobs of one model and shape with different adapter sets, each run alone first
    jobs = [_params("pixart-tiny", registry, adapters, seed=3) for adapters in
            ([("pixart-a", 1.0)], [], [("pixart-b", 0.5)])]
    runner = _runner(jobs[0], registry)
    alone = [_run_whole(runner, p) for p in jobs]
    # when their chunks go to run_batch together, step by step
    latents, sizes = _run_batched(runner, jobs)
    assert sizes == {1}  # every job its own forward
    # then no forward mixed them: each job's output is bit-identical to its lone run
    for out, expected in zip(latents, alone, strict=True):
        assert torch.equal(out, expected)
