"""Diffusion job parameters: defaults filled from the recipe, errors say what to use instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.diffusion import validate_params
from workers.errors import ParamsError

pytestmark = pytest.mark.timeout(30)


def test_given_a_prompt_when_validated_then_the_text_image_default_is_filled_in() -> None:
    params = validate_params("image", {"prompt": "a cat"})
    assert params["model"] == "pixart-tiny"
    assert (params["height"], params["width"], params["num_frames"]) == (32, 32, 1)
    assert params["scheduler"] == "dpmpp_2m" and params["output_format"] == "png"
    assert params["num_inference_steps"] >= 1 and params["guidance_scale"] > 1


def test_given_a_class_label_when_validated_then_the_class_model_is_chosen() -> None:
    assert validate_params("image", {"class_label": 3})["model"] == "dit-tiny"


def test_given_a_prompt_naming_an_imagenet_class_when_validated_on_dit_then_it_is_the_label(
) -> None:
    # given DiTPipeline's own name -> id map over the same class list
    from diffusers import DiTPipeline

    from workers.diffusion.labels import imagenet_id2label

    pipeline = DiTPipeline(transformer=None, vae=None, scheduler=None,  # type: ignore[arg-type]
                           id2label=imagenet_id2label())
    # when a prompt names a class (in any case), then it is the class diffusers maps it to
    for prompt in ("golden retriever", "Golden Retriever ", "lion"):
        params = validate_params("image", {"model": "dit-tiny", "prompt": prompt})
        assert params["class_label"] == pipeline.get_label_ids([prompt.strip().lower()])[0]
        assert params["prompt"] is None


def test_given_a_prompt_naming_no_class_when_validated_on_dit_then_the_closest_are_named(
) -> None:
    with pytest.raises(ParamsError, match="class-conditioned") as refused:
        validate_params("image", {"model": "dit-tiny", "prompt": "golden retreiver"})
    assert "closest: 'golden retriever', 'Labrador retriever'" in str(refused.value)


def test_given_a_video_prompt_when_validated_then_wan_with_mp4_is_chosen() -> None:
    params = validate_params("video", {"prompt": "waves"})
    chosen = (params["model"], params["num_frames"], params["output_format"])
    assert chosen == ("wan-tiny", 9, "mp4")


@pytest.mark.parametrize(("kind", "raw", "hint"), [
    ("image", {"prompt": "x", "height": 30}, "use 24 or 32"),
    ("image", {"prompt": "x", "width": 1000}, "use 64"),
    ("video", {"prompt": "x", "num_frames": 8}, "use 5 or 9"),
    ("image", {"prompt": "x", "scheduler": "plms2"}, "is unknown .* use one of ddim, ddpm, "),
    ("image", {"class_label": 1, "scheduler": "euler"}, "refused .* init_noise_sigma"),
    ("image", {"prompt": "x", "num_inference_steps": 0}, "use 1 to"),
    ("image", {"class_label": 1, "height": 32, "width": 64}, "32 px images only .*; use 32"),
    ("image", {"model": "dit-tiny", "prompt": "x"}, "pass class_label"),
    ("image", {"model": "wan-tiny", "prompt": "x"}, "kind=video"),
    ("image", {"model": "nope", "prompt": "x"}, "known models"),
    ("image", {"prompt": "x", "output_format": "mp4"}, "png, webp"),
    ("video", {"prompt": "x", "seed": -1}, "seed"),
    ("text", {"prompt": "x"}, "image or video"),
])
def test_given_bad_params_when_validated_then_the_error_says_what_to_use(
    kind: str, raw: dict[str, object], hint: str
) -> None:
    with pytest.raises(ParamsError, match=hint):
        validate_params(kind, raw)


def test_given_the_api_process_when_it_validates_then_torch_is_not_imported() -> None:
    code = ("import sys; from workers.diffusion import validate_params;"
            "validate_params('video', {'prompt': 'x'}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_guidance_scale_2_defaults_to_guidance_scale_on_wan22_and_is_refused_elsewhere() -> None:
    # given a two-expert model (Wan 2.2) and a one-transformer one (Wan 2.1)
    two = {"model": "wan22-tiny", "prompt": "a kite", "guidance_scale": 4.0}
    one = {"model": "wan-tiny", "prompt": "a kite", "guidance_scale": 4.0}
    # when each is validated with and without guidance_scale_2
    defaulted = validate_params("video", two)
    chosen = validate_params("video", {**two, "guidance_scale_2": 2.5})
    plain = validate_params("video", one)
    # then Wan 2.2 takes it (default: guidance_scale, as WanPipeline sets it) ...
    assert defaulted["guidance_scale_2"] == 4.0 and chosen["guidance_scale_2"] == 2.5
    # ... a one-transformer job carries no such key, and asking for it there is refused
    assert "guidance_scale_2" not in plain
    with pytest.raises(ParamsError, match="guidance_scale_2 is for two-expert models"):
        validate_params("video", {**one, "guidance_scale_2": 2.5})
    with pytest.raises(ParamsError, match="guidance_scale_2"):
        validate_params("video", {**two, "guidance_scale_2": 51})


def test_true_cfg_scale_defaults_to_off_on_flux_and_is_refused_where_guidance_is_cfg() -> None:
    # given a guidance-distilled model (Flux) and a classifier-free guided one (PixArt)
    flux = {"model": "flux-tiny", "prompt": "a lighthouse"}
    pixart = {"model": "pixart-tiny", "prompt": "a lighthouse"}
    # when each is validated with and without true_cfg_scale
    defaulted = validate_params("image", flux)
    chosen = validate_params("image", {**flux, "true_cfg_scale": 2.0})
    plain = validate_params("image", pixart)
    # then Flux takes it (default 1: off, as FluxPipeline sets it), its guidance the distilled one
    assert defaulted["true_cfg_scale"] == 1.0 and chosen["true_cfg_scale"] == 2.0
    assert defaulted["guidance_scale"] == 3.5
    # ... another model's job carries no such key, and asking for it there is refused
    assert "true_cfg_scale" not in plain
    with pytest.raises(ParamsError, match="true_cfg_scale is for guidance-distilled models"):
        validate_params("image", {**pixart, "true_cfg_scale": 2.0})
    with pytest.raises(ParamsError, match="true_cfg_scale"):
        validate_params("image", {**flux, "true_cfg_scale": 51})
