"""What /v1/stats, /metrics and the dashboard report, read from Redis: SLO attainment over recent
jobs and over a sliding window, queue depths and the age of each queue's oldest waiting message,
the origin, the admission load, worker heartbeats and their cache hit rates."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pydantic import BaseModel, Field

from app.schemas import ClassStats, StatsView, WorkerInfo
from scheduler.fairness import ServiceLedger
from scheduler.lifecycle import JobState, SloClass
from tasks.heartbeat import Heartbeat
from tasks.live_counts import LiveByState
from tasks.read_model import JobOutcome, ReadModel
from tasks.record import JobRecord, UnreadableRecord
from tasks.routing import ALL_QUEUES, BATCH_TASK, CHUNK_TASK, affinity_worker
from tasks.settings import Settings

log = logging.getLogger(__name__)

KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
"""Kombu's Redis transport keeps priority p of queue q in list ``q\\x06\\x16p`` (p=0: ``q``)."""

ENDED = frozenset({JobState.DONE, JobState.FAILED, JobState.EXPIRED})
"""States that count toward SLO attainment (a cancelled job is the client's choice)."""

WINDOW_SLACK_S = 5.0
"""The done stream's entry ids are Redis's clock and ``finished_at`` the committing worker's: the
window reads this much further back in the stream, then keeps jobs by ``finished_at``."""

TAIL_SCAN = 16
"""Messages read from the delivery end of each kombu list when looking for the oldest one."""


class WindowClassStats(BaseModel):
    """SLO attainment and latency of one class over the jobs that ended in the sliding window."""

    finished: int = Field(description="Jobs that ended (DONE, FAILED, EXPIRED) in the window.")
    met: int = Field(description="Of those, DONE by their deadline.")
    attainment: float | None = Field(description="met / finished; null with none finished.")
    p50_latency_s: float | None = Field(default=None, description="Submit-to-done, DONE jobs.")
    p95_latency_s: float | None = Field(default=None, description="Submit-to-done, DONE jobs.")


class WindowStats(BaseModel):
    """Per-class figures over the jobs that ended in the last ``seconds``."""

    seconds: float = Field(description="The window's length (setting ``api.stats_window``).")
    classes: dict[str, WindowClassStats]
    jobs: int = Field(description="Ended jobs counted (CANCELLED ones are not).")
    truncated: bool = Field(description="More jobs ended in the window than "
                                        "``api.stats_window_max_jobs``: only the newest count.")


class TenantService(BaseModel):
    """One tenant's measured service in one band (``scheduler.fairness``)."""

    band: str = Field(description="The SLO class whose band the seconds ran in.")
    tenant: str = Field(description="The tenant.")
    service_s: float = Field(description="Worker-seconds its chunks ran in the band, as the "
                                         "commits measured them.")
    share: float | None = Field(description="Its part of the band's worker-seconds, of all "
                                            "tenants' (null: the band ran none).")


def tenant_service(ledger: ServiceLedger, viewer: Viewer) -> list[TenantService]:
    """Each tenant's worker-seconds and share of its band, by band then tenant (what /metrics
    exports as ``stepline_tenant_service_*``); a tenant sees its own rows only."""
    served = ledger.worker_s()
    bands: dict[str, float] = {}
    for (band, _), seconds in served.items():
        bands[band] = bands.get(band, 0.0) + seconds
    return [TenantService(band=band, tenant=tenant, service_s=seconds,
                          share=seconds / bands[band] if bands[band] > 0 else None)
            for (band, tenant), seconds in sorted(served.items()) if viewer.sees(tenant)]


class LiveStatsView(StatsView):
    """GET /v1/stats: what the scheduler is doing now, and how each class fared lately."""

    measured_at: float = Field(description="When these figures were read (Unix seconds).")
    window: WindowStats = Field(description="Attainment and latency over a sliding window.")
    queue_oldest_age_s: dict[str, float | None] = Field(
        description="Per queue, seconds since the oldest message still waiting in it was queued "
                    "(the job record's queued-at time; see the README); null when none waits.")
    tenants: list[TenantService] = Field(
        default_factory=list, description="Per band and tenant, the measured worker-seconds and "
                                          "share (the viewer's own rows for a tenant).")


