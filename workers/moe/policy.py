"""Eviction policies for one layer's expert slots, plus an offline simulator and Belady's bound.

Policies are pure bookkeeping on a logical access clock (one tick per expert access), so the
same objects drive the live cache and the benchmark's replay of routing traces.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, get_args

PolicyName = Literal["lru", "lfru", "arc", "s3fifo", "lecar"]
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)


class EvictionPolicy(Protocol):
    """Chooses which resident expert of a layer leaves when a slot is needed.

    The cache calls, per token and layer: on a hit ``record_access``; on a miss, when full,
    ``choose_victim`` then ``forget`` for the victim, then loads and calls ``record_access``.
    ``forget`` also follows an idle unload. ``choose_victim`` may reorder the policy's queues
    (S3-FIFO promotes on the way), so the cache must evict what it returns. A resident expert
    the policy never saw (a load without an access) is adopted as newly inserted the first time
    it is a candidate; LFRU instead ranks it by its remembered score.
    """

    name: str

    def record_access(self, expert: int) -> None:
        """Note that ``expert`` was used (a hit, or just after its load on a miss)."""
        ...

    def choose_victim(self, candidates: Sequence[int]) -> int:
        """One of ``candidates`` (resident, unpinned, not empty) to evict."""
        ...

    def forget(self, expert: int) -> None:
        """``expert`` left the cache (eviction or idle unload)."""
        ...

    def resize(self, capacity: int) -> None:
        """The layer now holds ``capacity`` slots (the cache evicts any excess itself)."""
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
        for expert in sorted(e for e in candidates if e not in self._last_use):
            self.record_access(expert)  # adopted: a prefetch load counts as inserted now
        return min(candidates, key=lambda e: (self._last_use[e], e))

    def forget(self, expert: int) -> None:
        self._last_use.pop(expert, None)

    def resize(self, capacity: int) -> None:
        """Recency needs no capacity."""


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

    def resize(self, capacity: int) -> None:
        """Decayed scores need no capacity."""


class ArcPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): T1 holds experts seen once
    recently, T2 those seen at least twice; ghost lists B1/B2 remember what each evicted, and a
    ghost hit moves the target size ``p`` of T1 toward the list that would have kept it. A scan
    of one-off experts then only churns T1 and leaves the frequently used set in T2.

    Adapted to pinning: the victim is the LRU *candidate* of the preferred list. The ghost hit
    that adapts ``p`` is seen at ``record_access``, after the load, so it steers the next
    eviction rather than the one that made room for it.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = _checked_capacity(capacity)
        self.target_t1 = 0.0
        """ARC's ``p``: how many of the slots T1 should hold."""
        self.t1: OrderedDict[int, None] = OrderedDict()  # LRU first, in every list
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self._last_from_b2 = False

    def record_access(self, expert: int) -> None:
        if expert in self.t1:
            del self.t1[expert]
            self.t2[expert] = None
        elif expert in self.t2:
            self.t2.move_to_end(expert)
        else:
            self._insert(expert)
            self._trim_ghosts()

    def _insert(self, expert: int) -> None:
        self._last_from_b2 = expert in self.b2
        if expert in self.b1:
            step = max(len(self.b2) / len(self.b1), 1.0)
            self.target_t1 = min(float(self.capacity), self.target_t1 + step)
            del self.b1[expert]
            self.t2[expert] = None
        elif expert in self.b2:
            step = max(len(self.b1) / len(self.b2), 1.0)
            self.target_t1 = max(0.0, self.target_t1 - step)
            del self.b2[expert]
            self.t2[expert] = None
        else:
            self.t1[expert] = None

    def choose_victim(self, candidates: Sequence[int]) -> int:
        allowed = set(candidates)
        for expert in sorted(allowed - self.t1.keys() - self.t2.keys()):
            self.b1.pop(expert, None)  # adopted: an unseen resident expert was inserted just now
            self.b2.pop(expert, None)
            self.t1[expert] = None
        size_t1 = len(self.t1)
        from_t1 = size_t1 > 0 and (
            size_t1 > self.target_t1 or (self._last_from_b2 and size_t1 == self.target_t1)
        )
        lists = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
        found = (e for queue in lists for e in queue if e in allowed)
        return next(found, min(allowed))

    def forget(self, expert: int) -> None:
        if expert in self.t1:
            del self.t1[expert]
            self.b1[expert] = None
        elif expert in self.t2:
            del self.t2[expert]
            self.b2[expert] = None
        self._trim_ghosts()

    def resize(self, capacity: int) -> None:
        self.capacity = _checked_capacity(capacity)
        self.target_t1 = min(self.target_t1, float(self.capacity))
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """Keep ARC's directory bounds: |T1| + |B1| <= c and all four lists <= 2c."""
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            ghosts = self.b2 or self.b1
            if not ghosts:
                break
            ghosts.popitem(last=False)


