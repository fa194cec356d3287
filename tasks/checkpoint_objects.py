"""Checkpoints too large for Redis, in the shared object store: Redis keeps a small, tagged
reference (name, size, SHA-256) in the checkpoint's place, and a claim turns it back into the
very bytes that were written."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from scheduler.lifecycle import JobState
from tasks import keys
from tasks.artifacts import ArtifactStore
from tasks.errors import SteplineError
from tasks.settings import Settings

log = logging.getLogger(__name__)

REFERENCE_MAGIC = b"slckref:"
"""The first bytes of a reference. A checkpoint's first 8 bytes are its safetensors header's
length (little-endian); these read as about 4e18, far above any header a checkpoint may have
(100 MiB), so no checkpoint is ever taken for a reference."""
REFERENCE_VERSION = 1
_REFERENCE_MAX_BYTES = 1024
_FIELDS = frozenset({"v", "name", "size", "sha256"})
PREFIX = "checkpoints"
_NAME = re.compile(rf"^{PREFIX}/([A-Za-z0-9][A-Za-z0-9_\-]*)/[0-9]+-[0-9a-f]{{12}}\.ckpt$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ENDED = frozenset(state.value for state in JobState if state.is_terminal)


class CheckpointReferenceError(SteplineError, ValueError):
    """Raised when bytes that start as a checkpoint reference are not a valid one."""


class CheckpointObjectError(SteplineError):
    """Raised when a referenced checkpoint is missing from the store or is not the bytes its
    reference names (size, SHA-256): the job cannot resume from it."""


@dataclass(frozen=True, slots=True)
class CheckpointReference:
    """Where a job's durable checkpoint lies in the object store, and what it must hash to."""

    name: str
    """``checkpoints/<job id>/<seq>-<random>.ckpt``, relative to the store's root."""
    size_bytes: int
    sha256: str

    @property
    def job_id(self) -> str:
        match = _NAME.match(self.name)
        assert match is not None, "a reference's name is checked when it is made"
        return match.group(1)

    @classmethod
    def of(cls, name: str, blob: bytes) -> CheckpointReference:
        return cls(name, len(blob), hashlib.sha256(blob).hexdigest())

    def encode(self) -> bytes:
        """The magic, then one JSON object (never pickle)."""
        body = {"v": REFERENCE_VERSION, "name": self.name, "size": self.size_bytes,
                "sha256": self.sha256}
        return REFERENCE_MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, stored: bytes) -> CheckpointReference:
        """Parse :meth:`encode`'s bytes; anything else raises
        :class:`CheckpointReferenceError` naming what is wrong."""
        if not is_reference(stored):
            raise CheckpointReferenceError("not a checkpoint reference (no magic prefix)")
        if len(stored) > _REFERENCE_MAX_BYTES:
            raise CheckpointReferenceError(
                f"checkpoint reference of {len(stored)} bytes (at most {_REFERENCE_MAX_BYTES})")
        try:
            body = json.loads(stored[len(REFERENCE_MAGIC):])
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointReferenceError(f"checkpoint reference is not JSON: {exc}") from exc
        return cls._checked(body)

    @classmethod
    def _checked(cls, body: Any) -> CheckpointReference:
        if not isinstance(body, dict) or set(body) != _FIELDS:
            raise CheckpointReferenceError(
                f"checkpoint reference needs exactly the fields {sorted(_FIELDS)}")
        if body["v"] != REFERENCE_VERSION:
            raise CheckpointReferenceError(
                f"checkpoint reference version {body['v']!r} (this worker reads "
                f"{REFERENCE_VERSION}): upgrade the worker")
        name, size, digest = body["name"], body["size"], body["sha256"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise CheckpointReferenceError(
                f"checkpoint reference names {name!r}, not {PREFIX}/<job id>/<seq>-<hex>.ckpt")
        if type(size) is not int or size < 0:
            raise CheckpointReferenceError(f"checkpoint reference size {size!r} is not a count")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise CheckpointReferenceError(
                f"checkpoint reference sha256 {digest!r} is not 64 lowercase hex digits")
        return cls(name, size, digest)


def is_reference(stored: bytes) -> bool:
    """Whether the bytes Redis holds for a checkpoint are a reference (else the checkpoint)."""
    return stored[:len(REFERENCE_MAGIC)] == REFERENCE_MAGIC


class CheckpointObjects:
    """The object-store side of durable checkpoints: what a commit writes in Redis for a
    checkpoint (the bytes, or a reference to an object written first), what a claim turns a
    reference back into, and the removal of objects nobody will read again."""

    def __init__(self, artifacts: ArtifactStore, threshold_bytes: int | None) -> None:
        self.artifacts = artifacts
        self.threshold_bytes = threshold_bytes
        """Checkpoints larger than this go to the store; None: none does."""

    @classmethod
    def from_settings(cls, settings: Settings, artifacts: ArtifactStore) -> CheckpointObjects:
        return cls(artifacts, settings.artifacts.offload_threshold_bytes(artifacts.local))

    def offload(self, job_id: str, seq: int, blob: bytes) -> CheckpointReference | None:
        """Write ``blob`` (the job's checkpoint after commit ``seq``) to the store, whole or
        not at all, under a name no other attempt uses, if it is above the threshold; returns
        its reference (None: the checkpoint stays in Redis as it is)."""
        if self.threshold_bytes is None or len(blob) <= self.threshold_bytes:
            return None
        reference = CheckpointReference.of(
            f"{PREFIX}/{job_id}/{seq}-{uuid.uuid4().hex[:12]}.ckpt", blob)
        if not _NAME.match(reference.name):
            raise CheckpointReferenceError(f"job id {job_id!r} cannot name a checkpoint object")
        self.artifacts.write_whole(self._path(reference.name), blob)
        return reference

    def resolve(self, job_id: str, stored: bytes) -> bytes:
        """The checkpoint Redis holds as ``stored``: those bytes, or the object they refer to,
        checked against the reference's size and SHA-256. Raises
        :class:`CheckpointObjectError` when the object is missing or not those bytes."""
        if not is_reference(stored):
            return stored
        try:
            reference = CheckpointReference.decode(stored)
        except CheckpointReferenceError as exc:
            raise CheckpointObjectError(f"job {job_id}: {exc}") from exc
        if reference.job_id != job_id:
            raise CheckpointObjectError(
                f"job {job_id}: its checkpoint reference names {reference.name}, another "
                "job's object; the job cannot resume")
        try:
            blob = bytes(self.artifacts.fs.cat_file(self._path(reference.name)))
        except FileNotFoundError as exc:
            raise CheckpointObjectError(
                f"job {job_id}: its checkpoint object {reference.name} is missing from "
                f"{self.artifacts!r}; the job cannot resume") from exc
        if len(blob) != reference.size_bytes or \
                hashlib.sha256(blob).hexdigest() != reference.sha256:
            raise CheckpointObjectError(
                f"job {job_id}: its checkpoint object {reference.name} is {len(blob)} bytes "
                f"that do not match the reference ({reference.size_bytes} bytes, sha256 "
                f"{reference.sha256[:12]}...); the job cannot resume")
        return blob

    def read_range(self, reference: CheckpointReference, start: int, end: int) -> bytes | None:
        """Bytes ``start..end`` (inclusive) of a referenced checkpoint, unchecked (a reader of
        its header); None when the object is gone (a later commit replaced it)."""
        end = min(end, reference.size_bytes - 1)  # S3 answers 416 to a range past the end
        if start > end:
            return b""
        try:
            return bytes(self.artifacts.fs.cat_file(self._path(reference.name), start=start,
                                                   end=end + 1))
        except FileNotFoundError:
            return None

    def forget(self, stored: Iterable[bytes | None]) -> None:
        """Remove the objects these checkpoints (as Redis holds them) refer to, which nobody
        will read again: a stale commit's, or one a later commit replaced. A checkpoint kept
        in Redis itself has none. Never raises: an object left behind goes with its job's."""
        for value in stored:
            if value is None or not is_reference(value):
                continue
            try:
                reference = CheckpointReference.decode(value)
            except CheckpointReferenceError as exc:
                log.warning("not removing the object of an unreadable reference: %s", exc)
                continue
            self._remove(self._path(reference.name), recursive=False)

    @property
    def enabled(self) -> bool:
        """Whether this process writes checkpoints to the store (else it has none to remove
        by job, and a single host's default pays nothing at a job's end)."""
        return self.threshold_bytes is not None

    def forget_job(self, job_id: str) -> None:
        """Remove every checkpoint object of an ended job (never raises)."""
        if not self.enabled or not _NAME.match(f"{PREFIX}/{job_id}/0-000000000000.ckpt"):
            return
        folder = self._path(f"{PREFIX}/{job_id}")
        self._remove(folder, recursive=True)
        if not self.artifacts.local:  # a filer-backed server (SeaweedFS) keeps the folder
            self._remove(folder + "/", recursive=False)

    def job_ids(self) -> list[str]:
        """The jobs that have checkpoint objects in the store."""
        try:
            entries = self.artifacts.fs.ls(self._path(PREFIX), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def sweep(self, states: dict[str, str | None]) -> list[str]:
        """Remove the objects of every job in ``states`` (job id → its state, None: no record)
        that ended or is gone: the jobs that ended without their worker removing them (a
        cancel or expiry while queued, a watchdog's failure, a worker that died). Returns
        the jobs swept."""
        swept = [job_id for job_id, state in states.items()
                 if state is None or state in _ENDED]
        for job_id in swept:
            self.forget_job(job_id)
        return swept

    def _path(self, name: str) -> str:
        return f"{self.artifacts.root}/{name}"

    def _remove(self, path: str, *, recursive: bool) -> None:
        try:
            self.artifacts.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception:
            log.warning("could not remove checkpoint object(s) %s; the sweep retries", path,
                        exc_info=True)


class CheckpointSweeper:
    """The scheduler's sweep of ended jobs' checkpoint objects, at most once per
    ``interval_s``, on a thread of its own: a listing of the store must not stretch a tick."""

    def __init__(self, objects: CheckpointObjects, client: redis.Redis, interval_s: float
                 ) -> None:
        self.objects, self.client, self.interval_s = objects, client, interval_s
        self._last_s = -float("inf")
        self._thread: threading.Thread | None = None

    def maybe_start(self, now_s: float) -> bool:
        """Start a sweep if offloading is on, the last one ended and ``interval_s`` passed."""
        if not self.objects.enabled or now_s - self._last_s < self.interval_s:
            return False
        if self._thread is not None and self._thread.is_alive():
            return False
        self._last_s = now_s
        self._thread = threading.Thread(target=self._run, name="checkpoint-sweep", daemon=True)
        self._thread.start()
        return True

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the sweep under way, if any (for a clean stop, and tests)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            swept = sweep_ended_jobs(self.objects, self.client)
        except Exception:
            log.warning("the checkpoint object sweep failed; it runs again in %.0f s",
                        self.interval_s, exc_info=True)
            return
        if swept:
            log.info("removed the checkpoint objects of %d ended jobs", len(swept))


def sweep_ended_jobs(objects: CheckpointObjects, client: redis.Redis) -> list[str]:
    """Remove the checkpoint objects of every job in the store that ended or has no record
    (its state read from Redis in one round trip); returns those jobs."""
    job_ids = objects.job_ids()
    if not job_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job(job_id), "state")
    states = {job_id: None if raw is None else (raw.decode() if isinstance(raw, bytes) else raw)
              for job_id, raw in zip(job_ids, pipe.execute(), strict=True)}
    return objects.sweep(states)
