"""Every scheduler class diffusers exports, and what a job may do with it: run it exactly across
preemption and workers, or be refused at submit with the reason.

Torch-free: the API checks a job's sampler against this table without loading a model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Space(str, Enum):
    """What a model predicts, and so which schedules can step it."""

    DDPM = "ddpm"
    """Noise (epsilon) on diffusers' discrete variance-preserving schedule, timesteps 0–999."""
    FLOW = "flow"
    """A flow-matching velocity on sigmas in [0, 1]."""


@dataclass(frozen=True, slots=True)
class Exact:
    """A scheduler whose whole runtime state fits a checkpoint, so a job resumes bit-exactly.

    Every random draw it makes comes from the job's generator (``step(generator=…)``, restored from
    the checkpoint) or from a source seeded by the job's seed (``seeded``).
    """

    spaces: frozenset[Space]
    """The model kinds it steps; a DDPM scheduler steps a flow model only when configured with
    ``use_flow_sigmas: true`` and ``prediction_type: flow_prediction``."""
    unit_init_noise: bool = True
    """False for sigma-space (k-diffusion) schedules whose initial noise is scaled to
    ``init_noise_sigma`` > 1."""
    needs: str | None = None
    """An optional package the class imports (diffusers exports a placeholder without it)."""
    seeded: str | None = None
    """A config key the runner binds to the job's seed (the class draws no generator noise)."""
    derived: tuple[str, ...] = ()
    """Attributes left out of the checkpoint because a fresh scheduler of the same config derives
    them: in its constructor (SA-Solver's ``tau_func``), or on its next step from the config, the
    schedule and the sample's shape (DPM++ SDE's Brownian tree, seeded by the job)."""
    step_limit_key: str | None = None
    """Config key bounding ``num_inference_steps`` (LCM's ``original_inference_steps``)."""
    step_limit_default: int = 0
    """That key's diffusers default."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A scheduler no job may use; ``reason`` says why, for the submitter."""

    reason: str


_DDPM = frozenset({Space.DDPM})
_FLOW = frozenset({Space.FLOW})
_BOTH = frozenset({Space.DDPM, Space.FLOW})
_INVERSE = ("inversion: it runs the schedule from image to noise (for editing), it does not "
            "generate")
_PARALLEL = ("ParaDiGMS parallel sampling steps many timesteps per batched call, which one "
             "model evaluation per chunk cannot split; run sequentially it is plain {}")
_DISCRETE = "samples discrete tokens (uniform-corruption D3PM), not continuous latents"
_EDM = ("EDM formulation: its timesteps are ln(σ)/4 and its steps precondition with sigma_data, "
        "for EDM-trained models (Playground v2.5); these transformers embed the "
        "0–999 DDPM timesteps or flow sigmas")
_HELIOS = ("Helios' multi-stage pyramid schedule (set_timesteps per stage, the latent resized "
           "between stages) is driven by the Helios pipeline alone")