class S3FifoPolicy:
    """S3-FIFO (Yang et al., SOSP'23): new experts enter a small FIFO (~10 % of the slots); one
    that is used again before it reaches the small FIFO's end moves to the main FIFO, the rest
    leave at once and are remembered in a ghost FIFO, whose experts re-enter straight into main.
    Main is a FIFO with reinsertion on a 2-bit use counter. One-hit wonders thus go first.

    Adapted to pinning: pinned experts at a FIFO's end are passed over and stay where they are.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        self._small_share = small_share
        self.capacity = _checked_capacity(capacity)
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first, in every queue
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    @property
    def small_target(self) -> int:
        """Size at which the small FIFO, rather than main, gives up the victim."""
        return max(1, round(self.capacity * self._small_share))

    def record_access(self, expert: int) -> None:
        if expert in self.small or expert in self.main:
            self.freq[expert] = min(self.freq[expert] + 1, self.MAX_FREQ)
        elif expert in self.ghost:
            del self.ghost[expert]
            self.main[expert] = None
            self.freq[expert] = 0
        else:
            self.small[expert] = None
            self.freq[expert] = 0

    def choose_victim(self, candidates: Sequence[int]) -> int:
        allowed = set(candidates)
        for expert in sorted(allowed - self.small.keys() - self.main.keys()):
            self.ghost.pop(expert, None)  # adopted: an unseen resident expert was inserted now
            self.small[expert] = None
            self.freq[expert] = 0
        victim = None
        if len(self.small) >= self.small_target or not allowed & self.main.keys():
            victim = self._victim_from_small(allowed)
        if victim is None:  # also when small's candidates were all promoted to main just now
            victim = self._victim_from_main(allowed)
        return min(allowed) if victim is None else victim

    def _victim_from_small(self, allowed: set[int]) -> int | None:
        for expert in list(self.small):
            if expert not in allowed:
                continue
            if self.freq[expert] == 0:
                return expert
            del self.small[expert]
            self.main[expert] = None
            self.freq[expert] = 0
        return None

    def _victim_from_main(self, allowed: set[int]) -> int | None:
        for _ in range(self.MAX_FREQ + 1):  # each pass lowers every candidate's counter
            for expert in list(self.main):
                if expert not in allowed:
                    continue
                if self.freq[expert] == 0:
                    return expert
                self.freq[expert] -= 1
                self.main.move_to_end(expert)
        return None

    def forget(self, expert: int) -> None:
        if expert in self.small:
            del self.small[expert]
            self.ghost[expert] = None
            while len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)
        self.main.pop(expert, None)
        self.freq.pop(expert, None)

    def resize(self, capacity: int) -> None:
        self.capacity = _checked_capacity(capacity)
        while len(self.ghost) > self.capacity:
            self.ghost.popitem(last=False)


class LecarPolicy:
    """LeCaR (Vietri et al., HotStorage'18): each eviction follows LRU or LFU, drawn by two
    weights; a miss on an expert that one of them evicted recently (its history) is that
    expert's regret, and shifts weight to the other. The draw is seeded, so replays repeat.
    """

    name = "lecar"

    def __init__(self, capacity: int, learning_rate: float = 0.45, seed: int = 0) -> None:
        self.capacity = _checked_capacity(capacity)
        self._learning_rate = learning_rate
        self._rng = random.Random(seed)
        self.weight_lru = 0.5
        self._clock = 0
        self._last_use: dict[int, int] = {}
        self._uses: dict[int, int] = {}
        self._history: dict[str, OrderedDict[int, tuple[int, int]]] = {
            "lru": OrderedDict(), "lfu": OrderedDict(),
        }  # expert -> (eviction clock, uses), oldest first
        self._pending: tuple[int, str] | None = None

    def record_access(self, expert: int) -> None:
        self._clock += 1
        if expert not in self._last_use:
            self._uses[expert] = self._regret(expert)
        self._last_use[expert] = self._clock
        self._uses[expert] += 1

    def _regret(self, expert: int) -> int:
        """Learn from a miss on an evicted expert; returns the use count it had."""
        for blamed, history in self._history.items():
            if expert in history:
                evicted_at, uses = history.pop(expert)
                discount = 0.005 ** (1.0 / self.capacity)
                reward = discount ** (self._clock - evicted_at)
                boost = math.exp(self._learning_rate * reward)
                lru, lfu = self.weight_lru, 1.0 - self.weight_lru
                lru, lfu = (lru, lfu * boost) if blamed == "lru" else (lru * boost, lfu)
                self.weight_lru = lru / (lru + lfu)
                return uses
        return 0

    def choose_victim(self, candidates: Sequence[int]) -> int:
        for expert in sorted(e for e in candidates if e not in self._last_use):
            self.record_access(expert)  # adopted: a prefetch load counts as inserted now
        by_lru = min(candidates, key=lambda e: (self._last_use[e], e))
        by_lfu = min(candidates, key=lambda e: (self._uses[e], self._last_use[e], e))
        rule = "lru" if self._rng.random() < self.weight_lru else "lfu"
        victim = by_lru if rule == "lru" else by_lfu
        self._pending = (victim, rule)
        return victim

    def forget(self, expert: int) -> None:
        if self._pending is not None and self._pending[0] == expert:
            history = self._history[self._pending[1]]
            history[expert] = (self._clock, self._uses[expert])
            while len(history) > self.capacity:
                history.popitem(last=False)
        self._pending = None
        self._last_use.pop(expert, None)
        self._uses.pop(expert, None)

    def resize(self, capacity: int) -> None:
        self.capacity = _checked_capacity(capacity)
        for history in self._history.values():
            while len(history) > self.capacity:
                history.popitem(last=False)


def _checked_capacity(capacity: int) -> int:
    if capacity < 1:
        raise ValueError(f"an expert eviction policy needs at least one slot, got {capacity}")
    return capacity


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """A fresh policy by name for a layer of ``capacity`` slots (needed by arc, s3fifo and
    lecar, whose lists are sized from it)."""
    if name not in POLICY_NAMES:
        raise ValueError(
            f"unknown expert eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    if name == "lru":
        return LruPolicy()
    if name == "lfru":
        return LfruPolicy()
    if capacity is None:
        raise ValueError(f"expert eviction policy {name!r} needs the layer's slot count")
    if name == "arc":
        return ArcPolicy(capacity)
    return S3FifoPolicy(capacity) if name == "s3fifo" else LecarPolicy(capacity)


def simulate_hits(steps: Sequence[Sequence[int]], slots: int, policy: EvictionPolicy) -> int:
    """Replay one layer's trace (the experts each token needs, pinned together) through a
    ``slots``-sized cache, calling ``policy`` in the live cache's order; returns the hits.

    No token may need more than ``slots`` distinct experts (the live cache refuses it too).
    """
    _check_groups_fit(steps, slots)
    policy.resize(max(slots, 1))
    resident: set[int] = set()
    hits = 0
    for needed in steps:
        pinned = set(needed)
        for expert in needed:
            if expert in resident:
                hits += 1
            else:
                if len(resident) >= slots:
                    victim = policy.choose_victim(sorted(resident - pinned))
                    resident.discard(victim)
                    policy.forget(victim)
                resident.add(expert)
            policy.record_access(expert)
    return hits


def simulate_hits_by_layer(
    trace: Mapping[int, Sequence[Sequence[int]]],
    slots: Mapping[int, int],
    policy_name: str,
) -> dict[int, int]:
    """Hits per layer of a fresh ``policy_name`` policy sized to each layer's ``slots``."""
    return {
        layer: simulate_hits(steps, slots[layer], make_policy(policy_name, max(slots[layer], 1)))
        for layer, steps in trace.items()
    }


def belady_hits(steps: Sequence[Sequence[int]], slots: int) -> int:
    """Hits of Belady's offline optimum under the same pinning as :func:`simulate_hits`: on a
    miss, evict the resident expert (outside the current token's group) needed furthest ahead.

    Next use is counted in tokens, so a group's experts all count as needed now; that keeps
    the rule optimal with pinning. No token may need more than ``slots`` distinct experts.
    """
    _check_groups_fit(steps, slots)
    next_step = _next_use_steps(steps)
    resident: dict[int, int] = {}  # expert -> the step of its next use
    furthest: list[tuple[int, int]] = []  # (-next step, -expert); stale entries skipped
    hits = 0
    for index, needed in enumerate(steps):
        for expert in needed:
            if expert in resident:
                hits += 1
                continue
            if len(resident) >= slots:
                del resident[_pop_furthest(furthest, resident)]
            resident[expert] = index  # pushed once the whole group is in, below
        for expert in set(needed):
            resident[expert] = next_step[index][expert]
            heapq.heappush(furthest, (-resident[expert], -expert))
    return hits


def belady_hit_curve(steps: Sequence[Sequence[int]], max_slots: int) -> list[int]:
    """``belady_hits`` at every size 0..max_slots; 0 below the largest group (infeasible)."""
    largest = max((len(set(needed)) for needed in steps), default=0)
    return [belady_hits(steps, s) if s >= max(largest, 1) else 0 for s in range(max_slots + 1)]


def _pop_furthest(furthest: list[tuple[int, int]], resident: Mapping[int, int]) -> int:
    """The resident expert needed furthest ahead. Members of the current group are still
    keyed by the current step, the nearest possible, so they come out last."""
    while True:
        neg_step, neg_expert = heapq.heappop(furthest)
        if resident.get(-neg_expert) == -neg_step:
            return -neg_expert


def _next_use_steps(steps: Sequence[Sequence[int]]) -> list[dict[int, int]]:
    """For each step and each expert it needs, the index of the next step needing it."""
    never = len(steps)
    upcoming: dict[int, int] = {}
    result: list[dict[int, int]] = [{} for _ in steps]
    for index in range(len(steps) - 1, -1, -1):
        result[index] = {e: upcoming.get(e, never) for e in steps[index]}
        upcoming.update(dict.fromkeys(steps[index], index))
    return result


def _check_groups_fit(steps: Sequence[Sequence[int]], slots: int) -> None:
    for index, needed in enumerate(steps):
        if len(set(needed)) > slots:
            raise ValueError(
                f"token {index} needs {len(set(needed))} experts at once but the layer holds "
                f"{slots} slots; replay with at least as many slots as the routing top-k"
            )
