"""Hot update of expert versions: a candidate is loaded beside the live version, takes traffic
in steps (5 % by default) while healthy, and rolls back automatically when its latency or error
rate degrades more than the threshold (15 %) against the live version; three versions are kept.

A state machine of its inputs: time (``now_s``) and request outcomes are passed in.
"""

from __future__ import annotations

import hashlib
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

_ERROR_RATE_FLOOR = 0.01  # relative error-rate change is judged against at least 1 %


class UpdateDecision(str, Enum):
    """What :meth:`ExpertVersions.advance` did."""

    IDLE = "idle"
    """No update in progress."""
    HOLD = "hold"
    """Not enough time or samples yet to judge this step."""
    STEP_UP = "step_up"
    """The candidate was healthy; its traffic share grew by one step."""
    PROMOTED = "promoted"
    """The candidate reached 100 % and is now the live version."""
    ROLLED_BACK = "rolled_back"
    """The candidate degraded; all traffic is back on the live version."""


@dataclass(frozen=True, slots=True)
class UpdatePolicy:
    """Knobs of the hot update (``moe.versions`` in the settings)."""

    traffic_step: float = 0.05
    step_interval_s: float = 30.0
    min_samples: int = 20
    rollback_degradation: float = 0.15
    keep_versions: int = 3


@dataclass(slots=True)
class VersionStats:
    """Outcomes of one version within the current step; latency counts successes only (a
    request that failed fast must not make its version look quick)."""

    requests: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def record(self, latency_ms: float, ok: bool) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        if ok:
            self.latencies_ms.append(latency_ms)

    @property
    def median_latency_ms(self) -> float:
        """The judged latency: the median, so one cold-cache request or a pause of the
        process does not roll back a healthy version on a small sample."""
        return statistics.median(self.latencies_ms) if self.latencies_ms else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(slots=True)
class ExpertVersions:
    """The live expert version, an optional candidate, and the kept history."""

    live: str
    policy: UpdatePolicy = field(default_factory=UpdatePolicy)
    candidate: str | None = None
    share: float = 0.0
    step_started_s: float = 0.0
    kept: deque[str] = field(default_factory=deque)
    stats: dict[str, VersionStats] = field(default_factory=dict)
    last_reason: str = ""

    def __post_init__(self) -> None:
        if not self.kept:
            self.kept.append(self.live)

    def begin_update(self, version: str, now_s: float) -> None:
        """Start shifting traffic to ``version`` (already loaded beside the live one)."""
        if self.candidate is not None:
            raise ValueError(f"update to {self.candidate!r} in progress; finish or roll it back")
        if version == self.live:
            raise ValueError(f"{version!r} is already the live version")
        self.candidate, self.share = version, self.policy.traffic_step
        self._new_step(now_s)

    def route(self, job_id: str) -> str:
        """The version a job uses: a stable hash of its id against the candidate's share, so a
        job keeps its version across chunks while the share only grows."""
        if self.candidate is None:
            return self.live
        digest = hashlib.sha256(job_id.encode()).digest()
        position = int.from_bytes(digest[:8], "big") / 2**64
        return self.candidate if position < self.share else self.live

    def record(self, version: str, latency_ms: float, ok: bool) -> None:
        """One request's outcome on ``version`` (ignored if it is neither live nor candidate)."""
        if version in self.stats:
            self.stats[version].record(latency_ms, ok)

    def advance(self, now_s: float) -> UpdateDecision:
        """Judge the current step: roll back, step up, promote, or hold."""
        if self.candidate is None:
            return UpdateDecision.IDLE
        live, cand = self.stats[self.live], self.stats[self.candidate]
        if min(live.requests, cand.requests) < self.policy.min_samples:
            return UpdateDecision.HOLD
        step_over = now_s - self.step_started_s >= self.policy.step_interval_s
        # Errors are judged at once; latency, a noisy statistic, once per step on the whole
        # step's samples: judging it on every tick as samples arrive would roll back healthy
        # versions on chance alone (repeated peeking).
        reason = degradation(live, cand, self.policy.rollback_degradation,
                             latency=step_over)
        if reason:
            return self._roll_back(reason)
        if not step_over:
            return UpdateDecision.HOLD
        if self.share + self.policy.traffic_step >= 1.0 - 1e-9:
            return self._promote()  # the live version keeps a share until this last judgement
        self.share += self.policy.traffic_step
        self._new_step(now_s)
        return UpdateDecision.STEP_UP

    def roll_back_to_previous(self) -> str:
        """Manual rollback: make the previous kept version live again; returns it."""
        if len(self.kept) < 2:
            raise ValueError("no earlier version is kept to roll back to")
        self.kept.pop()
        self.live = self.kept[-1]
        self.candidate, self.share = None, 0.0
        return self.live

    def to_json(self) -> dict[str, Any]:
        """The state without the step's samples (those are kept where they are recorded)."""
        return {"live": self.live, "candidate": self.candidate, "share": self.share,
                "step_started_s": self.step_started_s, "kept": list(self.kept),
                "last_reason": self.last_reason}

    @classmethod
    def from_json(cls, body: dict[str, Any], policy: UpdatePolicy) -> ExpertVersions:
        """The state of :meth:`to_json` under ``policy``, with empty stats for this step."""
        versions = cls(live=str(body["live"]), policy=policy,
                       candidate=body.get("candidate"), share=float(body.get("share", 0.0)),
                       step_started_s=float(body.get("step_started_s", 0.0)),
                       kept=deque(str(v) for v in body.get("kept", ())),
                       last_reason=str(body.get("last_reason", "")))
        versions.stats = {v: VersionStats() for v in (versions.live, versions.candidate) if v}
        return versions

    def _promote(self) -> UpdateDecision:
        assert self.candidate is not None
        self.live, self.candidate, self.share = self.candidate, None, 0.0
        self.kept.append(self.live)
        while len(self.kept) > self.policy.keep_versions:
            self.kept.popleft()
        self.last_reason = f"promoted {self.live}"
        return UpdateDecision.PROMOTED

    def _roll_back(self, reason: str) -> UpdateDecision:
        self.last_reason = f"rolled back {self.candidate}: {reason}"
        self.candidate, self.share = None, 0.0
        return UpdateDecision.ROLLED_BACK

    def _new_step(self, now_s: float) -> None:
        self.step_started_s = now_s
        self.stats = {self.live: VersionStats()}
        if self.candidate is not None:
            self.stats[self.candidate] = VersionStats()


def degradation(live: VersionStats, cand: VersionStats, threshold: float,
                latency: bool = True) -> str:
    """Why ``cand`` is worse than ``live`` by more than ``threshold`` (relative), or ''
    (``latency=False`` judges the error rate only)."""
    if latency and live.median_latency_ms > 0 and cand.latencies_ms:
        slower = cand.median_latency_ms / live.median_latency_ms - 1.0
        if slower > threshold:
            return (f"median latency {cand.median_latency_ms:.2f} ms is {slower:.0%} above "
                    f"live's {live.median_latency_ms:.2f} ms")
    base_error = max(live.error_rate, _ERROR_RATE_FLOOR)
    worse = (cand.error_rate - live.error_rate) / base_error
    if worse > threshold:
        return f"error rate {cand.error_rate:.1%} against live {live.error_rate:.1%}"
    return ""
