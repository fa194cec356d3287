"""Where finished artifacts live: a local directory by default, or any fsspec URL (``s3://``)
that every host's API and workers share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from tasks.settings.durations import Seconds

DEFAULT_OFFLOAD_BYTES = 1024 * 1024
"""The offload threshold of a store that is not a local directory, unless one is set."""


class ArtifactSettings(BaseModel):
    """The artifact store: an fsspec URL and, for an S3-compatible store, its endpoint and keys."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str | None = None
    """fsspec URL of the store: ``s3://bucket/prefix`` (any S3-compatible server), ``file:///srv/
    artifacts`` or a plain path. Unset → ``artifact_dir``, else ``<run_dir>/artifacts`` (a
    local directory: results stay on the host that finished the job unless it is shared)."""
    endpoint_url: str | None = None
    """An S3-compatible server's address (``http://minio:9000``); unset → AWS's."""
    region: str | None = None
    """The S3 region, when the server asks for one."""
    access_key_id: str | None = None
    """S3 access key; unset → the usual chain (``AWS_ACCESS_KEY_ID``, a profile, an instance
    role)."""
    secret_access_key: SecretStr | None = None
    """S3 secret key (never printed or logged); unset → the usual chain
    (``AWS_SECRET_ACCESS_KEY`` ...)."""
    checkpoint_offload_bytes: int | None = Field(default=None, ge=0, le=512 * 1024 * 1024)
    """A durable checkpoint larger than this is written to the store (under
    ``checkpoints/<job id>/``) and Redis keeps only a small reference to it (0: every
    checkpoint). Unset → 1 MiB when the store is not a local directory (``s3://``: every host
    reads it), else never: a single host keeps every checkpoint in Redis. Bytes, in
    [0, 2**29] (512 MiB)."""
    checkpoint_sweep_interval: Seconds = Field(default=60.0, ge=1, le=86400)
    """How often the scheduler removes the checkpoint objects of jobs that ended without a
    worker removing them (cancelled or expired while queued, failed by the watchdog, a worker
    that died). Seconds, in [1, 86400]."""

    input_max_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    """The largest input image or mask a job may carry (its encoded file: PNG, JPEG, WebP); a
    larger one is refused with 413. Bytes, in [1024, 2**26] (64 MiB)."""
    input_max_pixels: int = Field(default=4096 * 4096, ge=64, le=8192 * 8192)
    """The most pixels (width x height) an input image or mask may decode to, checked from its
    header before it is decoded; more is refused with 413. Pixels, in [64, 2**26]."""

    def offload_threshold_bytes(self, store_is_local: bool) -> int | None:
        """The size above which a checkpoint goes to the store; None: every one stays in
        Redis."""
        if self.checkpoint_offload_bytes is not None:
            return self.checkpoint_offload_bytes
        return None if store_is_local else DEFAULT_OFFLOAD_BYTES

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for the URL's fsspec file system (only the S3 ones are known)."""
        if not (self.url or "").startswith(("s3://", "s3a://")):
            return {}
        options: dict[str, Any] = {}
        if self.endpoint_url:
            options["endpoint_url"] = self.endpoint_url
        if self.region:
            options["client_kwargs"] = {"region_name": self.region}
        if self.access_key_id:
            options["key"] = self.access_key_id
        if self.secret_access_key is not None:
            options["secret"] = self.secret_access_key.get_secret_value()
        return options
