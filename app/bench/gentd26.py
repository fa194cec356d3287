"""The GenTD26 production diffusion trace as a benchmark workload: its requests, with their real
base-model ids, LoRA counts, images, steps and measured execution times, become the jobs of the
many-model benchmark (``app.bench.models_workload.ModelJob``), and its measured load latencies
become the load times the simulator and the live simulated device pay.

Source: the Alibaba GenAI serving dataset, ``cluster-trace-v2026-GenAI/`` of
github.com/alibaba/clusterdata (the ``lora_request_trace.csv`` request file and the
``*_latency*_anon.csv`` latency files, extracted from their archives into one directory, whose
path every reader here takes; nothing is copied into the project). Cite Yanying Lin et al.,
"Understanding Diffusion Model Serving in Production: A Top-Down Analysis of Workload,
Scheduling, and Resource Efficiency", SoCC '25, wherever a figure from it is reported.

How a request becomes a job (:func:`window_jobs`):

- **Which requests**: those that succeeded with a positive execution time, a step count and a
  base model, in creation order, ``jobs`` of them from a window's start. Requests created from
  :data:`HELD_OUT_FROM` (2024-12-01) on are held out for evaluation: a window reaching them is
  refused unless it says ``held_out``.
- **Arrivals**: the requests' own creation times (seconds apart, bursts kept), compressed by one
  factor so that the window's offered compute load is ``load``: Σ execution / (workers ×
  span) with the span the mean gap times the job count.
- **Work**: ``exec_time_seconds`` as the job's run time on a worker holding its model (the
  trace does not split it further), times ``time_scale``; its steps, the trace's
  ``num_inference_steps`` (or a fixed count for the live device, same run time).
- **Models**: the base-model id is the job's model. Each model's place in the trace's
  base-model load distribution (``basemodel_update_latency_anon.csv``) is drawn once, seeded by
  its id; each load of it draws within ±10 percentiles of that place, so a model is as slow to
  load every time while the loads of all models keep the trace's distribution. Its bytes follow
  its load time (5 GB at the median, 1-20 GB, as ``models_workload``). From host memory a load
  takes a quarter of the time from disk.
- **Adapters**: a request's ``num_lora`` adapters are named by its base model and its user
  group (``<model>/<group>-<k>``), so a group that sends the same model with adapters again
  reuses them (the trace does not name adapters); each adapter load draws from
  ``lora_update_latency_anon.csv``.
- **Deadlines**: the trace has no SLO classes: a seeded ``interactive_share`` of the jobs is
  interactive, the rest batch, every one due ``slo_x`` × its own execution time after arrival.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.bench.models_workload import (
    HOST_FRACTION,
    MAX_BYTES,
    MEDIAN_BYTES,
    MIN_BYTES,
    Catalog,
    ModelJob,
    ModelSpec,
)
from scheduler.lifecycle import SloClass

CITATION = ("Lin et al., \"Understanding Diffusion Model Serving in Production\", SoCC '25 "
            "(GenTD26, github.com/alibaba/clusterdata cluster-trace-v2026-GenAI)")
HELD_OUT_FROM = datetime(2024, 12, 1)
"""Requests created from this instant on are held out: develop and tune on the earlier ones."""
REQUEST_FILE = "lora_request_trace.csv"
REQUEST_COLUMNS = ("gmt_create", "predict_type", "predict_status", "exec_time_seconds",
                   "groupId", "num_images_per_prompt", "num_inference_steps",
                   "checkpoint_model_version_id", "num_lora")
LATENCY_FILES = {"base": "basemodel_update_latency_anon.csv",
                 "adapter": "lora_update_latency_anon.csv",
                 "pipeline": "pipeline_update_latency_anon.csv",
                 "controlnet": "controlnet_latency_data_anon.csv"}
"""The latency files (milliseconds in ``value``); ``base`` and ``adapter`` are required."""
REQUIRED_LATENCIES = ("base", "adapter")
QUANTILE_BAND = 0.1
"""A model's loads draw within this many quantiles either side of its own place."""


class TraceError(ValueError):
    """A trace file or window that cannot be used, with what is wrong."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One row of the request file."""

    line: int
    created: datetime
    predict_type: str
    status: str
    exec_s: float
    group: str
    images: int
    steps: int
    model: str
    loras: int

    @property
    def usable(self) -> bool:
        """Whether it becomes a job: it succeeded, ran, and names its steps and base model."""
        return self.status == "SUCCEED" and self.exec_s > 0 and self.steps > 0 \
            and bool(self.model)


