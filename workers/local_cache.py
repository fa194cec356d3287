"""The worker-local checkpoint cache: the latest state of jobs this worker just ran.

When the same worker continues the same job, the state comes from memory, not Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint  # types only: the codec loads torch


class LocalCheckpointCache:
    """A small LRU of (job id → (sequence number, checkpoint)), with hit counters."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[int, Checkpoint]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, job_id: str, seq: int) -> Checkpoint | None:
        """The cached state if it is exactly the job's state at ``seq``; counts hit or miss."""
        entry = self._entries.get(job_id)
        if entry is None or entry[0] != seq:
            self.misses += 1
            return None
        self._entries.move_to_end(job_id)
        self.hits += 1
        return entry[1]

    def seq_of(self, job_id: str) -> int | None:
        """The sequence number of the state held for ``job_id`` (no hit or miss counted)."""
        entry = self._entries.get(job_id)
        return None if entry is None else entry[0]

    def put(self, job_id: str, seq: int, state: Checkpoint) -> None:
        self._entries[job_id] = (seq, state)
        self._entries.move_to_end(job_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def drop(self, job_id: str) -> None:
        self._entries.pop(job_id, None)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
