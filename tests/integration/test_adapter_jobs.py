"""LoRA adapter jobs on real worker processes: a job with adapters, preempted on one worker and
finished on another, gives byte for byte the artifact of the diffusers pipeline with the same
adapters applied (PixArt: PEFT on its transformer, which its pipeline has no loader for; Wan: its
pipeline's own LoRA loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from diffusers import PixArtSigmaPipeline, WanPipeline

from app.schemas import JobSpec
from scheduler.lifecycle import JobState, SloClass
from tasks.dispatch import release
from tasks.errors import InvalidJob
from tasks.runtime import current_settings
from tasks.store import JobStore
from tasks.submit import JobService
from tests.conftest import Processes, preempt_after, wait_for, wait_for_workers
from tests.integration.test_model_jobs import _artifact, _progress
from tests.unit.test_diffusion_adapters import with_peft_adapters
from workers.diffusion.adapters import AdapterRegistry
from workers.diffusion.artifacts import image_artifact, video_artifact
from workers.diffusion.components import build_components
from workers.diffusion.lora import make_random_adapter
from workers.diffusion.recipes import diffusion_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ADAPTERS_ENV = "STEPLINE_DIFFUSION__ADAPTERS_DIR"
JOBS = {
    "image": {"model": "pixart-tiny", "prompt": "a red fox in snow", "num_inference_steps": 30,
              "seed": 11, "scheduler": "dpmpp_2m", "height": 32, "width": 48,
              "adapters": [{"name": "fox-style", "scale": 0.8},
                           {"name": "fox-light", "scale": -0.3}]},
    "video": {"model": "wan-tiny", "prompt": "waves at dusk", "num_inference_steps": 24,
              "seed": 9, "scheduler": "unipc", "adapters": [{"name": "wave-style", "scale": 0.7}]},
}


@pytest.fixture
def adapter_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   stack_env: dict[str, str]) -> Path:
    """A folder of adapters made locally with PEFT, the one this process's settings name."""
    folder = tmp_path / "adapters"
    for seed, (model, name) in enumerate([("pixart-tiny", "fox-style"),
                                          ("pixart-tiny", "fox-light"),
                                          ("wan-tiny", "wave-style")]):
        make_random_adapter(diffusion_recipe(model), name, folder, rank=4, seed=seed)
    monkeypatch.setenv(ADAPTERS_ENV, str(folder))
    current_settings.cache_clear()
    return folder


def pipeline_artifact(kind: str, params: dict[str, Any], folder: Path) -> bytes:
    """The diffusers pipeline, uninterrupted, with the job's adapters applied the library's way
    (the pipeline's LoRA loader where it has one, else PEFT), encoded as the job's artifact."""
    recipe = diffusion_recipe(str(params["model"]))
    c = build_components(recipe)
    registry = AdapterRegistry(folder)
    chosen = [(registry.get(a["name"]), float(a["scale"])) for a in params["adapters"]]
    specs = [(spec, scale) for spec, scale in chosen if spec is not None]
    generator = torch.Generator().manual_seed(int(params["seed"]))
    common = {"prompt": params["prompt"], "negative_prompt": params["negative_prompt"],
              "height": params["height"], "width": params["width"], "output_type": "pt",
              "num_inference_steps": params["num_inference_steps"], "generator": generator,
              "guidance_scale": params["guidance_scale"],
              "max_sequence_length": recipe.text_max_length}
    scheduler = c.scheduler(str(params["scheduler"]), int(params["seed"]))
    if kind == "video":
        pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                           transformer=c.transformer, scheduler=scheduler)
        for spec, _ in specs:
            pipe.load_lora_weights(spec.source_dir, weight_name=spec.weights,
                                   adapter_name=spec.name)
        pipe.set_adapters([spec.name for spec, _ in specs],
                          adapter_weights=[scale for _, scale in specs])
        frames = pipe(num_frames=params["num_frames"], **common).frames
        fps = current_settings().diffusion.video_fps
        return video_artifact(frames, str(params["output_format"]), fps)[0].data
    with_peft_adapters(c, specs)
    pixart = PixArtSigmaPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                 transformer=c.transformer, scheduler=scheduler)
    images = pixart(use_resolution_binning=False, clean_caption=False, **common).images
    return image_artifact(images, str(params["output_format"])).data


