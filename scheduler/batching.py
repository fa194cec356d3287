"""Step-level batching in the plan: which in-flight slots compatible jobs share.

A slot is one worker's worth of work. Without batching each job in flight takes a slot; with it,
jobs of one batch group (same model and shape, on the same queue) share a slot and run as one
batched forward per step, up to ``max_batch`` of them. A batch's step is slower than one job's:
``1 + growth × (size − 1)`` times a lone step (``growth`` per model: about 1 where a lone step
already fills the device, near 0 where it leaves the device idle). So a job joins a slot only
when every member that can still meet its deadline still can at the larger size; the origin and
exact jobs (no batch group) always run alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler.cost import CostModel
from scheduler.errors import InvalidPolicy
from scheduler.model import JobView


def _default_growth() -> dict[str, float]:
    # A batched step's slowdown per extra member, relative to a lone step. GPU shapes: small
    # images leave the device mostly idle, 1024² fills it (step-costs.md: FLUX per-image time is
    # flat from batch 1 to 16, so no gain), MoE decode is memory-bound; the tiny CPU recipes as
    # `tests/bench/bench_batching.py` measures them; a simulated job's growth is its own.
    return {"image-256": 0.15, "image-512": 0.5, "image-1024": 1.0, "video": 1.0,
            "text": 0.1, "simulated": 0.2, "dit-tiny": 0.15, "pixart-tiny": 0.15,
            "wan-tiny": 0.2, "mixtral-tiny": 0.25, "qwen3-moe-tiny": 0.25, "olmoe-tiny": 0.25}


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """The batching knobs of the policy (``scheduler.batching`` in the settings)."""

    enabled: bool = True
    max_batch: int = 8
    """Most jobs in one batched forward."""
    growth: Mapping[str, float] = field(default_factory=_default_growth)
    """Per cost-key prefix (longest match wins): how much a batched step slows per extra
    member, relative to a lone step."""
    default_growth: float = 1.0
    """For a model with no entry: batching gains nothing (the step grows in proportion), so
    jobs are not packed."""
    learn: bool = True
    """Prefer the growth measured from batched steps (:func:`learned_growth`) to the table."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 256:
            raise InvalidPolicy(f"batching.max_batch must be in [1, 256], got {self.max_batch}")
        for key, value in {**self.growth, "default": self.default_growth}.items():
            if not 0.0 <= value <= 4.0:
                raise InvalidPolicy(f"batching growth {key!r} must be in [0, 4], got {value}")

    def growth_of(self, cost_key: str) -> float:
        """The growth of the longest matching prefix of ``cost_key``."""
        best, found = -1, self.default_growth
        for prefix, value in self.growth.items():
            if cost_key.startswith(prefix) and len(prefix) > best:
                best, found = len(prefix), value
        return found

    def pays(self, growth: float) -> bool:
        """Whether batching at this growth gives more work per second than running alone."""
        return self.enabled and self.max_batch > 1 and growth < 1.0


def batch_cost_key(chunk_key: str, size: int) -> str:
    """The cost-model key a batched step of ``size`` jobs is timed under: the chunk kind's key
    (``dit-tiny:256x256x1#denoise``) with the size (``…@b4``)."""
    return f"{chunk_key}@b{size}"


def learned_growth(cost: CostModel, chunk_key: str, max_batch: int,
                   min_samples: int) -> float | None:
    """The growth measured for one chunk kind: each batch size b timed often enough, against
    the lone step, gives (t_b / t_1 − 1) / (b − 1); their mean weighted by b − 1 (larger
    batches say more). None until the lone step and one batch size have ``min_samples``."""
    if cost.samples(chunk_key) < max(min_samples, 1):
        return None
    lone = cost.seconds_per_unit(chunk_key)
    weighted = weights = 0.0
    for size in range(2, max_batch + 1):
        key = batch_cost_key(chunk_key, size)
        if cost.samples(key) >= max(min_samples, 1):
            ratio = cost.seconds_per_unit(key) / lone
            weighted += (ratio - 1.0)
            weights += size - 1
    if weights == 0:
        return None
    return min(max(weighted / weights, 0.0), 4.0)


class GrowthTable:
    """Each job's batched-step growth for one tick: its own figure (a simulated job), else as
    measured for its main chunk kind, else the policy's table. The measured figure of a chunk
    kind is worked out once a tick (a memo of a pure function of the cost model: the answers do
    not depend on the order of the questions)."""

    __slots__ = ("_config", "_cost", "_learned", "_min_samples", "_table")

    def __init__(self, cost: CostModel, config: BatchingConfig, min_samples: int) -> None:
        self._cost, self._config, self._min_samples = cost, config, min_samples
        self._learned: dict[str, float | None] = {}
        self._table: dict[str, float] = {}
        """The table's growth by cost key (a prefix search, asked of many jobs)."""

    def of(self, job: JobView) -> float:
        if job.batch_growth is not None:
            return job.batch_growth
        config = self._config
        if config.learn and job.remaining_units_by_key:
            key = max(job.remaining_units_by_key, key=lambda pair: pair[1])[0]
            if key not in self._learned:
                self._learned[key] = learned_growth(self._cost, key, config.max_batch,
                                                    self._min_samples)
            found = self._learned[key]
            if found is not None:
                return found
        growth = self._table.get(job.cost_key)
        if growth is None:
            growth = self._table[job.cost_key] = config.growth_of(job.cost_key)
        return growth


