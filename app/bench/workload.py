"""Workloads: a mix of job types, an arrival process and a target load, turned into a trace.

A trace is a list of arrivals (``arrival_s, kind, params, slo, deadline_s, tenant``) and can be
written to and replayed from JSONL, so every policy sees exactly the same jobs.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.lifecycle import SloClass
from tasks.errors import InvalidJob

WORKLOAD_DIR = Path(__file__).resolve().parents[2] / "configs" / "workloads"


class MixEntry(BaseModel):
    """One job type in the mix."""

    model_config = ConfigDict(extra="forbid")

    name: str
    share: float = Field(gt=0, description="Relative frequency among arrivals.")
    slo: SloClass
    kind: Literal["simulated", "image", "video", "text"] = "simulated"
    params: dict[str, Any] = Field(default_factory=dict)
    deadline_s: float | None = Field(default=None, gt=0)
    est_service_s: float | None = Field(
        default=None, gt=0, description="Service time for load calibration (simulated: derived)."
    )

    def service_s(self) -> float:
        if self.est_service_s is not None:
            return self.est_service_s
        if self.kind == "simulated":
            return float(self.params.get("steps", 10)) * float(self.params.get("step_ms", 50)) / 1e3
        raise InvalidJob(f"mix entry {self.name}: give est_service_s for {self.kind} jobs")


class Arrivals(BaseModel):
    """Poisson arrivals, or bursts: ``burst_factor`` times the mean rate for ``on_s`` seconds
    then a lull, with the same mean rate overall."""

    model_config = ConfigDict(extra="forbid")

    process: Literal["poisson", "bursty"] = "poisson"
    burst_factor: float = Field(default=4.0, ge=1)
    on_s: float = Field(default=2.0, gt=0)
    off_s: float = Field(default=6.0, gt=0)


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    tier: Literal["gold", "standard"] = "standard"
    share: float = Field(default=1.0, gt=0)


class Workload(BaseModel):
    """A workload file in ``configs/workloads``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    duration_s: float = Field(default=60, gt=0, le=3600)
    load: float = Field(default=0.7, gt=0, le=2.0, description="Target utilisation ρ.")
    seed: int = 1
    arrivals: Arrivals = Field(default_factory=Arrivals)
    tenants: list[Tenant] = Field(default_factory=lambda: [Tenant(name="default")])
    mix: list[MixEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Workload:
        names = [m.name for m in self.mix]
        if len(set(names)) != len(names):
            raise ValueError(f"mix names must be unique: {names}")
        return self

    def mean_service_s(self) -> float:
        total = sum(m.share for m in self.mix)
        return sum(m.share * m.service_s() for m in self.mix) / total


class Arrival(BaseModel):
    """One line of a trace."""

    arrival_s: float
    name: str
    kind: str
    slo: SloClass
    params: dict[str, Any]
    deadline_s: float | None = None
    tenant: str = "default"
    tier: str = "standard"


def load_workload(name_or_path: str) -> Workload:
    path = Path(name_or_path)
    if not path.exists():
        path = WORKLOAD_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml"))
        raise InvalidJob(f"no workload {name_or_path!r}; known: {', '.join(known)}")
    return Workload.model_validate(yaml.safe_load(path.read_text()))


def generate_trace(
    workload: Workload, *, workers: int, load: float | None = None,
    duration_s: float | None = None,
) -> list[Arrival]:
    """Arrivals at the rate that makes ``load`` = λ · E[service] / workers."""
    rng = random.Random(workload.seed)
    rho = load if load is not None else workload.load
    horizon_s = duration_s if duration_s is not None else workload.duration_s
    rate_per_s = rho * workers / workload.mean_service_s()
    times = arrival_times(rng, workload.arrivals, rate_per_s, horizon_s)
    mix_weights = [m.share for m in workload.mix]
    tenant_weights = [t.share for t in workload.tenants]
    trace = []
    for t in times:
        entry = rng.choices(workload.mix, mix_weights)[0]
        tenant = rng.choices(workload.tenants, tenant_weights)[0]
        params = dict(entry.params)
        if entry.kind in ("image", "video", "text"):
            params.setdefault("seed", rng.randrange(2**31))
        trace.append(Arrival(arrival_s=round(t, 4), name=entry.name, kind=entry.kind,
                             slo=entry.slo, params=params, deadline_s=entry.deadline_s,
                             tenant=tenant.name, tier=tenant.tier))
    return trace


def arrival_times(
    rng: random.Random, arrivals: Arrivals, rate_per_s: float, horizon_s: float
) -> list[float]:
    """Arrival instants in [0, ``horizon_s``) at a mean of ``rate_per_s``, by ``arrivals``'
    process."""
    times, t = [], 0.0
    if arrivals.process == "poisson":
        while (t := t + rng.expovariate(rate_per_s)) < horizon_s:
            times.append(t)
        return times
    # Bursty: an on/off modulated Poisson process with the same mean rate. Exponential gaps are
    # memoryless, so a gap that crosses a phase boundary restarts at the boundary.
    cycle_s = arrivals.on_s + arrivals.off_s
    on_rate = min(arrivals.burst_factor * rate_per_s, rate_per_s * cycle_s / arrivals.on_s)
    off_rate = (rate_per_s * cycle_s - on_rate * arrivals.on_s) / arrivals.off_s
    while t < horizon_s:
        phase = math.fmod(t, cycle_s)
        in_burst = phase < arrivals.on_s
        rate = on_rate if in_burst else off_rate
        boundary = t - phase + (arrivals.on_s if in_burst else cycle_s)
        gap = rng.expovariate(rate) if rate > 1e-12 else math.inf
        if t + gap >= boundary:
            t = boundary
            continue
        t += gap
        if t < horizon_s:
            times.append(t)
    return times


def write_trace(trace: list[Arrival], path: Path) -> None:
    path.write_text("".join(a.model_dump_json() + "\n" for a in trace))


def read_trace(path: Path) -> list[Arrival]:
    """Replay a JSONL trace (``arrival_s, kind, params, slo or deadline_s, tenant``)."""
    trace = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            raw.setdefault("name", raw.get("kind", "job"))
            trace.append(Arrival.model_validate(raw))
        except ValueError as exc:
            raise InvalidJob(f"{path}:{number}: not a trace line: {exc}") from exc
    return sorted(trace, key=lambda a: a.arrival_s)
