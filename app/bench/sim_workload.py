"""The simulated workload: the job mix (its shapes and their published step figures), one
simulated run's configuration, the seeded trace of arrivals every policy sees, and the policy
as an operator would configure it for that run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.bench.sim_residency import ResidencyConfig
from app.bench.workload import Arrivals, arrival_times
from scheduler import JobKind, PolicyConfig, PolicyKind, SloClass, Tier

CLASS_TARGET_S = {SloClass.REALTIME: 1.0, SloClass.INTERACTIVE: 5.0, SloClass.BATCH: 60.0}


@dataclass(frozen=True, slots=True)
class Shape:
    """One job type of the mix: chunks of ``units_per_chunk`` cost units at ``s_per_unit``."""

    name: str
    share: float
    slo: SloClass
    kind: JobKind
    cost_key: str
    chunks: int
    units_per_chunk: float
    s_per_unit: float
    block_groups: int
    deadline_s: float | None = None
    """Explicit SLO (seconds after arrival); None: the class target."""

    @property
    def service_s(self) -> float:
        return self.chunks * self.units_per_chunk * self.s_per_unit


# Per-step H100 figures of the step-cost table (= the policy's cost priors): a chunk is one
# denoising step, or one decode chunk of K tokens (K = 8 interactive, 4 realtime).
MIX: tuple[Shape, ...] = (
    Shape("thumbnail-256", 0.40, SloClass.REALTIME, JobKind.IMAGE, "image-256", 50, 1, 0.010, 1),
    Shape("image-512", 0.30, SloClass.INTERACTIVE, JobKind.IMAGE, "image-512", 20, 1, 0.03, 2),
    Shape("chat-128tok", 0.20, SloClass.INTERACTIVE, JobKind.TEXT, "text", 16, 8, 0.006, 8),
    Shape("image-1024", 0.08, SloClass.BATCH, JobKind.IMAGE, "image-1024", 28, 1, 0.23, 2),
    Shape("video-480p", 0.02, SloClass.BATCH, JobKind.VIDEO, "video-480p", 50, 1, 1.3, 4,
          deadline_s=300.0),
)
URGENT = Shape("urgent-text", 0.0, SloClass.REALTIME, JobKind.TEXT, "text", 1, 4, 0.006, 4,
               deadline_s=0.08)
"""The stress test's urgent job: a 4-token reply (~24 ms) due within 80 ms."""


DEFAULT_HOP_S = 0.003
"""The overhead the simulator charges a chunk unless told otherwise: a hop measured on a quiet
machine (``tests/bench/bench_hop.py``)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run; times in virtual seconds."""

    workers: int = 16
    rate_per_s: float = 10.0
    duration_s: float = 60.0
    """Arrivals stop here; the run goes on for ``drain_s`` so queued work can finish."""
    drain_s: float = 30.0
    seed: int = 1
    dispatch_overhead_s: float = DEFAULT_HOP_S
    """Per hop: finish, publish the next chunk, a worker picks it up (unix socket ~2 ms, TCP
    3-5 ms)."""
    jitter: float = 0.1
    """Each chunk's duration is its prior × U(1 - jitter, 1 + jitter)."""
    tick_s: float = 0.1
    urgent_share: float = 0.0
    """Share of arrivals replaced by urgent (< 100 ms SLO) jobs."""
    fail_at_s: float | None = None
    """One busy worker dies here: its chunk is lost; its job resumes from its checkpoint once
    the chunk lease (and heartbeat) lapse."""
    lease_s: float = 10.0
    gold_share: float = 0.3
    bursty: bool = False
    """On/off modulated Poisson arrivals (``Arrivals(process="bursty")``: bursts at 4× the
    rate, then a lull) at the same mean rate; otherwise plain Poisson."""
    residency: ResidencyConfig | None = None
    """Model residency and placement (``app.bench.sim_residency``, ``app.bench.sim_placement``):
    applies only to a trace whose jobs name models; None or a single-model trace runs as if
    every model were held."""

    @classmethod
    def stress(cls, workers: int = 256, rate_per_s: float = 1000.0,
               duration_s: float = 60.0, **overrides: Any) -> SimConfig:
        """The reference stress test: mixed load, urgent jobs injected at random, a worker
        failing mid-run."""
        return cls(workers=workers, rate_per_s=rate_per_s, duration_s=duration_s,
                   urgent_share=0.05, fail_at_s=duration_s / 2, **overrides)

    @property
    def end_s(self) -> float:
        return self.duration_s + self.drain_s


