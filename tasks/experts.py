"""The worker's side of expert hot updates: pick a new text job's expert version (recorded on
the job, and in its checkpoint by the runner), make sure that version is loaded, record each
chunk's outcome per version, and keep the loaded versions in step with the update record.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tasks.expert_updates import ExpertUpdates, update_policy
from tasks.record import JobRecord
from tasks.settings import Settings
from tasks.store import JobStore
from workers.checkpoint import Checkpoint
from workers.errors import ExpertVersionError
from workers.moe.runner import TextRunner
from workers.moe.session import ModelSession
from workers.moe.versioned import BASE_VERSION

log = logging.getLogger(__name__)


_UPDATES: dict[int, ExpertUpdates] = {}


def updates_of(store: JobStore, settings: Settings) -> ExpertUpdates:
    """The update records over this worker's store client (one per client)."""
    key = id(store.redis)
    if key not in _UPDATES:
        _UPDATES[key] = ExpertUpdates(store.redis, update_policy(settings.moe.versions))
    return _UPDATES[key]


def choose_version(store: JobStore, settings: Settings, runner: TextRunner, job: JobRecord,
                   params: dict[str, Any], state: Checkpoint | None) -> str:
    """The job's expert version, loaded on this worker. A resumed job keeps its checkpoint's;
    a new one keeps the version it was first given (a re-run prefill stays on it), else its
    pinned one, else the update's routing of its id; recorded on the job."""
    model = str(params["model"])
    if state is not None:
        version = str(state.meta.get("expert_version", BASE_VERSION))
    else:
        version = (job.expert_version or params.get("expert_version")
                   or updates_of(store, settings).route(model, job.job_id))
        if job.expert_version != version:
            store.set_fields(job.job_id, expert_version=version)
    ensure_loaded(store, settings, runner.session(model), version)
    return version


def ensure_loaded(store: JobStore, settings: Settings, session: ModelSession,
                  version: str) -> None:
    """Load ``version`` of the session's model from the file the update record names."""
    if session.experts.has(version):
        return
    path = updates_of(store, settings).file_of(session.name, version)
    if path is None:
        raise ExpertVersionError(f"{session.name}: no file is known for expert version "
                                 f"{version!r}; start it with `stepline experts update`")
    log.info("%s: loading expert version %s from %s", session.name, version, path)
    session.experts.load_file(version, path)


def record_outcome(store: JobStore, settings: Settings, model: str, version: str,
                   latency_ms_per_token: float, ok: bool) -> None:
    """One chunk's outcome on its version (ignored unless an update is in progress)."""
    try:
        updates_of(store, settings).record_outcome(model, version, latency_ms_per_token, ok)
    except Exception:  # the outcome is telemetry: never fail a chunk over it
        log.warning("could not record an outcome of %s version %s", model, version,
                    exc_info=True)


class VersionSync:
    """Keeps a worker's loaded versions in step with the update records: preloads a new
    candidate (so its first job does not pay the load), follows the live version, and drops
    weights no longer kept. Runs on its own thread, never on the heartbeat's, since reading a
    version file may take longer than a lease period."""

    def __init__(self, store: JobStore, settings: Settings, runner: TextRunner) -> None:
        self.store, self.settings, self.runner = store, settings, runner
        self._seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, period_s: float) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True,
                                            name="expert-versions")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sync_once(self) -> None:
        for name, session in self.runner.loaded_sessions().items():
            record = updates_of(self.store, self.settings).record(name)
            if record is None or self._seen.get(name) == record.rev:
                continue
            versions = updates_of(self.store, self.settings).versions(name)
            wanted = [*versions.kept, *([versions.candidate] if versions.candidate else [])]
            for version in wanted:
                ensure_loaded(self.store, self.settings, session, version)
            session.experts.live_version = versions.live
            if versions.candidate is not None:
                session.experts.prepare(versions.candidate)
            serving = [versions.live, *([versions.candidate] if versions.candidate else [])]
            dropped = session.experts.retain(hosts=wanted, caches=serving)
            if dropped:
                log.info("%s: dropped expert versions %s", name, ", ".join(dropped))
            self._seen[name] = record.rev

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.sync_once()
            except Exception:
                log.warning("expert version sync failed", exc_info=True)
