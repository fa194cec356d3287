"""The worker-local checkpoint cache: the latest state of jobs this worker just ran.

When the same worker continues the same job, the state comes from memory, not Redis. A state
is held under the sequence number and the id of the commit that made it: a sequence number
alone does not name one state once a Redis failover has lost a commit, since the chunk is
replayed and the replay may reach that sequence number with another state (stopped inside the
chunk, say), while the worker that made the lost commit still holds its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.checkpoint import Checkpoint  # types only: the codec loads torch


class LocalCheckpointCache:
    """A small LRU of (job id → (sequence number, commit id, checkpoint)), with hit counters."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[int, str, Checkpoint]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, job_id: str, seq: int, commit_id: str | None) -> Checkpoint | None:
        """The cached state if it is exactly the job's state at ``seq``, made by the commit
        ``commit_id`` (the record's; None: unknown, never a hit); counts hit or miss."""
        entry = self._entries.get(job_id)
        if entry is None or entry[0] != seq or commit_id is None or entry[1] != commit_id:
            self.misses += 1
            return None
        self._entries.move_to_end(job_id)
        self.hits += 1
        return entry[2]

    def held(self, job_id: str) -> tuple[int, str] | None:
        """The sequence number and commit id of the state held for ``job_id`` (no hit or miss
        counted)."""
        entry = self._entries.get(job_id)
        return None if entry is None else (entry[0], entry[1])

    def put(self, job_id: str, seq: int, commit_id: str, state: Checkpoint) -> None:
        self._entries[job_id] = (seq, commit_id, state)
        self._entries.move_to_end(job_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def drop(self, job_id: str) -> None:
        self._entries.pop(job_id, None)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