SCHEDULERS: dict[str, Exact | Refused] = {
    "DDIMScheduler": Exact(_DDPM),
    "DDPMScheduler": Exact(_DDPM),
    "PNDMScheduler": Exact(_DDPM),
    "LMSDiscreteScheduler": Exact(_DDPM, needs="scipy", unit_init_noise=False),
    "EulerDiscreteScheduler": Exact(_DDPM, unit_init_noise=False),
    "EulerAncestralDiscreteScheduler": Exact(_DDPM, unit_init_noise=False),
    "HeunDiscreteScheduler": Exact(_DDPM, unit_init_noise=False),
    "KDPM2DiscreteScheduler": Exact(_DDPM, unit_init_noise=False),
    "KDPM2AncestralDiscreteScheduler": Exact(_DDPM, unit_init_noise=False),
    "DPMSolverSDEScheduler": Exact(
        _DDPM, unit_init_noise=False, needs="torchsde", seeded="noise_sampler_seed",
        derived=("noise_sampler",)),
    "DPMSolverMultistepScheduler": Exact(_BOTH),
    "DPMSolverSinglestepScheduler": Exact(_BOTH),
    "UniPCMultistepScheduler": Exact(_BOTH),
    "DEISMultistepScheduler": Exact(_BOTH),
    "SASolverScheduler": Exact(_BOTH, derived=("tau_func",)),
    "LCMScheduler": Exact(_DDPM, step_limit_key="original_inference_steps", step_limit_default=50),
    "TCDScheduler": Exact(_DDPM, step_limit_key="original_inference_steps", step_limit_default=50),
    "FlowMatchEulerDiscreteScheduler": Exact(_FLOW),
    "FlowMatchHeunDiscreteScheduler": Exact(_FLOW),
    "FlowMatchLCMScheduler": Exact(_FLOW),
    "LTXEulerAncestralRFScheduler": Exact(_FLOW),
    "AmusedScheduler": Refused("masked-token sampling of aMUSEd's VQ tokens, not continuous "
                               "latents"),
    "BlockRefinementScheduler": Refused("commit-by-confidence refinement of discrete text tokens "
                                        "(diffusion language models), not continuous latents"),
    "CMStochasticIterativeScheduler": Refused(
        "consistency-model sampling: needs a consistency-distilled model with EDM scalings"),
    "CogVideoXDDIMScheduler": Refused(
        "DDIM on CogVideoX's SNR-shifted schedule (snr_shift_scale), for CogVideoX alone; the "
        "unshifted one is ddim"),
    "CogVideoXDPMScheduler": Refused(
        "its step takes the previous x0 and the next-but-one timestep that only CogVideoXPipeline "
        "hands it, on CogVideoX's SNR-shifted schedule"),
    "ConsistencyDecoderScheduler": Refused(
        "drives OpenAI's consistency decoder (a VAE decoder), not a denoising transformer"),
    "CosineDPMSolverMultistepScheduler": Refused(
        "EDM-preconditioned DPM-Solver on Stable Audio's cosine schedule: its timesteps are "
        "atan(σ)·2/π and its steps precondition with sigma_data; these transformers embed the "
        "0–999 DDPM timesteps or flow sigmas"),
    "DDIMInverseScheduler": Refused(_INVERSE),
    "DPMSolverMultistepInverseScheduler": Refused(_INVERSE),
    "DDIMParallelScheduler": Refused(_PARALLEL.format("ddim")),
    "DDPMParallelScheduler": Refused(_PARALLEL.format("ddpm")),
    "DDPMWuerstchenScheduler": Refused(
        "Würstchen's continuous cosine schedule (t in [0, 1]) for its prior, not the 0–999 "
        "DDPM timesteps these transformers embed"),
    "DiscreteDDIMScheduler": Refused(_DISCRETE),
    "EntropyBoundScheduler": Refused(_DISCRETE),
    "EDMDPMSolverMultistepScheduler": Refused(_EDM),
    "EDMEulerScheduler": Refused(_EDM),
    "FlowMapEulerDiscreteScheduler": Refused(
        "for flow-map-distilled models conditioned on a start and an end time; Wan is "
        "conditioned on one"),
    "HeliosDMDScheduler": Refused(_HELIOS),
    "HeliosScheduler": Refused(_HELIOS),
    "IPNDMScheduler": Refused(
        "Dance Diffusion's continuous cosine schedule (t in [0, 1]), not the 0–999 DDPM "
        "timesteps these transformers embed"),
    "KarrasVeScheduler": Refused(
        "deprecated variance-exploding sampler whose churn step the pipeline performs outside "
        "step(); these models are variance-preserving or flow models"),
    "MiniMaxH3Scheduler": Refused(
        "MiniMax-H3's conventions (a data-ward velocity, t = 1 - σ); Wan predicts a noise-ward "
        "velocity on σ·1000 timesteps: use flow_match_euler"),
    "PiflowScheduler": Refused(
        "π-Flow integrates a policy that a widened-output transformer predicts; these "
        "transformers predict one velocity or noise"),
    "RFD4ProteinaScheduler": Refused("samples protein structures (RFD4-Proteína), not latents"),
    "RePaintScheduler": Refused("inpainting: each step needs the known image and its mask"),
    "SCMScheduler": Refused(
        "sCM consistency sampling in the TrigFlow parametrization (SANA-Sprint): needs a "
        "TrigFlow consistency model"),
    "ScoreSdeVeScheduler": Refused(
        "predictor-corrector sampling of variance-exploding score models (step_pred and "
        "step_correct), not one step per model evaluation"),
    "ScoreSdeVpScheduler": Refused(
        "deprecated continuous VP-SDE score sampler (step_pred on t in (0, 1]) with no "
        "step() for a denoising loop"),
    "UnCLIPScheduler": Refused("deprecated by diffusers (\"do not use\"); ddpm covers it"),
    "VQDiffusionScheduler": Refused("samples discrete VQ tokens, not continuous latents"),
}

