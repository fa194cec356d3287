"""Step-time estimates per (cost key, device), learned online from measured chunk times."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.errors import InvalidPolicy, StateDecodeError

CHUNK_KIND_SEPARATOR = "#"


def chunk_kind(chunk_name: str) -> str:
    """``denoise[3]`` → ``denoise``: chunks of one kind cost alike (encode, denoise, decode,
    prefill, a decode chunk, a simulated step)."""
    return chunk_name.split("[", 1)[0]


def chunk_cost_key(cost_key: str, chunk_name: str) -> str:
    """The key one chunk kind of a (model, shape) is learned under, e.g.
    ``dit-tiny:256x256#denoise``: an encode chunk's time never teaches the denoise estimate.
    Priors still match by prefix (``dit-tiny``)."""
    return f"{cost_key}{CHUNK_KIND_SEPARATOR}{chunk_kind(chunk_name)}"


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """Learned seconds per cost unit on one device, and how many chunks taught it."""

    s_per_unit: float
    samples: int


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per cost unit: a prior (longest matching ``cost_key`` prefix) until measured,
    then a running mean whose weight floors at ``ewma_alpha`` (early samples weigh more).

    Immutable: :meth:`observe` returns a new model. ``learned`` maps cost key → device → estimate.
    """

    priors_s_per_unit: Mapping[str, float] = field(default_factory=dict)
    default_s_per_unit: float = 0.05
    """Prior for a cost key no prior prefix matches."""
    ewma_alpha: float = 0.2
    prior_samples: int = 1
    """How many measurements the prior is worth when the first ones arrive."""
    learned: Mapping[str, Mapping[str, CostEstimate]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.ewma_alpha <= 1:
            raise InvalidPolicy(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if self.default_s_per_unit <= 0 or self.prior_samples < 0:
            raise InvalidPolicy("default_s_per_unit must be > 0 and prior_samples >= 0")
        bad = [key for key, value in self.priors_s_per_unit.items() if not value > 0]
        if bad:
            raise InvalidPolicy(f"cost priors must be > 0 seconds per unit; check {bad}")

    def prior_s_per_unit(self, cost_key: str) -> float:
        """The prior of the longest prefix of ``cost_key`` that has one, else the default."""
        best_len, best = -1, self.default_s_per_unit
        for prefix, value in self.priors_s_per_unit.items():
            if len(prefix) > best_len and cost_key.startswith(prefix):
                best_len, best = len(prefix), value
        return best

    def seconds_per_unit(self, cost_key: str, device: str | None = None) -> float:
        """Estimate on ``device``; with no device, the mean over the devices measured so far."""
        per_device = self.learned.get(cost_key, {})
        if device is not None:
            known = per_device.get(device)
            return known.s_per_unit if known else self.prior_s_per_unit(cost_key)
        if per_device:
            return sum(e.s_per_unit for e in per_device.values()) / len(per_device)
        return self.prior_s_per_unit(cost_key)

    def samples(self, cost_key: str, device: str | None = None) -> int:
        """Measured chunks behind the estimate on ``device`` (with no device: the fewest over
        the devices measured so far; 0 when only the prior speaks)."""
        per_device = self.learned.get(cost_key, {})
        if device is not None:
            known = per_device.get(device)
            return known.samples if known else 0
        return min((e.samples for e in per_device.values()), default=0)

    def fleet_seconds_per_unit(self, cost_key: str, devices: Iterable[str]) -> float:
        """Mean estimate over the given workers' devices (one entry per worker)."""
        rates = [self.seconds_per_unit(cost_key, device) for device in devices]
        return sum(rates) / len(rates) if rates else self.seconds_per_unit(cost_key)

    def estimate_step_s(self, cost_key: str, device: str | None = None,
                        units: float = 1.0) -> float:
        """Seconds a chunk of ``units`` cost units is expected to take."""
        return units * self.seconds_per_unit(cost_key, device)

    def observe(self, cost_key: str, device: str, units: float, elapsed_s: float) -> CostModel:
        """Fold one measured chunk in; a chunk of no units or a non-finite time teaches nothing."""
        if not (units > 0 and math.isfinite(units) and math.isfinite(elapsed_s)) or elapsed_s < 0:
            return self
        sample = elapsed_s / units
        per_device = dict(self.learned.get(cost_key, {}))
        known = per_device.get(device)
        old, count = (known.s_per_unit, known.samples) if known else (
            self.prior_s_per_unit(cost_key), 0)
        weight = max(self.ewma_alpha, 1.0 / (count + self.prior_samples + 1))
        per_device[device] = CostEstimate(old + weight * (sample - old), count + 1)
        return replace(self, learned={**self.learned, cost_key: per_device})

    def with_priors(self, priors_s_per_unit: Mapping[str, float], default_s_per_unit: float,
                    ewma_alpha: float, prior_samples: int) -> CostModel:
        """The same learned estimates under new configuration (after a settings change)."""
        return replace(self, priors_s_per_unit=dict(priors_s_per_unit),
                       default_s_per_unit=default_s_per_unit, ewma_alpha=ewma_alpha,
                       prior_samples=prior_samples)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``json.dumps``."""
        return {
            "priors_s_per_unit": dict(self.priors_s_per_unit),
            "default_s_per_unit": self.default_s_per_unit,
            "ewma_alpha": self.ewma_alpha,
            "prior_samples": self.prior_samples,
            "learned": {
                key: {dev: [e.s_per_unit, e.samples] for dev, e in per_device.items()}
                for key, per_device in self.learned.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostModel:
        """Inverse of :meth:`to_json`; raises :class:`StateDecodeError` on a foreign shape."""
        try:
            learned = {
                str(key): {str(dev): CostEstimate(float(pair[0]), int(pair[1]))
                           for dev, pair in per_device.items()}
                for key, per_device in data["learned"].items()
            }
            return cls(
                priors_s_per_unit={str(k): float(v) for k, v in data["priors_s_per_unit"].items()},
                default_s_per_unit=float(data["default_s_per_unit"]),
                ewma_alpha=float(data["ewma_alpha"]),
                prior_samples=int(data["prior_samples"]),
                learned=learned,
            )
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise StateDecodeError(
                f"cost model is not what CostModel.to_json writes ({exc!r}); "
                "delete the stored model to relearn from the priors"
            ) from exc
