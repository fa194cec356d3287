"""A job's input images (``image``, inpainting ``mask``, ControlNet ``control_image``): checked
with Pillow, stored once in the artifact store by content digest, named in the job's params by
that digest.

A client sends an input as base64 in the job's JSON (``params.image``), or uploads it first
(``POST /v1/inputs``, multipart) and names the digest it got back (``sha256:<hex>``). Either
way the job stores only the digest; the worker that runs its encode chunk — any worker, after
any crash or migration — reads the very bytes back (``inputs/<hex>`` in the store) and checks
their hash before it uses them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from tasks.artifacts import ArtifactStore
from tasks.errors import InvalidJob
from tasks.settings.artifacts import ArtifactSettings
from tasks.spec import JobSpec

PREFIX = "inputs"
FORMATS = ("PNG", "JPEG", "WEBP")
"""What an input may be encoded as (Pillow's names)."""
ROLES = ("image", "mask", "control_image")
"""The params that name inputs (``control_image``: a ControlNet job's)."""
MASK_MODES = ("1", "L", "LA", "RGBA")
"""Masks of one channel (or with an alpha channel: the alpha is the mask, as OpenAI's)."""
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_DATA_URL = re.compile(r"^data:image/[a-z]+;base64,")


class InputTooLarge(InvalidJob):
    """Raised when an input is over ``artifacts.input_max_bytes`` or ``input_max_pixels``
    (answered 413)."""


@dataclass(frozen=True, slots=True)
class CheckedInput:
    """An input that decoded whole within the limits: its bytes, digest and shape."""

    data: bytes
    format: str
    width: int
    height: int
    mode: str

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()


def check_input(data: bytes, role: str, limits: ArtifactSettings) -> CheckedInput:
    """``data`` as an input ``role``: within the byte cap, a PNG, JPEG or WebP whose header's
    size is within the pixel cap (read before decoding), decodable to its end. Raises
    :class:`InputTooLarge` or :class:`InvalidJob` naming the problem."""
    if len(data) > limits.input_max_bytes:
        raise InputTooLarge(f"{role}: {len(data)} bytes is more than the "
                            f"{limits.input_max_bytes} bytes an input may have "
                            "(artifacts.input_max_bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                return _decoded(image, data, role, limits)
    except (UnidentifiedImageError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise InvalidJob(f"{role}: not a PNG, JPEG or WebP image Pillow can read ({exc})"
                         ) from exc


def _decoded(image: Image.Image, data: bytes, role: str,
             limits: ArtifactSettings) -> CheckedInput:
    if image.format not in FORMATS:
        raise InvalidJob(f"{role}: {image.format} images are not taken; send PNG, JPEG or WebP")
    width, height = image.size
    if width * height > limits.input_max_pixels:
        raise InputTooLarge(f"{role}: {width}x{height} is {width * height} pixels, more than "
                            f"the {limits.input_max_pixels} an input may have "
                            "(artifacts.input_max_pixels)")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidJob(f"{role}: the {image.format} image does not decode ({exc})") from exc
    return CheckedInput(data, str(image.format), width, height, image.mode)


def check_mask(mask: CheckedInput, image: CheckedInput) -> None:
    """A mask must be the image's size and one channel (or carry its mask in an alpha)."""
    if (mask.width, mask.height) != (image.width, image.height):
        raise InvalidJob(f"mask: {mask.width}x{mask.height} is not the image's size "
                         f"({image.width}x{image.height}); send a mask of the image's size")
    if mask.mode not in MASK_MODES:
        raise InvalidJob(f"mask: mode {mask.mode} has {len(mask.mode)} colour channels; send "
                         "a one-channel (L or 1) mask, or one whose alpha channel is the mask")


class InputStore:
    """Inputs in the artifact store, each once, at ``inputs/<sha256 hex>``."""

    def __init__(self, artifacts: ArtifactStore) -> None:
        self.artifacts = artifacts

    def _path(self, digest: str) -> str:
        match = _DIGEST.match(digest)
        if match is None:
            raise InvalidJob(f"{digest[:80]!r} is not an input digest (sha256:<64 hex digits>)")
        return f"{self.artifacts.root}/{PREFIX}/{match.group(1)}"

    def put(self, checked: CheckedInput) -> str:
        """Store ``checked`` (once: the same bytes are never written twice); its digest."""
        path = self._path(checked.digest)
        if not self.artifacts.fs.exists(path):
            self.artifacts.write_whole(path, checked.data)
        return checked.digest

    def exists(self, digest: str) -> bool:
        return bool(self.artifacts.fs.exists(self._path(digest)))

    def read(self, digest: str) -> bytes:
        """The bytes stored under ``digest``, checked against it; :class:`InvalidJob` when the
        store has none or they do not hash to it."""
        try:
            data = bytes(self.artifacts.fs.cat_file(self._path(digest)))
        except FileNotFoundError as exc:
            raise InvalidJob(f"input {digest} is not in {self.artifacts!r}; upload it "
                             "(POST /v1/inputs) or send it as base64") from exc
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise InvalidJob(f"input {digest} in {self.artifacts!r} does not hash to its name")
        return data


def _decode_base64(text: str, role: str) -> bytes:
    try:
        return base64.b64decode(_DATA_URL.sub("", text, count=1), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidJob(f"params.{role}: neither an input digest (sha256:<hex>) nor base64 "
                         f"image data ({exc})") from exc


def _checked(store: InputStore, value: Any, role: str, limits: ArtifactSettings
             ) -> CheckedInput:
    if not isinstance(value, str):
        raise InvalidJob(f"params.{role}: a digest (sha256:<hex>) or base64 image, not "
                         f"{type(value).__name__}")
    data = store.read(value) if _DIGEST.match(value) else _decode_base64(value, role)
    return check_input(data, role, limits)


def store_inputs(spec: JobSpec, store: InputStore, limits: ArtifactSettings) -> JobSpec:
    """``spec`` with each input of an image or video job checked, stored and named by its
    digest (a digest already given must be in the store); other jobs as they are."""
    if spec.kind not in ("image", "video") or not any(spec.params.get(r) for r in ROLES):
        return spec
    checked = {role: _checked(store, spec.params[role], role, limits)
               for role in ROLES if spec.params.get(role) is not None}
    if "mask" in checked:
        if "image" not in checked:
            raise InvalidJob("params.mask: a mask masks an input image; send image too")
        check_mask(checked["mask"], checked["image"])
    digests = {role: store.put(value) for role, value in checked.items()}
    return spec.model_copy(update={"params": {**spec.params, **digests}})


def read_inputs(store: InputStore, params: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of each input ``params`` names, by role (for the chunk that reads them)."""
    return {role: store.read(str(params[role])) for role in ROLES
            if params.get(role) is not None}
