"""What an image or video job may take besides its condition, torch-free: the API checks
these (``validate_params``) and lists them (``/v1/models``) without loading a model. The
arithmetic that uses an input image is :mod:`workers.diffusion.conditioning`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workers.errors import ParamsError

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
"""How a job names an input: the SHA-256 of its bytes (the artifact store keeps it by that)."""

IMAGE_FAMILIES = frozenset({"pixart"})
"""Families whose jobs may start from an input image: an ``AutoencoderKL`` VAE whose latents
the transformer denoises directly (no packing, no per-channel statistics)."""
MASK_FAMILIES: frozenset[str] = frozenset()
"""Families that inpaint with a ``mask`` (none yet: a mask is validated and stored, and a job
on a model that does not take one is refused)."""
INPUT_BYTES = "input_bytes"
"""The parameter under which a worker hands a job's chunk the bytes of its inputs (role →
bytes), read from the artifact store by digest; never stored with the job."""
DEFAULT_STRENGTH = 0.8
"""``StableDiffusionImg2ImgPipeline``'s default strength."""


def accepted_inputs(family: str, conditioning: str) -> list[str]:
    """What a model of ``family`` takes: its condition (``text`` or ``class``), then ``image``
    and ``mask`` where it takes them (``/v1/models`` lists these)."""
    inputs = [conditioning]
    if family in IMAGE_FAMILIES:
        inputs.append("image")
    if family in MASK_FAMILIES:
        inputs.append("mask")
    return inputs


def is_conditioned(p: Mapping[str, Any]) -> bool:
    """The job starts from an input image."""
    return p.get("image") is not None


def first_timestep(steps: int, strength: float) -> int:
    """``t_start`` of the img2img strength rule: the scheduler steps a job skips."""
    init = min(int(steps * strength), steps)
    return max(steps - init, 0)


def check_strength(steps: int, strength: float) -> None:
    """A strength that leaves no step (``int(steps * strength) == 0``) is refused, naming the
    smallest that leaves one."""
    if first_timestep(steps, strength) >= steps:
        raise ParamsError(f"strength={strength:g} with num_inference_steps={steps} runs no step "
                          f"(int(steps * strength) is 0); use strength >= {1 / steps:g} or more "
                          "steps")


