"""Model recipes: seeded builds are identical in every process, cached per process, and a
recipe with ``weights:`` loads a local save_pretrained folder instead."""

from __future__ import annotations

import gc
import hashlib
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
import yaml
from diffusers import ClassifierFreeGuidance, StableDiffusion3Pipeline

from tests.unit.diffusion_reference import INPUT_IMAGE_DIGEST, with_inputs
from workers.checkpoint import Checkpoint
from workers.diffusion import get_runner, validate_params
from workers.diffusion.components import (
    _MODULES,
    DiffusionComponents,
    build_components,
    load_components,
)
from workers.diffusion.lora import PIPELINES
from workers.diffusion.recipes import diffusion_recipe, diffusion_recipes
from workers.errors import ModelConfigError
from workers.registry import DEFAULT_MODELS_DIR, ModelRegistry

pytestmark = pytest.mark.timeout(60)

DIGEST = "from tests.unit.test_diffusion_registry import _digest; print(_digest('wan-tiny'))"


def _digest(name: str) -> str:
    c = build_components(diffusion_recipe(name))
    h = hashlib.sha256()
    for m in (c.transformer, c.vae, c.text_encoder):
        for t in m.state_dict().values():
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_every_diffusion_recipe_parses_with_image_and_video_kinds() -> None:
    names = {r.name: r.kind for r in diffusion_recipes("image") + diffusion_recipes("video")}
    assert names == {"dit-tiny": "image", "pixart-tiny": "image", "wan-tiny": "video",
                     "wan22-tiny": "video", "wan22-i2v-tiny": "video", "sd35-tiny": "image",
                     "flux-tiny": "image", "qwen-image-tiny": "image", "zimage-tiny": "image",
                     "flux-kontext-tiny": "image", "flux2-klein-tiny": "image",
                     "hunyuan-video15-tiny": "video"}


def test_given_two_processes_when_they_build_a_recipe_then_the_weights_are_identical() -> None:
    other = subprocess.run([sys.executable, "-c", DIGEST], capture_output=True,
                           text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert other.stdout.strip() == _digest("wan-tiny")


def test_given_a_built_recipe_when_loaded_again_then_the_process_cache_answers() -> None:
    recipe = diffusion_recipe("dit-tiny")
    assert load_components(recipe) is load_components(recipe)


def test_a_registry_made_after_another_is_collected_never_answers_with_its_recipes(
    tmp_path: Path,
) -> None:
    # given many short-lived registries, each naming a different recipe "local" (CPython hands a
    # collected object's address, and so its id(), to the next one of its size)
    families = []
    for i, model in enumerate(["dit-tiny", "pixart-tiny"] * 10):
        spec = yaml.safe_load((DEFAULT_MODELS_DIR / f"{model}.yaml").read_text())
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "local.yaml").write_text(yaml.safe_dump({**spec, "name": "local"}))
        # when each one's "local" is parsed and the registry then dropped
        families.append(diffusion_recipe("local", ModelRegistry(tmp_path / str(i))).family)
        gc.collect()
    # then every registry answered with its own folder's recipe
    assert families == [diffusion_recipe(m).family for m in ["dit-tiny", "pixart-tiny"] * 10]


def test_given_an_unknown_component_class_when_built_then_the_error_names_it(
    tmp_path: Path,
) -> None:
    spec: dict[str, Any] = yaml.safe_load((DEFAULT_MODELS_DIR / "dit-tiny.yaml").read_text())
    spec["transformer"]["class"] = "os.system"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "name": "bad"}))
    with pytest.raises(ModelConfigError, match=r"os\.system"):
        build_components(diffusion_recipe("bad", ModelRegistry(tmp_path)))


def _run_job(params: dict[str, Any], registry: ModelRegistry | None, kind: str = "image"
             ) -> torch.Tensor:
    runner = get_runner(kind, registry=registry)
    state = None
    for index in range(runner.plan(params).num_chunks - 1):  # every chunk but decode
        state = Checkpoint.decode(runner.run_chunk(params, index, state, lambda: False)
                                  .state.encode())
    assert state is not None
    return runner.decode_pixels(params, state)


