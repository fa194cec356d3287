"""What a job kind adds to the chunk protocol (:mod:`tasks.protocol`): the parameters its chunks
run with on this worker, the outcome each chunk records, and how often its durable checkpoint is
written. Text jobs choose and load an expert version; an image or video job's encode chunk
reads its input images from the artifact store; the other kinds add nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.model import JobKind
from tasks.context import WorkerContext
from tasks.inputs import ROLES, InputStore, read_inputs
from tasks.record import JobRecord
from workers.diffusion.inputs import INPUT_BYTES

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint
    from workers.runner import ChunkResult


class KindHooks(Protocol):
    """The kind-specific steps of a job's attempt, around its runner."""

    @property
    def checkpoint_every(self) -> int:
        """Write the durable checkpoint every this many chunks (always when the job stops)."""
        ...

    def prepare(self, job: JobRecord, params: dict[str, Any],
                state: Checkpoint | None) -> dict[str, Any]:
        """The parameters the job's chunks run with, what they need loaded on this worker."""
        ...

    def outcome(self, job: JobRecord, chunk: int, params: Mapping[str, Any],
                result: ChunkResult | None) -> None:
        """Record how chunk ``chunk`` went (``result`` None: it failed)."""
        ...


@dataclass(frozen=True, slots=True)
class PlainKind:
    """A kind that adds nothing to its runner (diffusion, simulated)."""

    checkpoint_every: int = 1

    def prepare(self, job: JobRecord, params: dict[str, Any],
                state: Checkpoint | None) -> dict[str, Any]:
        return params

    def outcome(self, job: JobRecord, chunk: int, params: Mapping[str, Any],
                result: ChunkResult | None) -> None:
        return None


@dataclass(frozen=True, slots=True)
class DiffusionKind:
    """Image and video: the encode chunk of a job with input images (``image``, ``mask``,
    ``control_image``) runs
    with their bytes, read from the artifact store by the digests its params name (checked
    against them): the same bytes on whichever worker runs it, first or after a crash."""

    ctx: WorkerContext
    checkpoint_every: int = 1

    def prepare(self, job: JobRecord, params: dict[str, Any],
                state: Checkpoint | None) -> dict[str, Any]:
        if job.next_chunk != 0 or not any(params.get(role) for role in ROLES):
            return params  # later chunks carry the image in their latents
        return {**params, INPUT_BYTES: read_inputs(InputStore(self.ctx.artifacts), params)}

    def outcome(self, job: JobRecord, chunk: int, params: Mapping[str, Any],
                result: ChunkResult | None) -> None:
        return None


@dataclass(frozen=True, slots=True)
class TextKind:
    """MoE text: a job runs on one expert version (chosen once, loaded on this worker) and each
    chunk's outcome counts for that version's hot update."""

    ctx: WorkerContext
    checkpoint_every: int = 1

    def prepare(self, job: JobRecord, params: dict[str, Any],
                state: Checkpoint | None) -> dict[str, Any]:
        from tasks.experts import choose_version  # deferred: loads transformers

        ctx = self.ctx
        version = choose_version(ctx.store, ctx.settings, ctx.text_runner(), job, params, state)
        return {**params, "expert_version": version}

    def outcome(self, job: JobRecord, chunk: int, params: Mapping[str, Any],
                result: ChunkResult | None) -> None:
        """A failure counts against the version the job runs on; a decode chunk's latency per
        token for its version (a prefill's says nothing about decoding)."""
        from tasks.experts import record_outcome  # deferred: loads torch

        ctx, model = self.ctx, str(job.params["model"])
        version = params.get("expert_version")
        if result is None:
            record_outcome(ctx.store, ctx.settings, model,
                           str(version or job.expert_version or "base"), 0.0, ok=False)
        elif version is not None and chunk > 0 and result.metrics.get("tokens"):
            record_outcome(ctx.store, ctx.settings, model, str(version),
                           result.metrics["latency_ms"] / result.metrics["tokens"], ok=True)


def hooks_of(ctx: WorkerContext, kind: JobKind) -> KindHooks:
    """The hooks of ``kind`` on this worker, with the kind's own checkpoint interval."""
    if kind is JobKind.TEXT:
        return TextKind(ctx, ctx.settings.moe.checkpoint_every)
    if kind in (JobKind.IMAGE, JobKind.VIDEO):
        return DiffusionKind(ctx, ctx.settings.diffusion.checkpoint_every)
    return PlainKind()
