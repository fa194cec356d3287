"""Eviction policies for one layer's expert slots, plus an offline simulator and Belady's bound.

Policies are pure bookkeeping on a logical access clock (one tick per expert access), so the
same objects drive the live cache and the benchmark's replay of routing traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

PolicyName = Literal["lru", "lfru"]


class EvictionPolicy(Protocol):
    """Chooses which resident expert of a layer leaves when a slot is needed."""

    name: str

    def record_access(self, expert: int) -> None:
        """Note that ``expert`` was used (a hit, or a load on miss)."""
        ...

    def choose_victim(self, candidates: Sequence[int]) -> int:
        """One of ``candidates`` (resident, unpinned) to evict."""
        ...

    def forget(self, expert: int) -> None:
        """``expert`` left the cache (eviction or idle unload)."""
        ...


class LruPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0
        self._last_use: dict[int, int] = {}

    def record_access(self, expert: int) -> None:
        self._clock += 1
        self._last_use[expert] = self._clock

    def choose_victim(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda e: (self._last_use.get(e, 0), e))

    def forget(self, expert: int) -> None:
        self._last_use.pop(expert, None)


class LfruPolicy:
    """Frequency with exponential decay (LRFU-style): score = sum of 2^(-age/half_life) over
    past accesses. A hot expert survives a burst of one-off ones; a formerly hot one ages out.

    The score survives eviction (routing history), so a returning hot expert is kept next time.
    """

    name = "lfru"

    def __init__(self, half_life_accesses: float = 64.0) -> None:
        self._clock = 0
        self._decay = 0.5 ** (1.0 / half_life_accesses)
        self._score: dict[int, float] = {}
        self._stamp: dict[int, int] = {}

    def record_access(self, expert: int) -> None:
        self._clock += 1
        self._score[expert] = self.score(expert) + 1.0
        self._stamp[expert] = self._clock

    def score(self, expert: int) -> float:
        """The decayed access count of ``expert`` now."""
        age = self._clock - self._stamp.get(expert, self._clock)
        return float(self._score.get(expert, 0.0) * self._decay**age)

    def choose_victim(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda e: (self.score(e), self._stamp.get(e, 0), e))

    def forget(self, expert: int) -> None:
        """History is kept on purpose: it is what makes this policy better than LRU."""


def make_policy(name: PolicyName) -> EvictionPolicy:
    """A fresh policy by name."""
    return LruPolicy() if name == "lru" else LfruPolicy()


def simulate_hits(steps: Sequence[Sequence[int]], slots: int, policy: EvictionPolicy) -> int:
    """Replay one layer's trace (the experts each token needs, pinned together) through a
    ``slots``-sized cache; returns the number of hits."""
    resident: set[int] = set()
    hits = 0
    for needed in steps:
        pinned = set(needed)
        for expert in needed:
            if expert in resident:
                hits += 1
            else:
                if len(resident) >= slots:
                    victims = [e for e in resident if e not in pinned] or sorted(resident)
                    victim = policy.choose_victim(victims)
                    resident.discard(victim)
                    policy.forget(victim)
                resident.add(expert)
            policy.record_access(expert)
    return hits


def belady_hits(steps: Sequence[Sequence[int]], slots: int) -> int:
    """Hits of Belady's offline optimum (evict the expert needed furthest in the future)."""
    flat = [e for needed in steps for e in needed]
    next_use = _next_use_positions(flat)
    resident: dict[int, int] = {}  # expert -> position of its next use
    hits = 0
    for pos, expert in enumerate(flat):
        if expert in resident:
            hits += 1
        elif len(resident) >= slots:
            victim = max(resident, key=lambda e: (resident[e], e))
            del resident[victim]
        resident[expert] = next_use[pos]
    return hits


def _next_use_positions(flat: Sequence[int]) -> list[int]:
    never = len(flat) + 1
    seen: dict[int, int] = {}
    result = [never] * len(flat)
    for pos in range(len(flat) - 1, -1, -1):
        result[pos] = seen.get(flat[pos], never)
        seen[flat[pos]] = pos
    return result
