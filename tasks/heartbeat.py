"""A worker's heartbeat (``sl:worker:<name>``, JSON): one frozen record and its one codec, used by
the worker that writes it and by every reader (tick, affinity, stats, metrics, dashboard, bench),
and its key in Redis with its entry in the live-worker registry."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks import keys
from tasks.errors import HeartbeatError

log = logging.getLogger(__name__)

SAME_CHUNK_S = 0.01
"""Slack when matching times the worker wrote of one chunk (its claim, its heartbeat's
``chunk_since``, a load's start): a heartbeat about an earlier chunk is older by a chunk."""
CACHE_ENTRIES = ("ckpt_cache", "expert_cache")
"""Entries holding a cache's counters (``hits``, ``misses`` …), in wire order."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a worker advertises about itself every third of a chunk lease."""

    name: str
    """Celery node name (``w1@host``)."""
    busy_job: str | None = None
    """The job whose chunk it runs now (a batch's first member)."""
    queues: tuple[str, ...] = ()
    """The queues it consumes now (remote control may have changed them)."""
    batch: int = 0
    """Jobs in the chunk or batch it runs now (0: idle)."""
    device: str = "cpu"
    ts: float | None = None
    """When it was written (the worker's clock, Unix seconds); None from a partial heartbeat."""
    chunks_run: int = 0
    ckpt_cache: Mapping[str, float] = field(default_factory=dict)
    """The local checkpoint cache: ``hits``, ``misses``, ``hit_rate``."""
    experts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per loaded MoE model, its expert cache's residency summary (``resident`` hex masks per
    layer, ``hot`` experts)."""
    hop_profile: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Seconds (``s``) and counts (``n``) per phase of a hop, cumulative."""
    expert_cache: Mapping[str, float] = field(default_factory=dict)
    """The expert caches' counters summed over models (absent from the wire while empty)."""
    warm: bool = True
    """Whether its warm-up (a tiny job of every recipe, ``warm_start``) has run; a heartbeat
    without the entry (an older worker) counts as warm."""
    warmed: tuple[str, ...] = ()
    """The recipes its warm-up ran."""
    residency: Mapping[str, Any] = field(default_factory=dict)
    """The built models it holds (``workers.residency``): bytes per model in the ``device`` and
    ``host`` tiers, its budgets, ``loads`` and ``load_s`` per source tier, evictions and the
    ``recent`` loads (absent from the wire until the worker builds a runner)."""

    chunk_since: float | None = None
    """When the chunk it runs now began (its clock, Unix seconds); None while idle."""
    left_s: float | None = None
    """Expected seconds of its running job's remaining work from ``chunk_since`` (None: not
    known)."""
    idle_since: float | None = None
    """Since when (its clock, Unix seconds) it has been idle, consuming the queues it lists
    now: a message on one of them since then would have been taken already. None while it
    runs a chunk, before it consumes, and from an older worker."""

    def free_in_s(self, now_s: float) -> float | None:
        """Seconds until the job it runs now is expected to end (0: overdue, any moment;
        None: idle, or not known): the rest of a load its chunk waits for, then the rest of
        its work. Its next chunks stay on it: it is not free for another job's work before
        then, except by interleaving with it."""
        if self.busy_job is None or self.chunk_since is None or self.left_s is None:
            return None
        load_s, began = self.load_phase(self.chunk_since, now_s) or (0.0, self.chunk_since)
        return load_s + max(0.0, began + self.left_s - now_s)

    def load_phase(self, chunk_since_s: float, now_s: float,
                   estimate: Callable[[str, str], float] | None = None
                   ) -> tuple[float, float] | None:
        """What it says of the load of its chunk that began at ``chunk_since_s`` (its clock):
        (seconds of the load still to come, when the chunk's work began or begins to count),
        or None when it says nothing of that chunk (no load, or the heartbeat predates the
        chunk). A load under way counts none of the chunk's work as run yet; one the worker
        could not size is sized by ``estimate`` (residency key, source tier), else counts 0
        seconds still to come; an ended one starts the work at its end."""
        since = self.chunk_since
        if since is None or since < chunk_since_s - SAME_CHUNK_S:
            return None
        window = self.residency.get("loading")
        if isinstance(window, Mapping) and _number(window.get("since")) is not None:
            began = float(window["since"])
            if began >= since - SAME_CHUNK_S:
                expected = _number(window.get("expected_s"))
                source = window.get("from")
                if expected is None and estimate is not None and isinstance(source, str):
                    expected = estimate(str(window.get("model", "")), source)
                return (0.0 if expected is None else max(began + expected - now_s, 0.0),
                        max(now_s, began))
        ended = _number(self.residency.get("loaded_at"))
        if ended is not None and ended >= since - SAME_CHUNK_S:
            return 0.0, ended
        return None

    def resident_bytes(self, tier: str = "device") -> int:
        """Bytes of the models it holds in ``tier`` (``device`` or ``host``)."""
        held = self.residency.get(tier, {})
        return sum(int(v) for v in held.values()) if isinstance(held, Mapping) else 0

    def age_s(self, now_s: float) -> float | None:
        return None if self.ts is None else now_s - self.ts

    def cache_counts(self) -> dict[str, tuple[float, float]]:
        """(hits, misses) of each cache this worker reports counters for."""
        counts = {}
        for entry in CACHE_ENTRIES:
            counters = getattr(self, entry)
            if "hits" in counters and "misses" in counters:
                counts[entry] = (float(counters["hits"]), float(counters["misses"]))
        return counts

    def encode(self) -> str:
        """The wire form: a JSON object, keys as workers have always written them."""
        body: dict[str, Any] = {
            "name": self.name, "busy_job": self.busy_job, "queues": list(self.queues),
            "batch": self.batch, "device": self.device, "ts": self.ts,
            "chunks_run": self.chunks_run, "ckpt_cache": dict(self.ckpt_cache),
            "experts": dict(self.experts), "hop_profile": dict(self.hop_profile),
            "warm": self.warm, "warmed": list(self.warmed),
        }
        if self.expert_cache:
            body["expert_cache"] = dict(self.expert_cache)
        if self.residency:
            body["residency"] = dict(self.residency)
        if self.chunk_since is not None:
            body["chunk_since"] = self.chunk_since
        if self.left_s is not None:
            body["left_s"] = round(self.left_s, 6)
        if self.idle_since is not None:
            body["idle_since"] = self.idle_since
        return json.dumps(body)

    @classmethod
    def decode(cls, raw: bytes | str, name: str = "") -> Heartbeat:
        """A heartbeat from its wire form. A missing entry (an older or partial heartbeat) takes
        its default and ``name`` stands in for a missing name; an entry of the wrong type, or a
        body that is no JSON object, raises :class:`HeartbeatError` naming it."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise HeartbeatError(f"heartbeat of {name or '?'} is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HeartbeatError(f"heartbeat of {name or '?'} is not a JSON object")
        fields = _Fields(body, str(body.get("name") or name))
        return cls(
            name=fields.who, busy_job=fields.get("busy_job", str, None),
            queues=tuple(fields.strings("queues")), batch=fields.get("batch", int, 0),
            device=fields.get("device", str, "cpu"), ts=fields.number("ts"),
            chunks_run=fields.get("chunks_run", int, 0),
            ckpt_cache=fields.get("ckpt_cache", dict, {}),
            experts=fields.get("experts", dict, {}),
            hop_profile=fields.get("hop_profile", dict, {}),
            expert_cache=fields.get("expert_cache", dict, {}),
            warm=fields.get("warm", bool, True), warmed=tuple(fields.strings("warmed")),
            residency=fields.get("residency", dict, {}),
            chunk_since=fields.number("chunk_since"), left_s=fields.number("left_s"),
            idle_since=fields.number("idle_since"),
        )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


@dataclass(frozen=True, slots=True)
class _Fields:
    """Typed access to the entries of one decoded body; wrong types raise naming the entry."""

    body: Mapping[str, Any]
    who: str

    def get(self, key: str, kind: type, default: Any) -> Any:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise HeartbeatError(f"heartbeat of {self.who}: {key} is {type(value).__name__}, "
                                 f"not {kind.__name__}")
        return value

    def number(self, key: str) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HeartbeatError(f"heartbeat of {self.who}: {key} is {type(value).__name__}, "
                                 "not a number")
        return float(value)

    def strings(self, key: str) -> list[str]:
        values = self.get(key, list, [])
        if not all(isinstance(v, str) for v in values):
            raise HeartbeatError(f"heartbeat of {self.who}: {key} must be a list of strings")
        return list(values)


def write_heartbeat(pipe: Any, beat: Heartbeat, lease_s: float) -> None:
    """Queue a worker's heartbeat on ``pipe``: its key (expiring with its lease) and its entry in
    ``sl:workers:live`` (when it lapses), where the tick finds it without scanning."""
    lease_ms = int(lease_s * 1000)
    pipe.set(keys.worker(beat.name), beat.encode(), px=lease_ms)
    pipe.zadd(keys.WORKERS_LIVE, {beat.name: int(time.time() * 1000) + lease_ms})


def decode_heartbeats(names: Sequence[bytes | str], bodies: Sequence[bytes | None]
                      ) -> dict[str, Heartbeat]:
    """Heartbeats by worker name from their keys and bodies (a key that expired is skipped, an
    unreadable body logged and skipped)."""
    beats: dict[str, Heartbeat] = {}
    for key, raw in zip(names, bodies, strict=True):
        if raw is None:  # expired between the scan and the read
            continue
        name = key.decode() if isinstance(key, bytes) else key
        try:
            beat = Heartbeat.decode(raw, name.removeprefix(keys.WORKER_PREFIX))
        except HeartbeatError as exc:
            log.warning("%s; skipped", exc)
            continue
        beats[beat.name] = beat
    return beats