def batch_slowdown(growth: float, size: int) -> float:
    """A batched step of ``size`` members over a lone step."""
    return 1.0 + growth * (max(size, 1) - 1)


@dataclass(frozen=True, slots=True)
class PlacedSlot:
    """One slot of a finished packing: its members best first, its group and running batch."""

    members: tuple[int, ...]
    group: tuple[str, str] | None
    batch_id: str | None


@dataclass(slots=True)
class Slot:
    """One worker's worth of in-flight work: a lone job, or a batch of compatible jobs."""

    members: list[int]
    group: tuple[str, str] | None
    """(batch group, queue) of a shareable slot; None: this slot is never shared."""
    growth: float = 1.0
    batch_id: str | None = None
    """The running batch the members are in (None: none yet; a new one forms on release)."""
    pending: set[int] = field(default_factory=set)
    """Members of the batch in flight not placed yet (they ride along when their turn comes)."""

    @property
    def size(self) -> int:
        return len(self.members) + len(self.pending)


@dataclass(slots=True)
class SlotPacker:
    """Fills slots in rank order: a job joins a slot of its group — one placed already, or a
    batch of its group in flight — when the batch's longer step keeps every member on time;
    otherwise it takes a slot of its own while any is left.

    ``inflight`` names the members of each batch in flight (their group is the first placed
    member's); ``slack_s(i)`` is job i's slack alone (deadline − now − its remaining work
    alone); ``remaining_s(i)`` its remaining work alone."""

    config: BatchingConfig
    cap: int
    slack_s: Callable[[int], float]
    remaining_s: Callable[[int], float]
    inflight: Mapping[str, tuple[tuple[str, str], list[int]]] = field(default_factory=dict)
    """batch id → (its group, its members in flight)."""
    slots: list[Slot] = field(default_factory=list)
    _open: dict[tuple[str, str], list[Slot]] = field(default_factory=dict)
    _by_batch: dict[str, Slot] = field(default_factory=dict)

    def placed(self) -> tuple[PlacedSlot, ...]:
        """The slots as packed so far, as values."""
        return tuple(PlacedSlot(tuple(slot.members), slot.group, slot.batch_id)
                     for slot in self.slots)

    @property
    def full(self) -> bool:
        return len(self.slots) >= self.cap

    def add(self, i: int, group: tuple[str, str] | None, growth: float,
            batch_id: str | None = None, may_open: bool = True) -> Slot | None:
        """Place job ``i`` (``group`` None: alone) in a slot and return it; None when no slot
        takes it and a new one may not be opened (``may_open``, or all ``cap`` taken).

        A job in flight in batch ``batch_id`` stays with the rest of that batch or takes a
        slot of its own: batches in flight are never merged (their messages are on queues)."""
        if group is not None and batch_id is not None and batch_id in self.inflight:
            slot = self._by_batch.get(batch_id)
            if slot is None and (self.full or not may_open):
                return None
            slot = slot or self._open_slot(group, growth, batch_id)
            slot.pending.discard(i)
            slot.members.append(i)
            return slot
        if group is not None and batch_id is None:
            slot = self._join(i, group, growth, may_open)
            if slot is not None:
                return slot
        if self.full or not may_open:
            return None
        slot = Slot([i], group, growth)
        self.slots.append(slot)
        if group is not None:
            self._open.setdefault(group, []).append(slot)
        return slot

    def _open_slot(self, group: tuple[str, str], growth: float, batch_id: str | None) -> Slot:
        members = self.inflight[batch_id][1] if batch_id is not None else []
        slot = Slot([], group, growth, batch_id, pending=set(members))
        self.slots.append(slot)
        self._open.setdefault(group, []).append(slot)
        if batch_id is not None:
            self._by_batch[batch_id] = slot
        return slot

    def _join(self, i: int, group: tuple[str, str], growth: float,
              may_open: bool) -> Slot | None:
        """A slot of ``group`` that job ``i`` fits in: one placed already, else a batch of the
        group in flight not placed yet (joining it brings it into the plan, in a new slot)."""
        for slot in self._open.get(group, ()):
            if self._fits(slot, i):
                slot.members.append(i)
                return slot
        if self.full or not may_open:
            return None
        for batch_id, (batch_group, members) in self.inflight.items():
            if batch_group != group or batch_id in self._by_batch:
                continue
            if self._fits(Slot([], group, growth, batch_id, pending=set(members)), i):
                slot = self._open_slot(group, growth, batch_id)
                slot.members.append(i)
                return slot
        return None

    def _fits(self, slot: Slot, i: int) -> bool:
        size = slot.size + 1
        if size > self.config.max_batch:
            return False
        extra = batch_slowdown(slot.growth, size) - 1.0
        for m in (*slot.members, *slot.pending, i):
            slack_s = self.slack_s(m)
            # a member already past saving alone gains nothing from running alone
            if slack_s >= 0.0 and self.remaining_s(m) * extra > slack_s:
                return False
        return True