COMMON_SAMPLERS: dict[str, str] = {
    "ddim": "DDIMScheduler",
    "ddpm": "DDPMScheduler",
    "pndm": "PNDMScheduler",
    "lms": "LMSDiscreteScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "kdpm2": "KDPM2DiscreteScheduler",
    "kdpm2_a": "KDPM2AncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "dpmpp_2m_sde": "DPMSolverMultistepScheduler",
    "dpmpp_sde": "DPMSolverSDEScheduler",
    "dpmpp_2s": "DPMSolverSinglestepScheduler",
    "unipc": "UniPCMultistepScheduler",
    "deis": "DEISMultistepScheduler",
    "sa_solver": "SASolverScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "edm_euler": "EDMEulerScheduler",
    "edm_dpmpp_2m": "EDMDPMSolverMultistepScheduler",
    "ipndm": "IPNDMScheduler",
    "flow_match_euler": "FlowMatchEulerDiscreteScheduler",
    "flow_match_euler_a": "LTXEulerAncestralRFScheduler",
    "flow_match_heun": "FlowMatchHeunDiscreteScheduler",
    "flow_match_lcm": "FlowMatchLCMScheduler",
}
"""The names front-ends use, and the class each means: a recipe that does not offer one can
still say why."""


@dataclass(frozen=True, slots=True)
class FamilyRule:
    """What the samplers of one pipeline family must be."""

    space: Space
    unit_init_noise: bool
    """DiTPipeline never scales its initial noise by ``init_noise_sigma``."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Classes this family's pipeline cannot drive, each with the reason."""


FAMILY_RULES: dict[str, FamilyRule] = {
    "dit": FamilyRule(Space.DDPM, unit_init_noise=True),
    "pixart": FamilyRule(Space.DDPM, unit_init_noise=False),
    "wan": FamilyRule(Space.FLOW, unit_init_noise=False),
    "wan22": FamilyRule(Space.FLOW, unit_init_noise=False),
    "wan22_i2v": FamilyRule(Space.FLOW, unit_init_noise=False),
    "sd3": FamilyRule(Space.FLOW, unit_init_noise=False),
    "flux": FamilyRule(Space.FLOW, unit_init_noise=False, refused={
        **{name: (f"FluxPipeline sets the timesteps from sigmas and a shift mu, and {name}'s "
                  "set_timesteps takes neither") for name in ("FlowMatchHeunDiscreteScheduler",
                                                              "SASolverScheduler")},
        "LTXEulerAncestralRFScheduler": ("FluxPipeline hands set_timesteps its sigmas as a "
                                         "numpy array, which this class refuses (TypeError)")}),
    "qwen_image": FamilyRule(Space.FLOW, unit_init_noise=False, refused={
        **{name: (f"QwenImagePipeline sets the timesteps from sigmas and a shift mu, and {name}'s "
                  "set_timesteps takes no sigmas") for name in (
                      "FlowMatchHeunDiscreteScheduler", "SASolverScheduler",
                      "DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler",
                      "DEISMultistepScheduler")},
        "LTXEulerAncestralRFScheduler": ("QwenImagePipeline hands set_timesteps its sigmas as a "
                                         "numpy array, which this class refuses (TypeError)")}),
    "flux2_klein": FamilyRule(Space.FLOW, unit_init_noise=False, refused={
        **{name: (f"Flux2KleinPipeline sets the timesteps from sigmas and a shift mu, and "
                  f"{name}'s set_timesteps takes neither") for name in (
                      "FlowMatchHeunDiscreteScheduler", "SASolverScheduler")},
        "LTXEulerAncestralRFScheduler": ("Flux2KleinPipeline hands set_timesteps its sigmas as "
                                         "a numpy array, which this class refuses (TypeError)")}),
    "zimage": FamilyRule(Space.FLOW, unit_init_noise=False, refused={
        **{name: (f"ZImagePipeline always sets the timesteps from sigmas, and {name}'s "
                  "set_timesteps takes none (ValueError)") for name in (
            "FlowMatchHeunDiscreteScheduler", "SASolverScheduler", "DPMSolverMultistepScheduler",
            "DPMSolverSinglestepScheduler", "DEISMultistepScheduler")},
        "UniPCMultistepScheduler": ("ZImagePipeline hands set_timesteps its sigmas as a list, "
                                    "which this class's flow shift cannot scale (TypeError)")}),
}
FAMILY_RULES["flux_kontext"] = FamilyRule(Space.FLOW, unit_init_noise=False, refused={
    name: reason.replace("QwenImagePipeline", "FluxKontextPipeline")
    for name, reason in FAMILY_RULES["qwen_image"].refused.items()})
"""FluxKontextPipeline hands its sigmas to every scheduler, as QwenImagePipeline does (not
FluxPipeline, which leaves them out in flow mode): the same classes are refused."""