@dataclass(frozen=True, slots=True)
class SimArrival:
    """One job of the trace, with its true chunk durations (the policies see only estimates)."""

    index: int
    arrival_s: float
    shape: Shape
    tier: Tier
    chunk_s: tuple[float, ...]
    deadline_s: float
    """Absolute, on the trace's clock: the job's own, or its shape's SLO after arrival."""
    model: str | None = None
    """The base model its chunks need resident (None: the single-model mix)."""
    adapters: tuple[str, ...] = ()
    tenant: str | None = None
    """Its tenant (None: ``acme`` for a gold job, ``hobbyist`` for a standard one)."""
    min_steps: int | None = None
    """Its quality floor (``JobSpec.quality_floor``): under overload it may run as few chunks
    (each chunk is a step); None: never degraded."""
    cache_share: float | None = None
    """With a floor, the step cache it also accepts: a cached step's share of a full one's time
    (None: it runs uncached)."""
    min_pixel_share: float | None = None
    """With a floor, the smallest image it also accepts, as a share of its pixels (a 64 px
    square's 8 px grid; None: its own size)."""

    @property
    def group(self) -> str:
        return "urgent" if self.shape is URGENT else self.shape.slo.value


def generate_trace(config: SimConfig) -> list[SimArrival]:
    """Arrivals of the mix (and urgent jobs), seeded: every policy sees the same jobs."""
    rng = random.Random(config.seed)
    weights = [s.share for s in MIX]
    trace: list[SimArrival] = []
    for t in _arrival_instants(config, rng):
        urgent = rng.random() < config.urgent_share
        shape = URGENT if urgent else rng.choices(MIX, weights)[0]
        tier = Tier.GOLD if rng.random() < config.gold_share else Tier.STANDARD
        base_s = shape.units_per_chunk * shape.s_per_unit
        chunk_s = tuple(base_s * (1.0 + config.jitter * (2.0 * rng.random() - 1.0))
                        for _ in range(shape.chunks))
        budget_s = shape.deadline_s or CLASS_TARGET_S[shape.slo]
        trace.append(SimArrival(len(trace), t, shape, tier, chunk_s, t + budget_s))
    return trace


def _arrival_instants(config: SimConfig, rng: random.Random) -> Iterator[float]:
    """Poisson gaps drawn lazily from ``rng`` (between the draws of each job), or the whole
    bursty process up front."""
    if config.bursty:
        yield from arrival_times(rng, Arrivals(process="bursty"), config.rate_per_s,
                                 config.duration_s)
        return
    t = 0.0
    while (t := t + rng.expovariate(config.rate_per_s)) < config.duration_s:
        yield t


def mix_mean_service_s(urgent_share: float = 0.0) -> float:
    """E[service] of an arrival of the mix with ``urgent_share`` of urgent jobs."""
    total = sum(s.share for s in MIX)
    mean_s = sum(s.share * s.service_s for s in MIX) / total
    return (1 - urgent_share) * mean_s + urgent_share * URGENT.service_s


def offered_load(config: SimConfig) -> float:
    """ρ = λ · E[service] / workers for the configured mix."""
    return config.rate_per_s * mix_mean_service_s(config.urgent_share) / config.workers


def sim_policy(config: SimConfig, policy: str) -> PolicyConfig:
    """The policy as an operator would configure it for this cluster: its measured hop cost
    and tick interval."""
    return PolicyConfig(policy=PolicyKind(policy), hop_overhead_s=config.dispatch_overhead_s,
                        tick_interval_s=config.tick_s)