@dataclass(frozen=True, slots=True)
class Viewer:
    """Whose eyes the figures are for: a tenant sees its own job ids only; the operator (the
    dashboard's read-only token) sees every one."""

    tenant: str | None

    def sees(self, owner: str | None) -> bool:
        return self.tenant is None or owner == self.tenant


OPERATOR = Viewer(tenant=None)


def queue_keys(queue: str) -> list[str]:
    return [queue if p == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITY_STEPS]


def observed_queues(heartbeats: Mapping[str, Heartbeat]) -> list[str]:
    """The class queues, then the affinity queue of every live worker that consumes one."""
    own = {q for beat in heartbeats.values() for q in beat.queues
           if affinity_worker(q) is not None}
    return [*ALL_QUEUES, *sorted(own)]


def queue_depths(reads: ReadModel, queues: Iterable[str] = ALL_QUEUES) -> dict[str, int]:
    """Messages waiting per Celery queue, summed over kombu's priority lists."""
    names = list(queues)
    sizes = reads.list_lengths([key for name in names for key in queue_keys(name)])
    steps = len(KOMBU_PRIORITY_STEPS)
    return {name: int(sum(sizes[i * steps:(i + 1) * steps])) for i, name in enumerate(names)}


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """What a chunk message carries: the job, the chunk index and the epoch it was sent under."""

    job_id: str
    chunk: int
    epoch: int


def parse_message(raw: bytes) -> dict[str, Any] | None:
    """A kombu message as stored in a Redis list (JSON); None if it is not readable."""
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def chunk_of(message: Mapping[str, Any]) -> ChunkRef | None:
    """The chunk a ``stepline.chunk`` message runs, or a ``stepline.batch`` message's first
    (Celery's protocol 2: the body is ``[args, kwargs, embed]``, base64 in Redis); None for
    any other message."""
    headers, properties = message.get("headers") or {}, message.get("properties") or {}
    if headers.get("task") not in (CHUNK_TASK, BATCH_TASK):
        return None
    try:
        body = message["body"]
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        # a batch message (batch id, members): its first member dates it
        job_id, chunk, epoch = args[1][0] if headers["task"] == BATCH_TASK else args[:3]
        return ChunkRef(str(job_id), int(chunk), int(epoch))
    except (KeyError, IndexError, TypeError, ValueError, binascii.Error):
        return None


def expiring_sent_at_s(message: Mapping[str, Any]) -> float | None:
    """When a message with an expiry was sent (Celery sets the ``expires`` header and kombu the
    ``expiration`` property, in ms, from one instant): the scheduler tick's messages."""
    expires = (message.get("headers") or {}).get("expires")
    ttl_ms = (message.get("properties") or {}).get("expiration")
    if not isinstance(expires, str) or ttl_ms is None:
        return None
    try:
        return datetime.fromisoformat(expires).timestamp() - float(ttl_ms) / 1000
    except (TypeError, ValueError):
        return None


RECORD_QUEUE_FIELDS = ("state", "epoch", "next_chunk", "queued_at")


def chunk_queued_at_s(ref: ChunkRef, fields: Sequence[bytes | None]) -> float | None:
    """When ``ref``'s message was queued, from its job record (``RECORD_QUEUE_FIELDS``): the
    record's ``queued_at`` if the job is QUEUED for exactly this chunk and epoch. Otherwise the
    message is stale — a requeue bumped the epoch, or the job moved on or ended — and the worker
    that pops it will drop it: it is not work waiting, and has no age."""
    state, epoch, next_chunk, queued_at = (f.decode() if f is not None else None for f in fields)
    if state != JobState.QUEUED.value or queued_at is None:
        return None
    if epoch != str(ref.epoch) or next_chunk != str(ref.chunk):
        return None
    return float(queued_at)


