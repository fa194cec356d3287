"""What /v1/stats and /metrics report, read from Redis: SLO attainment over recent jobs, queue
depths, the origin, the admission load, worker heartbeats and their cache hit rates."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from app.schemas import ClassStats, WorkerInfo
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.record import JobRecord, UnreadableRecord
from tasks.routing import ALL_QUEUES
from tasks.store import JobStore

log = logging.getLogger(__name__)

KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
"""Kombu's Redis transport keeps priority p of queue q in list ``q\\x06\\x16p`` (p=0: ``q``)."""

ENDED = frozenset({JobState.DONE, JobState.FAILED, JobState.EXPIRED})
"""States that count toward SLO attainment (a cancelled job is the client's choice)."""


def queue_keys(queue: str) -> list[str]:
    return [queue if p == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITY_STEPS]


def queue_depths(store: JobStore, queues: Iterable[str] = ALL_QUEUES) -> dict[str, int]:
    """Messages waiting per Celery queue, summed over kombu's priority lists."""
    names = list(queues)
    pipe = store.redis.pipeline(transaction=False)
    for name in names:
        for key in queue_keys(name):
            pipe.llen(key)
    sizes = pipe.execute()
    steps = len(KOMBU_PRIORITY_STEPS)
    return {name: int(sum(sizes[i * steps:(i + 1) * steps])) for i, name in enumerate(names)}


def met_deadline(record: JobRecord) -> bool:
    return (record.state is JobState.DONE and record.finished_at_s is not None
            and record.finished_at_s <= record.deadline_at_s)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def class_stats(jobs: list[JobRecord]) -> dict[str, ClassStats]:
    """Per-class attainment: DONE by the deadline over DONE + FAILED + EXPIRED."""
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
            unfinished=sum(1 for r in mine if not r.state.is_terminal),
        )
    return out


def readable_records(store: JobStore, job_ids: list[str], purpose: str) -> list[JobRecord]:
    """The jobs' records, leaving out any that cannot be parsed: one bad hash must not take a
    whole listing or scrape down (the tick fails such a job with the parse error as reason)."""
    readable = []
    for item in store.records(job_ids):
        if isinstance(item, UnreadableRecord):
            log.warning("%s leaves out %s", purpose, item)
        else:
            readable.append(item)
    return readable


def recent_jobs(store: JobStore, window: int) -> list[JobRecord]:
    """The ``window`` most recently submitted jobs that can be read."""
    return readable_records(store, store.list_ids(0, window), "recent jobs")


def read_load(store: JobStore) -> dict[str, Any] | float | None:
    """The admission state published by the scheduler (a JSON string, a number or a hash)."""
    kind = store.redis.type(keys.ADMISSION)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    if kind == "hash":
        raw = cast(dict[bytes, bytes], store.redis.hgetall(keys.ADMISSION))
        return {k.decode(): _number_or_text(v.decode()) for k, v in raw.items()}
    if kind != "string":
        return None
    text = cast(bytes, store.redis.get(keys.ADMISSION)).decode()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"state": text}
    return value if isinstance(value, dict | float | int) else {"state": value}


def _number_or_text(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


@dataclass
class CacheCounters:
    """Hits and misses of every cache a worker reports (``{"hits": h, "misses": m}``)."""

    hits: dict[str, float] = field(default_factory=dict)
    misses: dict[str, float] = field(default_factory=dict)

    def add(self, heartbeat: Mapping[str, Any]) -> dict[str, float | None]:
        """Count one heartbeat in; returns that worker's own hit rates."""
        rates: dict[str, float | None] = {}
        for name, value in heartbeat.items():
            if isinstance(value, dict) and {"hits", "misses"} <= value.keys():
                hits, misses = float(value["hits"]), float(value["misses"])
                self.hits[name] = self.hits.get(name, 0.0) + hits
                self.misses[name] = self.misses.get(name, 0.0) + misses
                rates[name] = hits / (hits + misses) if hits + misses else None
        return rates

    def rates(self) -> dict[str, float | None]:
        return {name: (h / (h + self.misses[name]) if h + self.misses[name] else None)
                for name, h in self.hits.items()}


def read_workers(store: JobStore, now_s: float | None = None) -> tuple[list[WorkerInfo],
                                                                        CacheCounters]:
    """Every live worker heartbeat, and the cache counters summed over them."""
    now_s = time.time() if now_s is None else now_s
    counters, views = CacheCounters(), []
    for name, beat in store.heartbeats().items():
        rates = counters.add(beat)
        views.append(WorkerInfo(
            name=name, busy_job=beat.get("busy_job"), queues=list(beat.get("queues") or []),
            device=beat.get("device"), chunks_run=beat.get("chunks_run"),
            age_s=round(now_s - float(beat["ts"]), 3) if beat.get("ts") else None,
            cache_hit_rates=rates,
        ))
    return views, counters