FAMILY_RULES["hunyuan_video15"] = FamilyRule(Space.FLOW, unit_init_noise=False, refused={
    name: ("HunyuanVideo15Pipeline ships FlowMatchEulerDiscreteScheduler and hands its "
           f"set_timesteps linspace(1, 0) sigmas; {name} is not the pipeline's sampler, so a job "
           "would have no library output to equal")
    for name, support in SCHEDULERS.items()
    if isinstance(support, Exact) and name != "FlowMatchEulerDiscreteScheduler"})
"""HunyuanVideo 1.5 runs its pipeline's own flow-matching Euler scheduler only."""

FLOW_CONFIG: dict[str, Any] = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
"""What makes a DDPM-schedule solver step a flow-matching model."""
_SPACE_WORDS = {Space.DDPM: "a DDPM noise-prediction model", Space.FLOW: "a flow-matching model"}


def space_of(class_name: str, config: Mapping[str, Any]) -> Space:
    """The model kind a scheduler of this class and config steps."""
    support = SCHEDULERS.get(class_name)
    if isinstance(support, Exact) and support.spaces == _FLOW:
        return Space.FLOW
    flow = config.get("use_flow_sigmas") and config.get("prediction_type") == "flow_prediction"
    return Space.FLOW if flow else Space.DDPM


def package_available(name: str) -> bool:
    """Whether ``name`` can be imported here (checked without importing it)."""
    return importlib.util.find_spec(name) is not None


def missing_package(class_name: str) -> str | None:
    """Why this scheduler cannot be built here (an optional package is not installed), or None."""
    support = SCHEDULERS.get(class_name)
    if isinstance(support, Exact) and support.needs and not package_available(support.needs):
        return f"{class_name} needs the {support.needs} package; pip install {support.needs}"
    return None


def refusal(family: str, class_name: str, config: Mapping[str, Any]) -> str | None:
    """Why a model of ``family`` cannot run this scheduler exactly, or None when it can."""
    support = SCHEDULERS.get(class_name)
    if support is None:
        return f"{class_name} is not in Stepline's table of diffusers schedulers"
    if isinstance(support, Refused):
        return f"{class_name}: {support.reason}"
    rule = FAMILY_RULES[family]
    if class_name in rule.refused:
        return rule.refused[class_name]
    space = space_of(class_name, config)
    if space is not rule.space or space not in support.spaces:
        return (f"{class_name} is for {_SPACE_WORDS[space]}; this one is "
                f"{_SPACE_WORDS[rule.space]}" + _flow_hint(rule.space, support))
    if rule.unit_init_noise and not support.unit_init_noise:
        return (f"{class_name} starts from noise scaled to its init_noise_sigma, which "
                "DiTPipeline never applies: in diffusers it would denoise from the wrong level")
    if support.seeded is not None and support.seeded in config:
        return f"{class_name}'s {support.seeded} is bound to each job's seed; remove it"
    return None


def _flow_hint(space: Space, support: Exact) -> str:
    if space is Space.FLOW and Space.FLOW in support.spaces:
        return " (configure use_flow_sigmas: true, prediction_type: flow_prediction)"
    return ""


def sampler_refusal(family: str, name: str) -> str | None:
    """Why a model of ``family`` cannot offer the common sampler ``name`` (None: it could, or
    the name is not a common one)."""
    class_name = COMMON_SAMPLERS.get(name)
    if class_name is None:
        return None
    support = SCHEDULERS[class_name]
    flow = (FAMILY_RULES[family].space is Space.FLOW and isinstance(support, Exact)
            and Space.FLOW in support.spaces)
    return (refusal(family, class_name, FLOW_CONFIG if flow else {})
            or missing_package(class_name))


def step_limit(class_name: str, config: Mapping[str, Any]) -> int | None:
    """The most inference steps this scheduler accepts, or None when unbounded."""
    support = SCHEDULERS.get(class_name)
    if not isinstance(support, Exact) or support.step_limit_key is None:
        return None
    return int(config.get(support.step_limit_key, support.step_limit_default))


def seeded_key(class_name: str) -> str | None:
    """The config key bound to the job's seed, if the class has one."""
    support = SCHEDULERS.get(class_name)
    return support.seeded if isinstance(support, Exact) else None


def derived_attributes(class_name: str) -> tuple[str, ...]:
    """Attributes a fresh scheduler derives again, so the checkpoint leaves them out."""
    support = SCHEDULERS.get(class_name)
    return support.derived if isinstance(support, Exact) else ()
