"""The artifact store: finished images, videos and text results in a local directory.

Names are ``<job id>.<ext>``; a name that tries to leave the store (``../``, ``/``) is rejected.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from tasks.errors import SteplineError
from workers.runner import Artifact

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*\.(png|mp4|gif|webp|json)$")


class UnsafeArtifactPath(SteplineError):
    """Raised when an artifact name would resolve outside the store."""


class ArtifactStore:
    """Artifacts on local disk (point several machines at one shared directory to scale out)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def put(self, job_id: str, artifact: Artifact) -> str:
        """Write atomically; returns the artifact's name."""
        name = f"{job_id}.{artifact.extension}"
        target = self.path(name)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(artifact.data)
        os.replace(tmp, target)
        return name

    def path(self, name: str) -> Path:
        """The file of an artifact; raises :class:`UnsafeArtifactPath` for names that escape."""
        if not _NAME.match(name):
            raise UnsafeArtifactPath(
                f"artifact name {name!r} is not <job id>.<png|mp4|gif|webp|json>"
            )
        resolved = (self.root / name).resolve()
        if resolved.parent != self.root:
            raise UnsafeArtifactPath(f"artifact name {name!r} leaves the artifact store")
        return resolved

    def read(self, name: str) -> bytes:
        return self.path(name).read_bytes()
