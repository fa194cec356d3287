"""Expert hot updates, cluster-wide: one record per model in Redis holds the version state
(live, candidate, traffic share, kept versions) and where each version's file is; workers
record per-version outcomes of the current step, route new jobs by the record, and the tick
advances it (step up, promote, or roll back) on its timer.

Why a Redis record and not a remote-control broadcast: a broadcast is fire-and-forget pub/sub,
so a worker that is reconnecting or starts later would miss it; the record *is* the state, and
every worker (new ones too) reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from tasks import keys, scripts
from tasks.errors import SteplineError
from tasks.settings.moe import VersionSettings
from workers.moe.versions import ExpertVersions, UpdateDecision, UpdatePolicy, VersionStats

log = logging.getLogger(__name__)

UPDATING_KEY = keys.EXPERT_UPDATES
"""Models with a candidate version taking traffic (what the tick looks at)."""
_HISTORY = 50
_STATS_TTL_S = 3600

class UpdateRefused(SteplineError):
    """Raised when an expert update cannot start (one in progress, a bad name or file)."""


def update_policy(settings: VersionSettings) -> UpdatePolicy:
    return UpdatePolicy(traffic_step=settings.traffic_step,
                        step_interval_s=settings.step_interval,
                        min_samples=settings.min_samples,
                        rollback_degradation=settings.rollback_degradation,
                        keep_versions=settings.keep_versions)


@dataclass
class UpdateRecord:
    """What Redis holds for one model."""

    model: str
    state: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    step: int = 0
    rev: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "state": self.state, "files": self.files,
                           "step": self.step, "rev": self.rev, "history": self.history})

    @classmethod
    def from_json(cls, raw: bytes | str) -> UpdateRecord:
        body = json.loads(raw)
        return cls(model=body["model"], state=body["state"], files=body.get("files", {}),
                   step=int(body.get("step", 0)), rev=int(body.get("rev", 0)),
                   history=list(body.get("history", [])))


class ExpertUpdates:
    """The update records of every model, over one Redis client."""

    def __init__(self, client: redis.Redis, policy: UpdatePolicy) -> None:
        self.redis = client
        self.policy = policy
        self._record_outcome = scripts.register(client, "record_outcome")

    # reading ----------------------------------------------------------------------------------
    def record(self, model: str) -> UpdateRecord | None:
        raw = cast(bytes | None, self.redis.get(keys.expert_record(model)))
        return UpdateRecord.from_json(raw) if raw is not None else None

    def versions(self, model: str) -> ExpertVersions:
        """The model's version state (the built-in weights, ``base``, when never updated)."""
        record = self.record(model)
        if record is None:
            return ExpertVersions(live="base", policy=self.policy)
        return ExpertVersions.from_json(record.state, self.policy)

    def route(self, model: str, job_id: str) -> str:
        """The version a new job of ``model`` runs on (stable per job)."""
        return self.versions(model).route(job_id)

    def file_of(self, model: str, version: str) -> Path | None:
        record = self.record(model)
        path = record.files.get(version) if record else None
        return Path(path) if path else None

    # writing ----------------------------------------------------------------------------------
    def begin(self, model: str, version: str, path: Path, now_s: float) -> UpdateRecord:
        """Start shifting traffic of ``model`` to ``version`` read from ``path``."""
        def start(record: UpdateRecord, versions: ExpertVersions) -> None:
            known = record.files.get(version)
            if (known is not None and known != str(path)) or version == "base":
                raise UpdateRefused(f"version {version!r} of {model} already names another "
                                    "file; choose a new name with --name")
            try:
                versions.begin_update(version, now_s)
            except ValueError as exc:
                raise UpdateRefused(f"{model}: {exc}") from exc
            record.files[version] = str(path)
            record.history.append({"ts": now_s, "decision": "begin", "version": version,
                                   "share": versions.share})

        return self._change(model, start)

    def roll_back(self, model: str, now_s: float) -> UpdateRecord:
        """Manual rollback: drop the candidate, or else go back to the previous kept version."""
        def back(record: UpdateRecord, versions: ExpertVersions) -> None:
            if versions.candidate is not None:
                versions.last_reason = f"rolled back {versions.candidate} by hand"
                versions.candidate, versions.share = None, 0.0
            else:
                try:
                    versions.roll_back_to_previous()
                except ValueError as exc:
                    raise UpdateRefused(f"{model}: {exc}") from exc
                versions.last_reason = f"back to {versions.live} by hand"
            record.history.append({"ts": now_s, "decision": "manual_rollback",
                                   "version": versions.live, "share": 0.0})

        return self._change(model, back)

    def record_outcome(self, model: str, version: str, latency_ms: float, ok: bool) -> None:
        """One chunk's outcome on ``version`` (kept only while an update is in progress)."""
        outcome = f"{1 if ok else 0}:{latency_ms:.4f}"
        self._record_outcome(keys=[self._step_key(model)],
                             args=[self._stats_prefix(model), version, outcome, _STATS_TTL_S])

    def advance(self, model: str, now_s: float) -> UpdateDecision:
        """Judge the current step of ``model``'s update from the recorded outcomes."""
        decision = UpdateDecision.IDLE

        def judge(record: UpdateRecord, versions: ExpertVersions) -> None:
            nonlocal decision
            versions.stats = self._stats(model, record.step, versions)
            decision = versions.advance(now_s)
            if decision is UpdateDecision.HOLD:
                raise _NoChange
            record.history.append({"ts": now_s, "decision": decision.value,
                                   "version": versions.candidate or versions.live,
                                   "share": versions.share, "reason": versions.last_reason})

        with contextlib.suppress(_NoChange):
            self._change(model, judge)
        if decision not in (UpdateDecision.IDLE, UpdateDecision.HOLD):
            log.info("expert update of %s: %s", model, decision.value)
        return decision

    def advance_all(self, now_s: float) -> dict[str, UpdateDecision]:
        """:meth:`advance` every model with an update in progress (the tick calls this)."""
        models = sorted(m.decode() for m in cast(set[bytes], self.redis.smembers(UPDATING_KEY)))
        return {model: self.advance(model, now_s) for model in models}

    # internals --------------------------------------------------------------------------------
    def _change(self, model: str, change: Any) -> UpdateRecord:
        """Read-modify-write the record under WATCH; every change starts a new step."""
        key = keys.expert_record(model)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = cast(bytes | None, pipe.get(key))
                    record = (UpdateRecord.from_json(raw) if raw is not None
                              else UpdateRecord(model, ExpertVersions("base").to_json()))
                    versions = ExpertVersions.from_json(record.state, self.policy)
                    change(record, versions)
                    record.state, record.step, record.rev = (
                        versions.to_json(), record.step + 1, record.rev + 1)
                    record.history = record.history[-_HISTORY:]
                    pipe.multi()
                    pipe.set(key, record.to_json())
                    if versions.candidate is not None:
                        pipe.set(self._step_key(model), record.step)
                        pipe.sadd(UPDATING_KEY, model)
                    else:
                        pipe.delete(self._step_key(model))
                        pipe.srem(UPDATING_KEY, model)
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    def _stats(self, model: str, step: int,
               versions: ExpertVersions) -> dict[str, VersionStats]:
        stats = {}
        for version in (versions.live, versions.candidate):
            if version is None:
                continue
            raw = cast(list[bytes], self.redis.lrange(
                f"{self._stats_prefix(model)}{step}:{version}", 0, -1))
            stats[version] = VersionStats()
            for item in raw:
                ok, latency_ms = item.decode().split(":", 1)
                stats[version].record(float(latency_ms), ok == "1")
        return stats

    @staticmethod
    def _step_key(model: str) -> str:
        return keys.expert_step(model)

    @staticmethod
    def _stats_prefix(model: str) -> str:
        return keys.expert_stats_prefix(model)


class _NoChange(Exception):
    """Raised inside a record change to leave the record as it is."""