def oldest_waits(reads: ReadModel, queues: Iterable[str],
                 now_s: float) -> dict[str, float | None]:
    """Per queue, the age of the oldest message still waiting in it (None if none waits).

    Kombu LPUSHes and BRPOPs, so each priority list's oldest messages are at its tail; the last
    ``TAIL_SCAN`` of every list are read, in two round trips whatever the number of queues. A
    chunk message's queued time is its job record's (``chunk_queued_at_s``: messages carry no
    timestamp of their own); a message with an expiry (the tick) dates itself."""
    names = list(queues)
    lists = reads.list_tails([key for name in names for key in queue_keys(name)], TAIL_SCAN)
    steps = len(KOMBU_PRIORITY_STEPS)
    tails = {name: [m for tail in lists[i * steps:(i + 1) * steps] for raw in tail
                    if (m := parse_message(raw)) is not None] for i, name in enumerate(names)}
    refs = list({ref for ms in tails.values() for m in ms if (ref := chunk_of(m)) is not None})
    fields = dict(zip(refs, reads.fields([r.job_id for r in refs], RECORD_QUEUE_FIELDS),
                      strict=True))
    return {name: _oldest_age(messages, fields, now_s) for name, messages in tails.items()}


def _oldest_age(messages: list[dict[str, Any]], fields: Mapping[ChunkRef, Sequence[bytes | None]],
                now_s: float) -> float | None:
    sent = []
    for message in messages:
        ref = chunk_of(message)
        at = chunk_queued_at_s(ref, fields[ref]) if ref else expiring_sent_at_s(message)
        if at is not None:
            sent.append(at)
    return max(now_s - min(sent), 0.0) if sent else None


class Figures(Protocol):
    """What attainment and latency read of a job: a :class:`JobOutcome` (a few fields) or a
    whole :class:`JobRecord`."""

    @property
    def job_id(self) -> str: ...
    @property
    def slo(self) -> SloClass: ...
    @property
    def state(self) -> JobState: ...
    @property
    def deadline_at_s(self) -> float: ...
    @property
    def finished_at_s(self) -> float | None: ...
    @property
    def latency_s(self) -> float | None: ...


def met_deadline(record: Figures) -> bool:
    return (record.state is JobState.DONE and record.finished_at_s is not None
            and record.finished_at_s <= record.deadline_at_s)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def class_stats(jobs: Sequence[Figures],
                live: LiveByState | None = None) -> dict[str, ClassStats]:
    """Per-class attainment: DONE by the deadline over DONE + FAILED + EXPIRED; ``unfinished``
    from the live counters (every unfinished job) when given, else among ``jobs``."""
    out = {}
    for slo in SloClass:
        mine = [r for r in jobs if r.slo is slo]
        ended = [r for r in mine if r.state in ENDED]
        met = sum(1 for r in ended if met_deadline(r))
        latencies = sorted(x for r in ended if r.state is JobState.DONE
                           if (x := r.latency_s) is not None)
        out[slo.value] = ClassStats(
            finished=len(ended), met=met, attainment=met / len(ended) if ended else None,
            p50_latency_s=_quantile(latencies, 0.5), p95_latency_s=_quantile(latencies, 0.95),
            unfinished=(live.of_class(slo.value) if live is not None
                        else sum(1 for r in mine if not r.state.is_terminal)),
        )
    return out


def window_class_stats(ended: Sequence[Figures]) -> dict[str, WindowClassStats]:
    """``class_stats`` of the jobs that ended in the window (all of them terminal)."""
    return {slo: WindowClassStats(**stats.model_dump(exclude={"unfinished"}))
            for slo, stats in class_stats(ended).items()}