@pytest.mark.parametrize("kind", sorted(JOBS))
def test_a_preempted_adapter_job_finished_on_another_worker_equals_the_pipeline_with_its_adapters(
    processes: Processes, redis_client: redis.Redis, adapter_folder: Path, kind: str
) -> None:
    # given a worker that sees the adapter folder, and a batch job naming adapters of its model
    env = {ADAPTERS_ENV: str(adapter_folder)}
    processes.worker("w1", extra_env=env)
    wait_for_workers(redis_client, ["w1"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    job_id, _ = service.submit(JobSpec(kind=kind, slo=SloClass.BATCH, params=JOBS[kind],  # type: ignore[arg-type]
                                       deadline_s=600))

    # when it is preempted on w1 after a few chunks and released to a fresh worker w2
    preempt_after(store, job_id, 3, timeout_s=60)
    processes.kill("w1")
    processes.worker("w2", extra_env=env)
    wait_for_workers(redis_client, ["w2"])
    release(store, store.record(job_id), queue="batch", by="test", reason="resume elsewhere")

    # then it finishes on w2 with the pipeline's own artifact for the same adapters and seed
    wait_for(lambda: store.state(job_id) is JobState.DONE, 120, "the job to finish on w2")
    assert {e["by"] for e in store.events(job_id) if e["kind"] == "commit"} == {
        "w1@test", "w2@test"}
    assert store.record(job_id).preemptions == 1
    params = store.record(job_id).params
    assert [{"name": a["name"], "scale": a["scale"]} for a in params["adapters"]] == JOBS[kind][
        "adapters"]
    assert _artifact(store, job_id) == pipeline_artifact(kind, params, adapter_folder)


def test_an_adapter_job_whose_worker_is_sigkilled_matches_the_pipeline_with_its_adapters(
    processes: Processes, redis_client: redis.Redis, adapter_folder: Path
) -> None:
    # given an adapter job running on w1, with the scheduler watching the workers
    env = {ADAPTERS_ENV: str(adapter_folder)}
    processes.worker("w1", extra_env=env)
    processes.scheduler()
    wait_for_workers(redis_client, ["w1", "scheduler"])
    service = JobService(JobStore(redis_client), current_settings())
    store = service.store
    long_job = {**JOBS["image"], "num_inference_steps": 60}  # still running when w1 dies
    job_id, _ = service.submit(JobSpec(kind="image", slo=SloClass.BATCH, params=long_job,
                                       deadline_s=600))
    # when w1 is SIGKILLed mid-run and a fresh worker w2 starts
    wait_for(lambda: _progress(store, job_id) >= 4, 60, "four chunks to run on w1")
    processes.kill("w1")
    processes.worker("w2", extra_env=env)
    # then the recovered job finishes on w2 with the pipeline's artifact for its adapters
    wait_for(lambda: store.state(job_id) is JobState.DONE, 120, "the job to finish on w2")
    assert {e["by"] for e in store.events(job_id) if e["kind"] == "commit"} == {
        "w1@test", "w2@test"}
    params = store.record(job_id).params
    assert _artifact(store, job_id) == pipeline_artifact("image", params, adapter_folder)


def test_a_job_naming_an_unknown_or_misfitting_adapter_is_refused_naming_it(
    redis_client: redis.Redis, adapter_folder: Path
) -> None:
    # given the adapter folder, when jobs name an unknown adapter or one of another model
    service = JobService(JobStore(redis_client), current_settings())
    unknown = {**JOBS["image"], "adapters": [{"name": "nope"}]}
    misfit = {**JOBS["image"], "adapters": [{"name": "wave-style"}]}
    # then each is refused with the adapter's name, and nothing is stored
    with pytest.raises(InvalidJob, match="unknown adapter 'nope'"):
        service.submit(JobSpec(kind="image", params=unknown))
    with pytest.raises(InvalidJob, match="adapter 'wave-style' is made for model 'wan-tiny'"):
        service.submit(JobSpec(kind="image", params=misfit))