RECIPES = [r.name for kind in ("image", "video") for r in diffusion_recipes(kind)]
JOBS: dict[str, dict[str, Any]] = {
    "dit-tiny": {"class_label": 207},
    "wan22-tiny": {"prompt": "a kite", "num_inference_steps": 4, "guidance_scale_2": 2.0},
    "wan22-i2v-tiny": {"prompt": "a kite", "num_inference_steps": 4, "guidance_scale_2": 2.0,
                       "image": INPUT_IMAGE_DIGEST},
    "flux-tiny": {"prompt": "a lighthouse", "negative_prompt": "fog", "true_cfg_scale": 2.0},
    "qwen-image-tiny": {"prompt": "a lighthouse", "negative_prompt": "fog",
                        "true_cfg_scale": 2.0},
    "flux-kontext-tiny": {"prompt": "make it dusk", "image": INPUT_IMAGE_DIGEST},
    "hunyuan-video15-tiny": {"prompt": 'a sign "open"', "num_frames": 5},
}
"""A job per recipe (default: a prompt, two steps); Wan 2.2's four steps cross its boundary;
an edit model's and the image-to-video model's with their input image (``with_inputs`` hands
the job its bytes)."""


def save_pipeline(c: DiffusionComponents, folder: Path) -> None:
    """The recipe's modules as its family's diffusers pipeline, written by save_pretrained."""
    cls = getattr(diffusers, PIPELINES[c.recipe.family])
    wanted = inspect.signature(cls.__init__).parameters
    parts = {name: getattr(c, name) for name in wanted
             if name != "scheduler" and getattr(c, name, None) is not None}
    if "boundary_ratio" in wanted and c.recipe.boundary_ratio is not None:
        parts["boundary_ratio"] = c.recipe.boundary_ratio
    if "guider" in wanted:  # HunyuanVideo 1.5's CFG module (the scale is each job's)
        parts["guider"] = ClassifierFreeGuidance(guidance_scale=c.recipe.default_guidance_scale)
    cls(**parts, scheduler=c.scheduler(c.recipe.default_scheduler)).save_pretrained(folder)


def _weights(c: DiffusionComponents) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name in _MODULES if getattr(c, name) is not None
            for key, value in getattr(c, name).state_dict().items()}


@pytest.mark.timeout(180)  # a save, two loads and two runs: 28 s seen on a busy 2-core CPU
@pytest.mark.parametrize("model", RECIPES)
def test_every_recipe_saved_with_save_pretrained_loads_back_and_gives_the_same_output(
    model: str, tmp_path: Path,
) -> None:
    # given the seeded recipe saved as its family's pipeline folder
    c = load_components(diffusion_recipe(model))
    save_pipeline(c, tmp_path / "pipe")
    spec = yaml.safe_load((DEFAULT_MODELS_DIR / f"{model}.yaml").read_text())
    # a different seed: equal outputs prove the weights came from the folder
    spec.update(name="local", seed=999, weights="pipe", default=False)
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(spec))
    local = ModelRegistry(tmp_path)
    kind = c.recipe.kind
    raw = {"num_inference_steps": 2, "seed": 3, **JOBS.get(model, {"prompt": "a lighthouse"})}
    # when the same job runs on both recipes
    loaded = build_components(diffusion_recipe("local", local))
    ours = _run_job(with_inputs(validate_params(kind, {**raw, "model": "local"}, local)), local,
                    kind)
    ref = _run_job(with_inputs(validate_params(kind, {**raw, "model": model})), None, kind)
    # then every module's weights (each text encoder, both experts) and the output are equal
    mine, theirs = _weights(loaded), _weights(c)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(ours, ref) and ours.std() > 0