def ended_since(reads: ReadModel, since_s: float, limit: int) -> tuple[list[JobRecord], bool]:
    """The jobs that ended (DONE, FAILED, EXPIRED) at or after ``since_s``, newest first, at most
    ``limit`` of them, from the ``sl:done`` stream; and whether there were more."""
    start_ms = max(int((since_s - WINDOW_SLACK_S) * 1000), 0)
    ids, more = reads.ended_ids_since(start_ms, limit)
    ended = [r for r in readable_records(reads, ids, "the stats window")
             if r.state in ENDED and r.finished_at_s is not None and r.finished_at_s >= since_s]
    return ended, more


def ended_outcomes_since(reads: ReadModel, since_s: float,
                         limit: int) -> tuple[list[JobOutcome], bool]:
    """``ended_since``, reading only what the figures need of each job."""
    start_ms = max(int((since_s - WINDOW_SLACK_S) * 1000), 0)
    ids, more = reads.ended_ids_since(start_ms, limit)
    ended = [r for r in reads.outcomes(ids)
             if r.state in ENDED and r.finished_at_s is not None and r.finished_at_s >= since_s]
    return ended, more


def window_stats(reads: ReadModel, settings: Settings, now_s: float) -> WindowStats:
    """Per-class attainment and latency over the last ``api.stats_window`` seconds: O(jobs that
    ended in it, at most ``api.stats_window_max_jobs``), a few fields each."""
    seconds = settings.api.stats_window
    ended, truncated = ended_outcomes_since(reads, now_s - seconds,
                                            settings.api.stats_window_max_jobs)
    return WindowStats(seconds=seconds, classes=window_class_stats(ended), jobs=len(ended),
                       truncated=truncated)


def readable_records(reads: ReadModel, job_ids: list[str], purpose: str) -> list[JobRecord]:
    """The jobs' records, leaving out any that cannot be parsed: one bad hash must not take a
    whole listing or scrape down (the tick fails such a job with the parse error as reason)."""
    readable = []
    for item in reads.records(job_ids):
        if isinstance(item, UnreadableRecord):
            log.warning("%s leaves out %s", purpose, item)
        else:
            readable.append(item)
    return readable


def recent_jobs(reads: ReadModel, window: int) -> list[JobOutcome]:
    """The ``window`` most recently submitted jobs that can be read (what the figures need of
    each: O(window), whatever the backlog)."""
    return reads.outcomes(reads.newest_ids(window))


def read_load(reads: ReadModel) -> dict[str, Any] | None:
    """The admission status the last tick published (None before the first, or unreadable)."""
    status = reads.admission()
    return None if status is None else status.as_json()


@dataclass
class CacheCounters:
    """Hits and misses of every cache a worker reports (``{"hits": h, "misses": m}``)."""

    hits: dict[str, float] = field(default_factory=dict)
    misses: dict[str, float] = field(default_factory=dict)

    def add(self, heartbeat: Heartbeat) -> dict[str, float | None]:
        """Count one heartbeat in; returns that worker's own hit rates."""
        rates: dict[str, float | None] = {}
        for name, (hits, misses) in heartbeat.cache_counts().items():
            self.hits[name] = self.hits.get(name, 0.0) + hits
            self.misses[name] = self.misses.get(name, 0.0) + misses
            rates[name] = hits / (hits + misses) if hits + misses else None
        return rates

    def rates(self) -> dict[str, float | None]:
        return {name: (h / (h + self.misses[name]) if h + self.misses[name] else None)
                for name, h in self.hits.items()}


def experts_resident(beat: Heartbeat) -> dict[str, int]:
    """Experts resident on the device per loaded MoE model, from the heartbeat's residency
    summary (a hex bitmask of resident experts per layer)."""
    out = {}
    for model, summary in beat.experts.items():
        masks = summary.get("resident") if isinstance(summary, dict) else None
        if isinstance(masks, dict):
            try:
                out[str(model)] = sum(int(str(m), 16).bit_count() for m in masks.values() if m)
            except ValueError:  # a worker of another version: leave the model out
                continue
    return out