def _number(text: str | None) -> float:
    """A CSV cell as a number; an empty or unreadable one as NaN."""
    try:
        return float(text) if text not in (None, "", "NULL", "None") else math.nan
    except ValueError:
        return math.nan


def _count(text: str | None, default: int = 0) -> int:
    value = _number(text)
    return default if math.isnan(value) else int(value)


def read_requests(directory: Path | str) -> list[TraceRequest]:
    """Every request of ``<directory>/lora_request_trace.csv`` (a path to the file itself is
    taken too), in creation order. Raises :class:`TraceError` naming the file and what is
    missing or unreadable."""
    path = Path(directory)
    if path.is_dir():
        path = path / REQUEST_FILE
    if not path.is_file():
        raise TraceError(f"no GenTD26 request file at {path} (extract {REQUEST_FILE} from the "
                         "dataset's lora_request_trace.tar.gz there)")
    out: list[TraceRequest] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUEST_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: missing columns {', '.join(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                created = datetime.fromisoformat(row["gmt_create"])
            except (TypeError, ValueError):
                raise TraceError(f"{path}:{line}: gmt_create {row['gmt_create']!r} is not a "
                                 "date and time (YYYY-MM-DD HH:MM:SS)") from None
            exec_s = _number(row["exec_time_seconds"])
            out.append(TraceRequest(
                line, created, row["predict_type"] or "", row["predict_status"] or "",
                0.0 if math.isnan(exec_s) else exec_s, row["groupId"] or "",
                max(_count(row["num_images_per_prompt"], 1), 1),
                _count(row["num_inference_steps"]), row["checkpoint_model_version_id"] or "",
                max(_count(row["num_lora"]), 0)))
    out.sort(key=lambda r: (r.created, r.line))
    return out


@dataclass(frozen=True, slots=True)
class LatencySamples:
    """The trace's measured loads, in seconds, sorted (zeros, a switch to what was there
    already, left out)."""

    base_s: tuple[float, ...]
    adapter_s: tuple[float, ...]
    pipeline_s: tuple[float, ...] = ()
    controlnet_s: tuple[float, ...] = ()

    def summary(self) -> dict[str, Any]:
        """Per file: how many loads and their p10 / p50 / p90 / p99 seconds."""
        return {name: {"loads": len(values),
                       **{f"p{q}": quantile(values, q / 100) if values else None
                          for q in (10, 50, 90, 99)}}
                for name, values in (("base", self.base_s), ("adapter", self.adapter_s),
                                     ("pipeline", self.pipeline_s),
                                     ("controlnet", self.controlnet_s))}


def read_latencies(directory: Path | str) -> LatencySamples:
    """The latency files of ``directory`` (``value`` in milliseconds); the base-model and LoRA
    files are required, the pipeline and ControlNet ones read when present."""
    root = Path(directory)
    if root.is_file():
        root = root.parent
    found: dict[str, tuple[float, ...]] = {}
    for name, file in LATENCY_FILES.items():
        path = root / file
        if not path.is_file():
            if name in REQUIRED_LATENCIES:
                raise TraceError(f"no GenTD26 latency file at {path} (extract it from the "
                                 f"dataset's {file.removesuffix('.csv')}.tar.gz there)")
            found[name] = ()
            continue
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if "value" not in (reader.fieldnames or ()):
                raise TraceError(f"{path}: missing column value")
            values = sorted(v / 1000.0 for row in reader
                            if not math.isnan(v := _number(row["value"])) and v > 0)
        if not values and name in REQUIRED_LATENCIES:
            raise TraceError(f"{path}: no positive latency in column value")
        found[name] = tuple(values)
    return LatencySamples(found["base"], found["adapter"], found["pipeline"],
                          found["controlnet"])


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of sorted ``values``, interpolated linearly."""
    if not values:
        raise ValueError("quantile of no values")
    pos = min(max(q, 0.0), 1.0) * (len(values) - 1)
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class TraceCatalog(Catalog):
    """A window's base models, whose loads draw from the trace's measured latencies."""

    samples: LatencySamples = field(default_factory=lambda: LatencySamples((1.0,), (1.0,)))
    places: dict[str, float] = field(default_factory=dict, compare=False)
    """Per model, its quantile in the base-model load distribution."""

    def draw_load_s(self, rng: random.Random, model: str, tier: str) -> float:
        place = self.places[model] + rng.uniform(-QUANTILE_BAND, QUANTILE_BAND)
        seconds = quantile(self.samples.base_s, place) * self.time_scale
        return seconds * HOST_FRACTION if tier == "host" else seconds

    def draw_adapter_s(self, rng: random.Random) -> float:
        return rng.choice(self.samples.adapter_s) * self.time_scale


class TraceWindow(BaseModel):
    """One window of the trace as a workload (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: datetime | None = None
    """The first request taken is the first usable one created at or after this (None: the
    trace's first)."""
    jobs: int = Field(default=240, ge=2)
    workers: int = Field(default=2, ge=1)
    load: float = Field(default=0.8, gt=0.0, le=4.0)
    """Offered compute load the arrivals are compressed to (loads not counted)."""
    time_scale: float = Field(default=1.0, gt=0.0)
    byte_scale: float = Field(default=1.0, gt=0.0)
    steps: int | None = Field(default=None, ge=1)
    """Denoising steps of every job (None: the trace's own); the run time stays the trace's."""
    interactive_share: float = Field(default=0.5, ge=0.0, le=1.0)
    slo_x: float = Field(default=3.0, gt=1.0)
    seed: int = 1
    held_out: bool = False
    """Allow requests created from :data:`HELD_OUT_FROM` on (evaluation only)."""


def pick(requests: Sequence[TraceRequest], window: TraceWindow) -> list[TraceRequest]:
    """The window's requests: the first ``window.jobs`` usable ones from its start."""
    usable = [r for r in requests
              if r.usable and (window.start is None or r.created >= window.start)]
    picked = usable[:window.jobs]
    if len(picked) < window.jobs:
        raise TraceError(f"only {len(picked)} usable requests from {window.start or 'the start'}"
                         f" (asked for {window.jobs})")
    if not window.held_out and picked[-1].created >= HELD_OUT_FROM:
        raise TraceError(f"the window of {window.jobs} requests from {picked[0].created} runs "
                         f"to {picked[-1].created}, into the held-out requests (from "
                         f"{HELD_OUT_FROM:%Y-%m-%d}); pick an earlier start, or set held_out "
                         "for an evaluation run")
    return picked


def window_jobs(requests: Sequence[TraceRequest], samples: LatencySamples,
                window: TraceWindow) -> tuple[TraceCatalog, list[ModelJob]]:
    """The window's catalog and jobs (see the module docstring)."""
    picked = pick(requests, window)
    t0 = picked[0].created
    offsets = [(r.created - t0).total_seconds() for r in picked]
    exec_total = sum(r.exec_s for r in picked) * window.time_scale
    span = offsets[-1] * len(picked) / (len(picked) - 1)
    if span <= 0:
        raise TraceError(f"the window's {len(picked)} requests were all created at {t0}: "
                         "no arrival process to compress")
    factor = exec_total / (window.load * window.workers * span)
    catalog = trace_catalog(picked, samples, window)
    slo_rng = random.Random(f"gentd26-slo-{window.seed}-{t0:%Y%m%d%H%M%S}")
    jobs: list[ModelJob] = []
    for index, (request, offset) in enumerate(zip(picked, offsets, strict=True)):
        exec_s = request.exec_s * window.time_scale
        steps = window.steps or request.steps
        interactive = slo_rng.random() < window.interactive_share
        arrival_s = offset * factor
        jobs.append(ModelJob(index, arrival_s, request.model, adapters_of(request), steps,
                             exec_s / steps, request.images,
                             SloClass.INTERACTIVE if interactive else SloClass.BATCH,
                             arrival_s + window.slo_x * exec_s))
    return catalog, jobs


def adapters_of(request: TraceRequest) -> tuple[str, ...]:
    """The request's adapters, named by its base model and user group."""
    return tuple(f"{request.model}/{request.group or 'anon'}-{k}"
                 for k in range(request.loras))


def trace_catalog(picked: Sequence[TraceRequest], samples: LatencySamples,
                  window: TraceWindow) -> TraceCatalog:
    """The window's base models, most used first: each its share of the window's jobs, its
    place in the load distribution (seeded by its id), the bytes that place gives, and the
    adapters the window names on it."""
    counts = Counter(r.model for r in picked)
    adapters: dict[str, set[str]] = {}
    for r in picked:
        adapters.setdefault(r.model, set()).update(adapters_of(r))
    median_s = quantile(samples.base_s, 0.5)
    specs: list[ModelSpec] = []
    places: dict[str, float] = {}
    for model, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        place = random.Random(f"gentd26-model-{window.seed}-{model}").random()
        load_s = quantile(samples.base_s, place)
        size = min(max(MEDIAN_BYTES * load_s / median_s, MIN_BYTES), MAX_BYTES)
        places[model] = place
        specs.append(ModelSpec(model, count / len(picked), int(size * window.byte_scale),
                               load_s * window.time_scale, tuple(sorted(adapters[model]))))
    return TraceCatalog(tuple(specs), window.time_scale, samples=samples, places=places)


def scheduler_scale(jobs: Sequence[ModelJob]) -> dict[str, float]:
    """The scheduler's time knobs for the window's job sizes: its defaults (a realtime quantum
    of 1 s, an interactive one of 5 s, aging after 20 s) are set for work whose typical job
    runs about a second; these are the same multiples of the window's median run time. At the
    defaults every job of a trace whose median runs 20 s joins the lowest level, interactive or
    not: the classes are not told apart, and a job is demoted mid-run for fresher ones (whose
    models then evict its own)."""
    unit = quantile(sorted(j.exec_s for j in jobs), 0.5)
    return {"realtime_quantum": unit, "interactive_quantum": 5.0 * unit,
            "aging_bound": 20.0 * unit}


def window_summary(requests: Sequence[TraceRequest], window: TraceWindow,
                   jobs: Sequence[ModelJob]) -> dict[str, Any]:
    """What the window holds: its dates, models, adapters, run times and arrival burstiness."""
    picked = pick(requests, window)
    exec_s = sorted(r.exec_s for r in picked)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(jobs)]
    mean_gap = statistics.fmean(gaps) if gaps else 0.0
    return {
        "first_request": f"{picked[0].created}", "last_request": f"{picked[-1].created}",
        "held_out": picked[-1].created >= HELD_OUT_FROM,
        "jobs": len(picked), "base_models": len({r.model for r in picked}),
        "jobs_with_adapters": sum(1 for r in picked if r.loras),
        "adapters_per_job": dict(sorted(Counter(r.loras for r in picked).items())),
        "predict_types": dict(Counter(r.predict_type for r in picked)),
        "top_model_share": Counter(r.model for r in picked).most_common(1)[0][1] / len(picked),
        "exec_s": {"p10": quantile(exec_s, 0.1), "p50": quantile(exec_s, 0.5),
                   "p90": quantile(exec_s, 0.9), "max": exec_s[-1]},
        "arrival_gap_cv": (statistics.pstdev(gaps) / mean_gap) if mean_gap > 0 else None,
        "span_s": jobs[-1].arrival_s - jobs[0].arrival_s if jobs else 0.0,
        "interactive": sum(1 for j in jobs if j.slo is SloClass.INTERACTIVE),
    }


def window_starts(requests: Sequence[TraceRequest], count: int, jobs: int,
                  held_out: bool = False) -> list[datetime]:
    """``count`` starts of windows of ``jobs`` usable requests that do not overlap, each at the
    first request of a day, spread evenly over the days that have one: over the development
    requests (before :data:`HELD_OUT_FROM`), or over the held-out ones."""
    usable = [r for r in requests if r.usable
              and (r.created >= HELD_OUT_FROM) == held_out]
    candidates: list[tuple[datetime, int]] = []
    end = 0
    for k, r in enumerate(usable):
        if k < end or (k and usable[k - 1].created.date() == r.created.date()):
            continue
        if k + jobs <= len(usable):
            candidates.append((r.created, k))
            end = k + jobs
    if len(candidates) < count:
        raise TraceError(f"only {len(candidates)} windows of {jobs} requests fit "
                         f"{'the held-out' if held_out else 'the development'} requests "
                         f"(asked for {count})")
    step = len(candidates) / count
    return [candidates[int(i * step)][0] for i in range(count)]

