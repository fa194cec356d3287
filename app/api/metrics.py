"""Prometheus ``/metrics``, read from Redis at scrape time by the functions /v1/stats uses, so the
two agree. Finished jobs are folded into counters kept in Redis exactly once each (a ``ZADD NX``
on a seen-set), which keeps the counters monotonic across API processes."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.api.stats import (
    ENDED,
    OPERATOR,
    Figures,
    WindowStats,
    class_stats,
    met_deadline,
    observed_queues,
    oldest_waits,
    queue_depths,
    recent_jobs,
    tenant_service,
    window_stats,
    worker_views,
)
from scheduler.fairness import ServiceLedger
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.heartbeat import Heartbeat
from tasks.read_model import FinishedCount, ReadModel
from tasks.settings import Settings

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SEEN_KEEP = 50_000


def account_finished(reads: ReadModel, jobs: Sequence[Figures]) -> None:
    """Fold jobs that ended since the last scrape into the Redis counters (each one once)."""
    reads.count_finished([FinishedCount(r.job_id, r.finished_at_s, _increments(r))
                          for r in jobs if r.state.is_terminal and r.finished_at_s is not None],
                         keep=SEEN_KEEP)


def _increments(r: Figures) -> tuple[tuple[str, str, int | float], ...]:
    """What one ended job adds to the counters: its state, its latency bucket, its deadline."""
    state, slo = r.state.value, r.slo.value
    adds: list[tuple[str, str, int | float]] = [(keys.METRICS_FINISHED, f"{state}|{slo}", 1)]
    if r.state is JobState.DONE and (seconds := r.latency_s) is not None:
        key = keys.metrics_latency(slo)
        adds += [(key, repr(bound), 1) for bound in LATENCY_BUCKETS_S if seconds <= bound]
        adds += [(key, "+Inf", 1), (key, "sum", float(seconds))]
    if r.state in ENDED and met_deadline(r):
        adds.append((keys.METRICS_FINISHED, f"met|{slo}", 1))
    return tuple(adds)


class StoreCollector(Collector):
    """Everything ``/metrics`` shows, collected from Redis on each scrape."""

    def __init__(self, reads: ReadModel, settings: Settings) -> None:
        self.reads = reads
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        now_s = time.time()
        jobs = recent_jobs(self.reads, self.settings.api.stats_window_jobs)
        account_finished(self.reads, jobs)
        yield from self._finished()
        yield self._active()
        yield from self._latency()
        yield self._attainment(jobs)
        beats = self.reads.heartbeats()
        yield from self._queues(observed_queues(beats), now_s)
        yield from self._window(window_stats(self.reads, self.settings, now_s))
        workers, counters = worker_views(beats, now_s, busy_visible={})
        yield GaugeMetricFamily("stepline_workers", "Workers with a live heartbeat",
                                value=len(workers))
        busy = sum(1 for beat in beats.values() if beat.busy_job)
        yield GaugeMetricFamily("stepline_workers_busy", "Workers running a chunk", value=busy)
        hit = GaugeMetricFamily("stepline_cache_hit_ratio", "Cache hit ratio over live workers",
                                labels=["cache"])
        for name, rate in counters.rates().items():
            if rate is not None:
                hit.add_metric([name], rate)
        yield hit
        per_worker = GaugeMetricFamily("stepline_worker_cache_hit_ratio",
                                       "Cache hit ratio of each live worker's own counters",
                                       labels=["worker", "cache"])
        for worker in workers:
            for name, rate in worker.cache_hit_rates.items():
                if rate is not None:
                    per_worker.add_metric([worker.name, name], rate)
        yield per_worker
        yield from residency_metrics(beats)
        yield GaugeMetricFamily("stepline_origin_active", "1 while a job is the origin",
                                value=1 if self.reads.origin_id() else 0)
        yield from self._load()
        yield from fair_share_metrics(self.reads.fair_ledger())

    def _load(self) -> Iterator[Metric]:
        """The last tick's load figures (none before the first tick): the effective load (model
        loads counted as work), the compute load beside it, the one admission goes by, and
        whether overload convergence is on."""
        status = self.reads.admission()
        if status is None:
            return
        for name, text, value in (
                ("stepline_load", "The load admission and overload convergence go by",
                 status.load),
                ("stepline_load_effective",
                 "Outstanding compute work plus expected model loads over fleet capacity",
                 status.effective_load),
                ("stepline_load_compute",
                 "Outstanding compute work alone over fleet capacity", status.compute_load)):
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("stepline_overload_converging",
                                "1 while overload convergence holds batch work back",
                                value=1 if status.state.value == "converging" else 0)

    def _queues(self, queues: list[str], now_s: float) -> Iterator[Metric]:
        depths = GaugeMetricFamily("stepline_queue_depth", "Messages waiting per queue",
                                   labels=["queue"])
        for queue, depth in queue_depths(self.reads, queues).items():
            depths.add_metric([queue], depth)
        yield depths
        ages = GaugeMetricFamily(
            "stepline_queue_oldest_age_seconds",
            "Seconds since the oldest message still waiting in the queue was queued (0: none)",
            labels=["queue"])
        for queue, age in oldest_waits(self.reads, queues, now_s).items():
            ages.add_metric([queue], age or 0.0)
        yield ages

    def _window(self, window: WindowStats) -> Iterator[Metric]:
        yield GaugeMetricFamily("stepline_stats_window_seconds",
                                "Length of the sliding window of the *_window metrics",
                                value=window.seconds)
        attained = GaugeMetricFamily(
            "stepline_slo_attainment_window",
            "Share of the jobs that ended in the sliding window DONE by their deadline, by class",
            labels=["slo"])
        ended = GaugeMetricFamily("stepline_jobs_ended_window",
                                  "Jobs that ended (DONE, FAILED, EXPIRED) in the sliding window",
                                  labels=["slo"])
        latency = GaugeMetricFamily(
            "stepline_job_latency_window_seconds",
            "Submit-to-done latency quantiles of the DONE jobs of the sliding window",
            labels=["slo", "quantile"])
        for slo, stats in window.classes.items():
            ended.add_metric([slo], stats.finished)
            if stats.attainment is not None:
                attained.add_metric([slo], stats.attainment)
            for quantile, value in (("0.5", stats.p50_latency_s), ("0.95", stats.p95_latency_s)):
                if value is not None:
                    latency.add_metric([slo, quantile], value)
        yield from (attained, ended, latency)

    def _finished(self) -> Iterator[Metric]:
        raw = self.reads.counters(keys.METRICS_FINISHED)
        ended = CounterMetricFamily("stepline_jobs_finished", "Jobs that ended, by state and class",
                                    labels=["state", "slo"])
        met = CounterMetricFamily("stepline_jobs_deadline_met",
                                  "Jobs DONE by their deadline, by class", labels=["slo"])
        for key, value in sorted(raw.items()):
            state, _, slo = key.partition("|")
            if state == "met":
                met.add_metric([slo], float(value))
            else:
                ended.add_metric([state, slo], float(value))
        yield ended
        yield met

    def _active(self) -> Metric:
        """From the live counters the state changes keep: O(states x classes), not a read of
        every unfinished record."""
        gauge = GaugeMetricFamily("stepline_jobs_active", "Jobs not yet ended, by state and class",
                                  labels=["state", "slo"])
        for (state, slo), count in sorted(self.reads.live_by_state().counts.items()):
            gauge.add_metric([state, slo], count)
        return gauge

    def _latency(self) -> Iterator[Metric]:
        family = HistogramMetricFamily("stepline_job_latency_seconds",
                                       "Submit-to-done latency of DONE jobs", labels=["slo"])
        for slo in SloClass:
            key = keys.metrics_latency(slo.value)
            got = self.reads.counters(key)
            buckets = [(repr(b), got.get(repr(b), 0.0)) for b in LATENCY_BUCKETS_S]
            buckets.append(("+Inf", got.get("+Inf", 0.0)))
            family.add_metric([slo.value], buckets, sum_value=got.get("sum", 0.0))
        yield family

    def _attainment(self, jobs: Sequence[Figures]) -> Metric:
        gauge = GaugeMetricFamily(
            "stepline_slo_attainment",
            "Share of recently ended jobs DONE by their deadline, by class", labels=["slo"])
        for slo, stats in class_stats(jobs).items():
            if stats.attainment is not None:
                gauge.add_metric([slo], stats.attainment)
        return gauge


def residency_metrics(beats: Mapping[str, Heartbeat]) -> Iterator[Metric]:
    """Per worker, from its heartbeat's ``residency``: bytes of the models it holds per tier,
    and its model loads and their seconds per source tier (cumulative, so counters): ``disk``
    and ``host`` for a base model a chunk needed, ``adapter`` for a LoRA adapter loaded onto
    one, ``stage`` for a model read into host memory ahead of its jobs; and whether a chunk of
    it waits for a load now (``stepline_worker_loading``)."""
    resident = GaugeMetricFamily("stepline_worker_resident_bytes",
                                 "Measured tensor bytes of the models a worker holds",
                                 labels=["worker", "tier"])
    loads = CounterMetricFamily("stepline_worker_model_loads",
                                "Model loads of a worker, by the tier they came from",
                                labels=["worker", "source"])
    seconds = CounterMetricFamily("stepline_worker_model_load_seconds",
                                  "Seconds a worker spent loading models, by source tier",
                                  labels=["worker", "source"])
    loading = GaugeMetricFamily("stepline_worker_loading",
                                "1 while a worker's chunk waits for a model load",
                                labels=["worker"])
    for name, beat in sorted(beats.items()):
        if not beat.residency:
            continue
        loading.add_metric([name], 1.0 if beat.residency.get("loading") else 0.0)
        for tier in ("device", "host"):
            resident.add_metric([name, tier], beat.resident_bytes(tier))
        for source, count in dict(beat.residency.get("loads") or {}).items():
            loads.add_metric([name, str(source)], float(count))
        for source, spent in dict(beat.residency.get("load_s") or {}).items():
            seconds.add_metric([name, str(source)], float(spent))
        for source, count_key, seconds_key in (("adapter", "adapter_loads", "adapter_load_s"),
                                               ("stage", "staged", "stage_s")):
            if count_key in beat.residency:
                loads.add_metric([name, source], float(beat.residency[count_key]))
                seconds.add_metric([name, source], float(beat.residency.get(seconds_key, 0.0)))
    yield resident
    yield loads
    yield seconds
    yield loading


def fair_share_metrics(ledger: ServiceLedger) -> Iterator[Metric]:
    """Each tenant's measured worker-seconds in each band (``scheduler.fairness``; kept by the
    commits whether fair share orders the tick or not) and its share of the band's."""
    total = GaugeMetricFamily("stepline_tenant_service_seconds",
                              "Worker-seconds each tenant's chunks ran, by band (SLO class)",
                              labels=["band", "tenant"])
    share = GaugeMetricFamily("stepline_tenant_service_share",
                              "A tenant's share of its band's worker-seconds",
                              labels=["band", "tenant"])
    for row in tenant_service(ledger, OPERATOR):
        total.add_metric([row.band, row.tenant], row.service_s)
        if row.share is not None:
            share.add_metric([row.band, row.tenant], row.share)
    yield total
    yield share
