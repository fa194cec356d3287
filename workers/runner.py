"""The contract between the chunk task and the code that runs a job kind on a device.

A runner knows one job kind (simulated, image, video, text). The task layer fences the message,
loads the checkpoint and calls :meth:`JobRunner.run_chunk`; it never looks inside the state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint  # types only: the codec loads torch


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How a job splits into chunks: one name per chunk and a relative cost per chunk."""

    names: tuple[str, ...]
    cost_units: tuple[float, ...]
    cost_key: str  # (model, shape bucket) for the cost model, e.g. "dit-image:256x256"
    resource_profile: str = "compute"
    """What bounds the job's steps on the device: "compute" (diffusion) or "memory" (MoE decode
    streams expert weights and the KV cache)."""

    def __post_init__(self) -> None:
        if len(self.names) != len(self.cost_units) or not self.names:
            raise ValueError("a chunk plan needs one cost per chunk and at least one chunk")

    @property
    def num_chunks(self) -> int:
        return len(self.names)


@dataclass(frozen=True, slots=True)
class Artifact:
    """The output of a finished job: bytes plus how to store and serve them."""

    data: bytes
    media_type: str  # "image/png", "video/mp4", "image/gif", "application/json"
    extension: str  # "png", "mp4", "gif", "json"


@dataclass(slots=True)
class ChunkResult:
    """What one call of :meth:`JobRunner.run_chunk` produced.

    ``complete`` is False when the runner stopped inside the chunk (a block-group boundary)
    because ``should_yield`` said so; ``state`` then holds the partial state and the same chunk
    index is run again later, continuing from it.
    """

    state: Checkpoint
    complete: bool = True
    artifact: Artifact | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


ShouldYield = Callable[[], bool]


class JobRunner(Protocol):
    """Runs the chunks of one job kind. Implementations live in ``workers/``."""

    kind: str

    def plan(self, params: Mapping[str, Any]) -> ChunkPlan:
        """The chunk plan for a job with these (already validated) parameters."""
        ...

    def run_chunk(
        self,
        params: Mapping[str, Any],
        index: int,
        state: Checkpoint | None,
        should_yield: ShouldYield,
    ) -> ChunkResult:
        """Run chunk ``index`` from ``state`` (None only for chunk 0 with no partial state)."""
        ...


class StagingRunner(Protocol):
    """A runner whose jobs' models can be read into host memory ahead of them."""

    def stage(self, params: Mapping[str, Any]) -> bool:
        """Read the model a job with these parameters runs on into the host tier of the
        process's residency (``workers.residency.ModelResidency.stage``), on the caller's
        thread; False when nothing was staged (held already, no host room, no model)."""
        ...


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One job's next chunk inside a batched task: what :meth:`JobRunner.run_chunk` would get."""

    params: Mapping[str, Any]
    index: int
    state: Checkpoint | None


class BatchRunner(Protocol):
    """A runner that can run several jobs' chunks as one batched forward (step-level batching).

    The task layer claims each job separately, hands the claimed chunks to :meth:`run_batch` in a
    fixed order and commits each result separately. A batched chunk always runs to its end (it
    yields only at chunk boundaries); preemption happens between batched steps.
    """

    def batch_key(self, params: Mapping[str, Any], index: int) -> str | None:
        """Chunks with equal keys may share one forward; None: this chunk always runs alone."""
        ...

    def run_batch(self, items: Sequence[BatchItem]) -> list[ChunkResult]:
        """Run every item's chunk, batching those with equal keys; one result per item, in order.

        Deterministic for a given sequence of items: the same members in the same order give the
        same outputs. Each result's ``metrics["batch_size"]`` is the size of the forward it ran in.
        """
        ...
