"""Every diffusion family by its recipe name: its step arithmetic and its blockwise forward.

A family lives in its own module (``families.py`` holds the first three and the helpers they
share); this table is the one place that names them all, so adding a family adds one line to
each dict here and imports nothing circular.
"""

from __future__ import annotations

from workers.diffusion.blockwise import (
    BlockwiseForward,
    DiTBlockwise,
    PixArtBlockwise,
    WanBlockwise,
)
from workers.diffusion.families import DiTFamily, PipelineFamily, PixArtFamily, WanFamily
from workers.diffusion.flux import FluxBlockwise, FluxFamily
from workers.diffusion.flux2_klein import Flux2KleinBlockwise, Flux2KleinFamily
from workers.diffusion.flux_kontext import FluxKontextFamily
from workers.diffusion.hunyuan_video15 import HunyuanVideo15Blockwise, HunyuanVideo15Family
from workers.diffusion.qwen_image import QwenImageBlockwise, QwenImageFamily
from workers.diffusion.sd3 import SD3Blockwise, SD3Family
from workers.diffusion.wan22 import Wan22Family
from workers.diffusion.wan22_i2v import Wan22ImageToVideoFamily
from workers.diffusion.zimage import ZImageBlockwise, ZImageFamily

FAMILIES: dict[str, PipelineFamily] = {
    "dit": DiTFamily(),
    "pixart": PixArtFamily(),
    "wan": WanFamily(),
    "wan22": Wan22Family(),
    "wan22_i2v": Wan22ImageToVideoFamily(),
    "sd3": SD3Family(),
    "flux": FluxFamily(),
    "flux_kontext": FluxKontextFamily(),
    "qwen_image": QwenImageFamily(),
    "zimage": ZImageFamily(),
    "flux2_klein": Flux2KleinFamily(),
    "hunyuan_video15": HunyuanVideo15Family(),
}
"""The step arithmetic of each family (``DiffusionRecipe.family``)."""

ADAPTERS: dict[str, BlockwiseForward] = {
    "dit": DiTBlockwise(),
    "pixart": PixArtBlockwise(),
    "wan": WanBlockwise(),
    "wan22": WanBlockwise(),  # both experts are WanTransformer3DModel
    "wan22_i2v": WanBlockwise(),  # the condition is in hidden_states: no image embedding
    "sd3": SD3Blockwise(),
    "flux": FluxBlockwise(),
    "flux_kontext": FluxBlockwise(),  # the image tokens ride in the image stream
    "qwen_image": QwenImageBlockwise(),
    "zimage": ZImageBlockwise(),
    "flux2_klein": Flux2KleinBlockwise(),
    "hunyuan_video15": HunyuanVideo15Blockwise(),
}
"""The transformer forward of each family, replayed as prologue, blocks and epilogue."""
