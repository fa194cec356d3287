"""The artifact store: finished images, videos and text results, in any file system fsspec
opens — a local directory (the default), or an S3-compatible bucket every host shares.

Names are ``<job id>.<ext>``; a name that tries to leave the store (``../``, ``/``) is rejected.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from tasks.errors import SteplineError
from tasks.redact import mask_url
from tasks.settings import Settings
from workers.runner import Artifact

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*\.(png|mp4|gif|webp|json)$")


class UnsafeArtifactPath(SteplineError):
    """Raised when an artifact name would resolve outside the store."""


class ArtifactStore:
    """Artifacts under one fsspec URL: a plain path or ``file://`` (one host, or a directory
    the hosts share), ``s3://bucket/prefix`` (any S3-compatible server)."""

    def __init__(self, root: Path | str, storage_options: Mapping[str, Any] | None = None) -> None:
        url = str(root.resolve()) if isinstance(root, Path) else root
        self.fs: AbstractFileSystem
        self.fs, root_path = url_to_fs(url, **dict(storage_options or {}))
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = (str(Path(root_path).resolve()) if self.local
                     else root_path.rstrip("/"))
        self.url = url

    @classmethod
    def from_settings(cls, settings: Settings) -> ArtifactStore:
        return cls(settings.artifacts_url, settings.artifacts.storage_options())

    def __repr__(self) -> str:
        return f"ArtifactStore({mask_url(self.url)!r})"

    def put(self, job_id: str, artifact: Artifact) -> str:
        """Write whole or not at all (a reader never sees half an artifact); returns its name."""
        name = f"{job_id}.{artifact.extension}"
        self.write_whole(self.location(name), artifact.data)
        return name

    def write_whole(self, target: str, data: bytes) -> None:
        """Write ``data`` at ``target`` (a path in the store's file system) whole or not at
        all: an object PUT is atomic already, a local file is renamed into place."""
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        folder = Path(target).parent
        folder.mkdir(parents=True, exist_ok=True)
        tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)

    def location(self, name: str) -> str:
        """The artifact's path in the store's file system; raises :class:`UnsafeArtifactPath`
        for names that escape."""
        if not _NAME.match(name):
            raise UnsafeArtifactPath(
                f"artifact name {name!r} is not <job id>.<png|mp4|gif|webp|json>"
            )
        if self.local and Path(self.root, name).resolve().parent != Path(self.root):
            raise UnsafeArtifactPath(f"artifact name {name!r} leaves the artifact store")
        return f"{self.root}/{name}"

    def path(self, name: str) -> Path:
        """The local file of an artifact (a local store only)."""
        if not self.local:
            raise SteplineError(f"{self!r} is not a local directory: read artifacts with read()")
        return Path(self.location(name))

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.location(name)))

    def read(self, name: str) -> bytes:
        """The artifact's bytes; :class:`FileNotFoundError` when the store has none by that name."""
        return bytes(self.fs.cat_file(self.location(name)))
