"""A resumed diffusion state keeps each tensor's memory layout, not only its values.

The checkpoint's bytes are row-major, but a VAE encoding leaves an image-to-image job's latents
channels-last, and CPU kernels choose their paths by layout: a resumed latent laid out row-major
rounds differently from the uninterrupted run's in the next step.
"""

from __future__ import annotations

import torch

from workers.checkpoint import Checkpoint
from workers.diffusion.state import laid_out, memory_orders


def test_a_channels_last_tensor_is_restored_channels_last_with_equal_values() -> None:
    # given a channels-last latent and a row-major one
    latent = torch.randn(1, 4, 8, 12).to(memory_format=torch.channels_last)
    plain = torch.randn(2, 16, 32)
    tensors = {"latents": latent, "cond.x": plain}
    # when their orders are recorded, the bytes round-trip and the orders are applied
    orders = memory_orders(tensors)
    back = Checkpoint.decode(Checkpoint(tensors=tensors, meta={"o": orders}).encode())
    restored = laid_out(back.tensors, back.meta["o"])
    # then only the channels-last one is recorded, and it comes back with its strides and values
    assert orders == {"latents": [0, 2, 3, 1]}
    assert restored["latents"].stride() == latent.stride()
    assert torch.equal(restored["latents"], latent)
    assert restored["cond.x"].stride() == plain.stride()


def test_a_permuted_video_tensor_and_a_broadcast_view_are_handled() -> None:
    # given a 5-D tensor laid out channels-last and a broadcast (overlapping) view
    video = torch.randn(1, 4, 3, 6, 8).to(memory_format=torch.channels_last_3d)
    broadcast = torch.randn(1, 8).expand(4, 8)
    # when their orders are taken
    orders = memory_orders({"video": video, "broadcast": broadcast})
    # then the video's is its memory order and the broadcast view (no dense order) is left out
    assert orders == {"video": [0, 2, 3, 4, 1]}
    assert laid_out({"video": video.contiguous()}, orders)["video"].stride() == video.stride()
