"""The job record: one typed, frozen view of a job's Redis hash, and the only place where the
hash's strings become types (``JobRecord.from_hash``) and types become strings (``encode``).

Hash field names and encodings are the store's wire format: they never change, so a running
stack upgrades in place. Attribute names carry units (``submitted_at_s``); field names do not.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from typing import Any

from scheduler.cost import chunk_cost_key
from scheduler.lifecycle import JobState, SloClass
from scheduler.model import JobKind, ResourceProfile, Tier
from tasks.errors import SteplineError


class UnreadableRecord(SteplineError):
    """Raised when a job hash lacks a field or holds a value its type cannot take."""

    def __init__(self, job_id: str, problem: str) -> None:
        super().__init__(f"job {job_id}: unreadable record: {problem}")
        self.job_id = job_id
        self.problem = problem


# codecs: (decode from the hash string, encode to it) ------------------------------------------
def _float_text(value: float) -> str:
    return repr(float(value))


def _flag_text(value: bool) -> str:
    return "1" if value else "0"


def _opt(decode: Callable[[str], Any]) -> Callable[[str], Any]:
    """Absent and empty both mean None (workers clear a field by writing ``""``)."""
    return lambda raw: decode(raw) if raw else None


@lru_cache(maxsize=1024)
def _json_tuple(raw: str) -> tuple[Any, ...]:
    """A JSON list as a tuple, decoded once per distinct text (most jobs depend on nothing:
    ``[]``; the tuple is immutable, so sharing it is safe)."""
    return tuple(json.loads(raw))


_Codec = tuple[Callable[[str], Any], Callable[[Any], str]]
_TEXT: _Codec = (str, str)
_INT: _Codec = (int, str)
_FLOAT: _Codec = (float, _float_text)
_FLAG: _Codec = (lambda raw: raw == "1", _flag_text)
_OPT_TEXT: _Codec = (_opt(str), lambda v: "" if v is None else str(v))
_OPT_INT: _Codec = (_opt(int), lambda v: "" if v is None else str(v))
_OPT_FLOAT: _Codec = (_opt(float), lambda v: "" if v is None else _float_text(v))
_JSON_LIST: _Codec = (_json_tuple, lambda v: json.dumps(list(v)))
_NAMES: _Codec = (lambda raw: tuple(raw.split(",")) if raw else (), ",".join)


def _enum(kind: type[Any]) -> _Codec:
    return (kind, lambda v: kind(v).value)


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job as stored: what it is, where it stands, and its bookkeeping."""

    # identity and spec
    job_id: str
    kind: JobKind
    slo: SloClass
    tenant: str
    params: Mapping[str, Any]
    submitted_at_s: float
    deadline_at_s: float
    """Absolute deadline: submit time plus the job's own deadline or its class target."""
    # the plan of chunks
    num_chunks: int
    cost_key: str
    cost_units: tuple[float, ...]
    # where it stands
    state: JobState
    next_chunk: int
    """Chunks committed so far; the index of the next chunk to run."""
    seq: int
    """Commits so far: every chunk commit is a compare-and-set on it."""
    epoch: int
    """Bumped on every requeue: a message of an older epoch is stale."""
    queue: str
    updated_at_s: float
    # optional, with the value a record written before the field existed means
    tier: Tier = Tier.STANDARD
    depends_on: tuple[str, ...] = ()
    chunk_names: tuple[str, ...] = ()
    resource_profile: ResourceProfile = ResourceProfile.COMPUTE
    atomic: bool = False
    """FIFO baseline: one task runs every chunk."""
    shed_if_late: bool = False
    """Under overload, expire the job once it cannot meet its deadline (else demote it)."""
    preempt: bool = False
    cancel: bool = False
    preemptions: int = 0
    service_s: float = 0.0
    started_at_s: float | None = None
    finished_at_s: float | None = None
    running_on: str | None = None
    chunk_started_at_s: float | None = None
    lease_until_s: float | None = None
    ckpt_seq: int | None = None
    ckpt_chunk: int | None = None
    commit_id: str | None = None
    """The id its worker gave the commit that made the job's state at ``seq`` (unique per
    commit; None before the first). A commit a Redis failover loses is replayed, and the replay
    may reach the same ``seq`` with another state (a chunk stopped inside advances ``seq``, not
    ``next_chunk``): only this id tells a worker's in-memory state from the job's."""
    published: int | None = None
    """The last chunk index published to a queue."""
    last_task_id: str | None = None
    queued_at_s: float | None = None
    preempted_at_s: float | None = None
    level: int | None = None
    level_mark_s: float = 0.0
    stuck: int = 0
    """Stuck-chunk requeues so far (each doubles the allowance)."""
    error: str | None = None
    artifact: str | None = None
    media_type: str | None = None
    expert_version: str | None = None
    first_estimate_s: float | None = None
    """The scheduler's estimate of the job's whole service time at its first release (the bench
    compares it with ``service_s`` at the end)."""
    events_ttl_s: float | None = None
    """How long the job's event stream is kept once the job has ended (None: for ever); the
    stream is never trimmed while the job lives."""
    batch_group: str | None = None
    """Jobs of one group (model and shape) may share a batched forward per step; None: the job
    always runs alone (exact, or a kind or model that does not batch)."""
    batch: str | None = None
    """The batch the job's current (or next) chunk runs in (None: its chunks run alone)."""
    batch_growth: float | None = None
    """The job's own batched-step growth (a simulated job's ``batch_growth``); None: the
    policy's table by cost key."""
    degraded: str | None = None
    """JSON of the degradation admission chose (``scheduler.degradation.Degradation``: steps,
    full_steps, reason); None: the job runs at the quality it asked for."""
    rev: int = 0
    """Writes of the record so far: every writer bumps it with the write's mark on the change
    stream (which carries the new value), so one revision is one content of the record."""

    @classmethod
    def from_hash(cls, raw: Mapping[str, str] | Mapping[bytes, bytes]) -> JobRecord:
        """Parse a job hash; raises :class:`UnreadableRecord` naming the field at fault."""
        as_bytes = isinstance(next(iter(raw), None), bytes)  # as Redis gives it
        if as_bytes:
            get: Callable[[Any], Any] = raw.get  # decoded as read: only the fields parsed
            names: tuple[Any, ...] = _FIELD_NAMES_BYTES
        else:
            get, names = {_str(k): _str(v) for k, v in raw.items()}.get, _FIELD_NAMES
        values: list[Any] = list(_DEFAULTS)
        for (i, name, decode, required), key in zip(_DECODERS, names, strict=True):
            found = get(key)
            if found is None:
                if required:
                    raise UnreadableRecord(_job_id_of(raw), f"field {name!r} missing")
                continue
            if as_bytes:
                found = found.decode()
            try:
                values[i] = decode(found)
            except (ValueError, TypeError) as exc:
                raise UnreadableRecord(_job_id_of(raw), f"{name}={found!r}: {exc}") from exc
        record = cls(*values)
        problem = record.inconsistency()
        if problem is not None:
            raise UnreadableRecord(record.job_id, problem)
        return record

    def with_fields(self, fields: Mapping[str, str]) -> JobRecord:
        """The record once ``fields`` (hash field → text, as :func:`encode` gives them) are
        written over it: what :meth:`from_hash` reads back then (a field the record does not
        know is ignored, as there); raises :class:`UnreadableRecord` as it would."""
        values = list(_all_values(self))
        for name, text in fields.items():
            known = _BY_NAME.get(name)
            if known is None:
                continue
            i, decode = known
            try:
                values[i] = decode(text)
            except (ValueError, TypeError) as exc:
                raise UnreadableRecord(self.job_id, f"{name}={text!r}: {exc}") from exc
        record = JobRecord(*values)
        problem = record.inconsistency()
        if problem is not None:
            raise UnreadableRecord(self.job_id, problem)
        return record

    def inconsistency(self) -> str | None:
        """What makes this record impossible to schedule, or None."""
        if self.num_chunks < 1:
            return f"num_chunks {self.num_chunks} < 1"
        if not 0 <= self.next_chunk <= self.num_chunks:
            return f"next_chunk {self.next_chunk} outside 0..{self.num_chunks}"
        if len(self.cost_units) != self.num_chunks:
            return f"{len(self.cost_units)} cost units for {self.num_chunks} chunks"
        return None

    @property
    def remaining_cost_units(self) -> float:
        return float(sum(self.cost_units[self.next_chunk:]))

    @property
    def remaining_units_by_key(self) -> tuple[tuple[str, float], ...]:
        """Cost units still to run per chunk-kind cost key (:func:`chunk_cost_key`), in the
        order the kinds come; empty when the record names no chunks (the job's key then)."""
        if len(self.chunk_names) != self.num_chunks:
            return ()
        units: dict[str, float] = {}
        for index in range(self.next_chunk, self.num_chunks):
            key = chunk_cost_key(self.cost_key, self.chunk_names[index])
            units[key] = units.get(key, 0.0) + self.cost_units[index]
        return tuple(units.items())

    @property
    def chunk_running_since_s(self) -> float | None:
        """When a RUNNING job's chunk began: its claim or the last commit, whichever is later
        (an atomic job commits several chunks under one claim); None unless RUNNING."""
        if self.state is not JobState.RUNNING:
            return None
        return max(self.updated_at_s, self.chunk_started_at_s or self.updated_at_s)

    @property
    def chunk_name(self) -> str:
        """The name of the next chunk (``denoise[3]``), for logs and Flower."""
        index = self.next_chunk
        return self.chunk_names[index] if index < len(self.chunk_names) else f"chunk[{index}]"

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at_s is None else self.finished_at_s - self.submitted_at_s


