"""Encode decoded pixels as the job's artifact: PNG/WebP images, MP4 (or GIF/WebP) video.

MP4 uses the ffmpeg binary bundled in the imageio-ffmpeg wheel (works offline); without it, an
MP4 request falls back to an animated GIF and says so in the metrics.
"""

from __future__ import annotations

import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from workers.runner import Artifact

log = logging.getLogger(__name__)

VIDEO_FPS = 8
_MEDIA = {
    "png": "image/png", "webp": "image/webp", "gif": "image/gif", "mp4": "video/mp4",
}


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """(…, C, H, W) floats in [0, 1] → (…, H, W, C) uint8, rounded as diffusers' numpy_to_pil."""
    array = pixels.detach().cpu().float().movedim(-3, -1).numpy()
    return (array * 255).round().astype("uint8")


def _image_bytes(frame: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    options = {"lossless": True} if fmt == "webp" else {}
    Image.fromarray(frame).save(buf, format=fmt.upper(), **options)
    return buf.getvalue()


def _animated_bytes(frames: np.ndarray, fmt: str, fps: int) -> bytes:
    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    duration_ms = int(1000 / fps)
    images[0].save(buf, format=fmt.upper(), save_all=True, append_images=images[1:],
                   duration=duration_ms, loop=0)
    return buf.getvalue()


def _mp4_bytes(frames: np.ndarray, fps: int) -> bytes:
    import imageio_ffmpeg  # imported here: only video jobs need it

    height, width = frames.shape[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.mp4"
        writer = imageio_ffmpeg.write_frames(
            str(path), (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
            macro_block_size=2, quality=None, output_params=["-crf", "18"],
        )
        writer.send(None)
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return path.read_bytes()


def image_artifact(pixels: torch.Tensor, fmt: str) -> Artifact:
    """The first image of a (B, C, H, W) batch as PNG or WebP."""
    return Artifact(_image_bytes(to_uint8(pixels)[0], fmt), _MEDIA[fmt], fmt)


def video_artifact(pixels: torch.Tensor, fmt: str, fps: int = VIDEO_FPS) -> tuple[Artifact, str]:
    """The first video of a (B, F, C, H, W) batch; returns the artifact and the format used."""
    frames = to_uint8(pixels)[0]
    if fmt == "mp4":
        try:
            return Artifact(_mp4_bytes(frames, fps), _MEDIA["mp4"], "mp4"), "mp4"
        except (ImportError, OSError, RuntimeError) as exc:
            log.warning("mp4 encoder unavailable (%s); writing an animated gif instead", exc)
            fmt = "gif"
    return Artifact(_animated_bytes(frames, fmt, fps), _MEDIA[fmt], fmt), fmt