def model_residency(beat: Heartbeat) -> dict[str, Any]:
    """The built models a worker holds, from its heartbeat's ``residency`` (``{}`` when it
    has none, or one this version cannot read): residency keys on the device, in host memory
    and being staged, device bytes and budget, and its loads (base models from disk or host)
    with their seconds, adapter loads and models staged — the dashboard's models columns."""
    r = beat.residency
    if not r:
        return {}
    try:
        loads = dict(r.get("loads") or {})
        load_s = dict(r.get("load_s") or {})
        budget = r.get("budget_bytes")
        return {
            "device": sorted(str(k) for k in dict(r.get("device") or {})),
            "host": sorted(str(k) for k in dict(r.get("host") or {})),
            "staging": sorted(str(k) for k in list(r.get("staging") or [])),
            "device_bytes": beat.resident_bytes("device"),
            "budget_bytes": None if budget is None else int(budget),
            "loads": sum(int(v) for v in loads.values()),
            "load_s": round(sum(float(v) for v in load_s.values()), 3),
            "adapter_loads": int(r.get("adapter_loads", 0)),
            "staged": int(r.get("staged", 0)),
            "loading": _loading(r.get("loading")),
        }
    except (TypeError, ValueError):  # a worker of another version: leave it out
        return {}


def _loading(window: Any) -> dict[str, Any] | None:
    """The load a worker's chunk waits for now (the residency key, since when, the seconds it
    is expected to take, where from), or None."""
    if not isinstance(window, Mapping) or "model" not in window:
        return None
    expected = window.get("expected_s")
    return {"model": str(window["model"]), "since": float(window.get("since", 0.0)),
            "expected_s": None if expected is None else float(expected),
            "from": None if window.get("from") is None else str(window["from"])}


def worker_views(beats: Mapping[str, Heartbeat], now_s: float,
                 busy_visible: Mapping[str, bool]) -> tuple[list[WorkerInfo], CacheCounters]:
    """Every heartbeat as a ``WorkerInfo`` (a busy job the viewer may not see reads as null),
    and the cache counters summed over them."""
    counters, views = CacheCounters(), []
    for name, beat in beats.items():
        rates = counters.add(beat)
        busy, age_s = beat.busy_job, beat.age_s(now_s)
        views.append(WorkerInfo.model_validate({  # experts_resident, models: extras it allows
            "name": name, "busy_job": busy if busy_visible.get(busy or "", False) else None,
            "queues": list(beat.queues), "device": beat.device, "chunks_run": beat.chunks_run,
            "age_s": None if age_s is None else round(age_s, 3),
            "cache_hit_rates": rates, "experts_resident": experts_resident(beat),
            "models": model_residency(beat),
        }))
    return views, counters


def live_stats(reads: ReadModel, settings: Settings, viewer: Viewer,
               now_s: float) -> LiveStatsView:
    """Everything GET /v1/stats answers, as ``viewer`` may see it: another tenant's job id (the
    origin, a worker's busy job) reads as null."""
    jobs = recent_jobs(reads, settings.api.stats_window_jobs)
    beats = reads.heartbeats()
    origin = reads.origin_id()
    busy = [b.busy_job for b in beats.values() if b.busy_job]
    owners = reads.owners([*busy, *([origin] if origin else [])])
    visible = {job_id: viewer.sees(owner) for job_id, owner in owners.items()}
    workers, counters = worker_views(beats, now_s, visible)
    queues = observed_queues(beats)
    return LiveStatsView(
        classes=class_stats(jobs, reads.live_by_state()), queues=queue_depths(reads, queues),
        origin=origin if origin and visible.get(origin) else None,
        origin_active=origin is not None, load=read_load(reads), workers=workers,
        cache_hit_rates=counters.rates(), window_jobs=len(jobs), measured_at=now_s,
        window=window_stats(reads, settings, now_s),
        queue_oldest_age_s=oldest_waits(reads, queues, now_s),
        tenants=tenant_service(reads.fair_ledger(), viewer),
    )