def encode(**values: Any) -> dict[str, str]:
    """Typed record attributes as hash fields, for the store's ``expect`` and ``updates``:
    ``encode(state=JobState.QUEUED, epoch=3)`` is ``{"state": "QUEUED", "epoch": "3"}``."""
    out = {}
    for attr, value in values.items():
        name, (_, to_text) = _FIELDS[attr]
        out[name] = to_text(value)
    return out


def field_name(attr: str) -> str:
    """The hash field behind a record attribute (``submitted_at_s`` → ``submitted_at``)."""
    return _FIELDS[attr][0]


@lru_cache(maxsize=1024)
def _cost_units(raw: str) -> tuple[float, ...]:
    """A job's cost units never change once stored, and every claim reads them: decoded once per
    distinct value (the tuple is immutable, so sharing it is safe)."""
    return tuple(float(u) for u in json.loads(raw))


def _str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


_FIELDS: dict[str, tuple[str, _Codec]] = {
    "job_id": ("id", _TEXT),
    "kind": ("kind", _enum(JobKind)),
    "slo": ("slo", _enum(SloClass)),
    "tenant": ("tenant", _TEXT),
    "tier": ("tier", _enum(Tier)),
    "params": ("params", (json.loads, lambda v: json.dumps(dict(v), sort_keys=True))),
    "depends_on": ("depends_on", _JSON_LIST),
    "submitted_at_s": ("submitted_at", _FLOAT),
    "deadline_at_s": ("deadline_at", _FLOAT),
    "num_chunks": ("num_chunks", _INT),
    "chunk_names": ("chunk_names", _NAMES),
    "cost_key": ("cost_key", _TEXT),
    "cost_units": ("cost_units", (_cost_units, lambda v: json.dumps(list(v)))),
    "resource_profile": ("resource_profile", _enum(ResourceProfile)),
    "atomic": ("atomic", _FLAG),
    "shed_if_late": ("shed_if_late", _FLAG),
    "state": ("state", _enum(JobState)),
    "next_chunk": ("next_chunk", _INT),
    "seq": ("seq", _INT),
    "epoch": ("epoch", _INT),
    "queue": ("queue", _TEXT),
    "updated_at_s": ("updated_at", _FLOAT),
    "preempt": ("preempt", _FLAG),
    "cancel": ("cancel", _FLAG),
    "preemptions": ("preemptions", _INT),
    "service_s": ("service_s", _FLOAT),
    "started_at_s": ("started_at", _OPT_FLOAT),
    "finished_at_s": ("finished_at", _OPT_FLOAT),
    "running_on": ("running_on", _OPT_TEXT),
    "chunk_started_at_s": ("chunk_started_at", _OPT_FLOAT),
    "lease_until_s": ("lease_until", _OPT_FLOAT),
    "ckpt_seq": ("ckpt_seq", _OPT_INT),
    "ckpt_chunk": ("ckpt_chunk", _OPT_INT),
    "commit_id": ("commit_id", _OPT_TEXT),
    "published": ("published", _OPT_INT),
    "last_task_id": ("last_task_id", _OPT_TEXT),
    "queued_at_s": ("queued_at", _OPT_FLOAT),
    "preempted_at_s": ("preempted_at", _OPT_FLOAT),
    "level": ("level", _OPT_INT),
    "level_mark_s": ("level_mark", _FLOAT),
    "stuck": ("stuck", _INT),
    "error": ("error", _OPT_TEXT),
    "artifact": ("artifact", _OPT_TEXT),
    "media_type": ("media_type", _OPT_TEXT),
    "expert_version": ("expert_version", _OPT_TEXT),
    "first_estimate_s": ("first_estimate", _OPT_FLOAT),
    "events_ttl_s": ("events_ttl", _OPT_FLOAT),
    "batch_group": ("batch_group", _OPT_TEXT),
    "batch": ("batch", _OPT_TEXT),
    "batch_growth": ("batch_growth", _OPT_FLOAT),
    "degraded": ("degraded", _OPT_TEXT),
    "rev": ("rev", _INT),
}

_REQUIRED = frozenset(f.name for f in fields(JobRecord) if f.default is MISSING)
_ATTRS = tuple(f.name for f in fields(JobRecord))
"""The record's attributes in the order its constructor takes them."""
_DEFAULTS = tuple(None if f.default is MISSING else f.default for f in fields(JobRecord))
_DECODERS = tuple((_ATTRS.index(attr), name, decode, attr in _REQUIRED)
                  for attr, (name, (decode, _)) in _FIELDS.items())
"""(constructor position, hash field, decode, required) of every attribute."""
_FIELD_NAMES: tuple[str, ...] = tuple(decoder[1] for decoder in _DECODERS)
_FIELD_NAMES_BYTES = tuple(name.encode() for name in _FIELD_NAMES)


def _job_id_of(raw: Mapping[str, str] | Mapping[bytes, bytes]) -> str:
    for key, value in raw.items():
        if _str(key) == "id":
            return _str(value)
    return "?"


_BY_NAME: dict[str, tuple[int, Callable[[str], Any]]] = {
    name: (_ATTRS.index(attr), decode) for attr, (name, (decode, _)) in _FIELDS.items()}
_all_values = operator.attrgetter(*_ATTRS)