def test_a_saved_sd35_pipeline_loaded_through_weights_gives_all_three_encoders_and_the_same_image(
    tmp_path: Path,
) -> None:
    # given the seeded SD 3.5 recipe saved by the library as a pipeline folder
    c = load_components(diffusion_recipe("sd35-tiny"))
    StableDiffusion3Pipeline(
        transformer=c.transformer, scheduler=c.scheduler("flow_match_euler"), vae=c.vae,
        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2, text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3,
    ).save_pretrained(tmp_path / "pipe")
    spec = yaml.safe_load((DEFAULT_MODELS_DIR / "sd35-tiny.yaml").read_text())
    # a different seed: equal outputs prove every part came from the folder
    spec.update(name="sd35-local", seed=999, weights="pipe", default=False)
    (tmp_path / "sd35-local.yaml").write_text(yaml.safe_dump(spec))
    local = ModelRegistry(tmp_path)
    # when Stepline loads it back and the same job runs on both recipes
    loaded = build_components(diffusion_recipe("sd35-local", local))
    raw = {"prompt": "a lighthouse", "negative_prompt": "fog", "num_inference_steps": 3,
           "seed": 3}
    ours = _run_job(validate_params("image", {**raw, "model": "sd35-local"}, local), local)
    ref = _run_job(validate_params("image", {**raw, "model": "sd35-tiny"}), None)
    # then every module's weights, every tokenizer's ids and the image are bit-identical
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        a, b = getattr(loaded, part).state_dict(), getattr(c, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    for part in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        assert getattr(loaded, part)("a lighthouse!").input_ids == \
            getattr(c, part)("a lighthouse!").input_ids, part
    assert torch.equal(ours, ref) and ours.std() > 0


@pytest.mark.parametrize(("drop", "message"), [
    ("tokenizer_3", "text_encoder_3 and tokenizer_3 go together"),
    ("text_encoder_2", "text_encoder_2 and tokenizer_2 go together"),
])
def test_a_text_encoder_without_its_tokenizer_is_refused_at_load(
    tmp_path: Path, drop: str, message: str,
) -> None:
    # given the SD 3.5 recipe with one half of an encoder-tokenizer pair left out
    spec = yaml.safe_load((DEFAULT_MODELS_DIR / "sd35-tiny.yaml").read_text())
    del spec[drop]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "name": "bad", "default": False}))
    # when it loads, then it is refused, naming the pair
    with pytest.raises(ModelConfigError, match=message):
        diffusion_recipe("bad", ModelRegistry(tmp_path))


def test_an_sd3_recipe_without_its_t5_runs_as_the_pipeline_without_one(tmp_path: Path) -> None:
    # given the SD 3.5 recipe with its T5 left out (the pipeline conditions on zeros instead)
    spec = yaml.safe_load((DEFAULT_MODELS_DIR / "sd35-tiny.yaml").read_text())
    del spec["text_encoder_3"], spec["tokenizer_3"]
    (tmp_path / "no-t5.yaml").write_text(yaml.safe_dump({**spec, "name": "no-t5",
                                                         "default": False}))
    local = ModelRegistry(tmp_path)
    params = validate_params("image", {"model": "no-t5", "prompt": "a lighthouse", "seed": 3,
                                       "num_inference_steps": 3}, local)
    # when a job runs on it, and the library's pipeline runs on the same modules
    ours = _run_job(params, local)
    c = load_components(diffusion_recipe("no-t5", local))
    assert c.text_encoder_3 is None and c.tokenizer_3 is None
    ref = StableDiffusion3Pipeline(
        transformer=c.transformer, scheduler=c.scheduler("flow_match_euler"), vae=c.vae,
        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
        tokenizer_2=c.tokenizer_2, text_encoder_3=None, tokenizer_3=None,
    )(prompt=params["prompt"], height=params["height"], width=params["width"],
      num_inference_steps=3, guidance_scale=params["guidance_scale"], output_type="pt",
      generator=torch.Generator().manual_seed(3),
      max_sequence_length=c.recipe.text_max_length).images
    # then the image is bit-identical
    assert torch.equal(ours, ref) and ours.std() > 0
