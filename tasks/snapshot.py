"""Reading the world for the tick: live job records, worker heartbeats, the learned cost model
(new chunk timings folded in and written back) and the policy's memory, turned into the pure
policy's ``ClusterSnapshot``: facts only, every ``JobView`` field the planner reads written here.

Two readers give the same snapshot: :func:`read_snapshot` reads every live record each time;
:class:`SnapshotCache`, the scheduler worker's, keeps the records and their views between ticks
and reads only those the change stream (``sl:changes``, marked by every writer of a record)
names since its last tick — and everything again when it cannot trust the stream.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from scheduler import (
    ClusterSnapshot,
    CostModel,
    JobKind,
    JobView,
    PolicyConfig,
    PolicyState,
    WorkerView,
)
from scheduler.errors import SchedulerError
from scheduler.lifecycle import JobState
from tasks import keys
from tasks.errors import JobNotFound
from tasks.heartbeat import Heartbeat, decode_heartbeats
from tasks.load_estimates import LearnedLoads
from tasks.record import JobRecord, UnreadableRecord
from tasks.routing import CONTROL, affinity_worker, class_queue_of
from tasks.settings.diffusion import DiffusionSettings
from tasks.store import JobStore
from tasks.store_calls import Written

log = logging.getLogger(__name__)

OWN_MEDIAN_MIN_COMMITS = 3
"""Commits a job needs before its own median chunk time is trusted as the expected time."""

DIFFUSION_BLOCK_GROUPS: int = DiffusionSettings.model_fields["block_groups"].default
"""The settings' default ``diffusion.block_groups``, for callers that plan without settings."""


@dataclass(frozen=True, slots=True)
class Seen:
    """One tick's snapshot, and the records it was read from: every action the tick applies is
    conditioned on the record it saw (state, epoch, sequence number)."""

    snapshot: ClusterSnapshot
    records: Mapping[str, JobRecord]
    heartbeats: Mapping[str, Heartbeat] = field(default_factory=dict)
    """The workers' heartbeats the snapshot's worker views were read from."""


def read_snapshot(store: JobStore, cost: CostModel, policy: PolicyConfig, now_s: float,
                  diffusion_block_groups: int = DIFFUSION_BLOCK_GROUPS,
                  learned: LearnedLoads | None = None) -> Seen:
    """Everything ``plan_tick`` reads: the live records, heartbeats and policy state in a
    handful of round trips, plus one per dependency of a waiting job and one event-stream read
    per long-running job. ``diffusion_block_groups``: the workers' ``diffusion.block_groups``;
    ``learned``: the load times the views' ``reload_s`` count (None: the priors)."""
    learned = LearnedLoads() if learned is None else learned
    records: dict[str, JobRecord] = {}
    unreadable: list[tuple[str, str]] = []
    for item in store.records(store.active_ids()):
        if isinstance(item, UnreadableRecord):
            log.error("job %s: %s", item.job_id, item)
            unreadable.append((item.job_id, item.problem))
        else:
            records[item.job_id] = item
    failed_deps = failed_dependencies(store, records.values())
    long_running = _long_running(records.values(), policy.recovery.stuck_min_s, now_s)
    own = {job_id: own_s_per_unit(store, records[job_id]) for job_id in long_running}
    views = tuple(job_view(r, failed_deps.get(r.job_id), own.get(r.job_id),
                           diffusion_block_groups, learned) for r in records.values())
    beats = store.heartbeats()
    snapshot = ClusterSnapshot(jobs=views, workers=worker_views(beats.values()), cost=cost,
                               state=load_policy_state(store), unreadable=tuple(unreadable))
    return Seen(snapshot, records, beats)


def job_view(r: JobRecord, failed_dependency: str | None = None,
             own_s_per_unit: float | None = None,
             diffusion_block_groups: int = DIFFUSION_BLOCK_GROUPS,
             learned: LearnedLoads | None = None) -> JobView:
    """A job's view for the policy. A job parked in a worker's affinity queue shows its class
    queue (the policy plans classes) and names the worker in ``parked_on``; its ``reload_s``
    is by the load times ``learned`` (None: the priors)."""
    learned = LearnedLoads() if learned is None else learned
    published = _published(r)
    return JobView(
        job_id=r.job_id, tenant=r.tenant, tier=r.tier, slo_class=r.slo, kind=r.kind,
        state=r.state, submitted_at_s=r.submitted_at_s, deadline_s=r.deadline_at_s,
        cost_key=r.cost_key, num_chunks=r.num_chunks, next_chunk=r.next_chunk,
        remaining_cost_units=r.remaining_cost_units,
        remaining_units_by_key=r.remaining_units_by_key,
        block_groups=block_groups(r, diffusion_block_groups),
        queue=class_queue_of(r.queue) or None, running_on=r.running_on,
        service_s=r.service_s,
        waiting_since_s=waiting_since_s(r),
        preemptions=r.preemptions, resource_profile=r.resource_profile,
        depends_on=r.depends_on, level=r.level, level_service_s=r.level_mark_s,
        preempt_requested=r.preempt, epoch=r.epoch, lease_until_s=r.lease_until_s,
        chunk_running_since_s=r.chunk_running_since_s,
        stuck_requeues=r.stuck,
        next_chunk_cost_units=(r.cost_units[r.next_chunk] if r.next_chunk < r.num_chunks
                               else 0.0),
        own_s_per_unit=own_s_per_unit, parked_on=affinity_worker(r.queue),
        reload_s=learned.reload_s(r.kind, r.params),
        published=published, failed_dependency=failed_dependency,
        shed_if_late=r.shed_if_late, estimated=r.first_estimate_s is not None,
        batch_group=r.batch_group, batch_id=r.batch, batch_growth=r.batch_growth,
    )


def waiting_since_s(r: JobRecord) -> float:
    """When the job last began waiting (``JobView.waiting_since_s``): the later of its last
    queueing (a release or a hop) and its last preemption, else its submit. A preempted job
    waits from its preemption, not from when the chunk it stopped after was queued: read that
    way, a job preempted after a long wait on standby looked as if it had waited all along,
    aged ahead of the job that displaced it, was released, and once running (a running job
    has waited nothing) fell behind again and was preempted anew."""
    marks = [s for s in (r.queued_at_s, r.preempted_at_s) if s is not None]
    return max(marks) if marks else r.submitted_at_s


def block_groups(r: JobRecord, diffusion_block_groups: int) -> int:
    """Block groups of the job's next chunk, where a preempted chunk stops (its worker is free
    within one group's time), as the runners ask ``should_yield``: a simulated step sleeps in
    its ``block_groups`` slices; a denoise step runs its transformer in the workers'
    ``diffusion.block_groups`` groups; a text decode chunk asks before each of its
    ``chunk_tokens`` tokens; any other chunk (encode, prefill, VAE decode) runs whole."""
    if r.kind is JobKind.SIMULATED:
        return int(r.params.get("block_groups", 1))
    name = r.chunk_name
    if r.kind is JobKind.TEXT:
        return int(r.params.get("chunk_tokens", 1)) if name.startswith("decode") else 1
    return diffusion_block_groups if name.startswith("denoise") else 1


def _published(r: JobRecord) -> tuple[int, int]:
    """(chunk, epoch) of the last published message, from its task id ``job.chunk.epoch.x``;
    (-1, -1) when nothing (readable) was published."""
    parts = (r.last_task_id or "").split(".")
    try:
        return (int(parts[1]), int(parts[2])) if len(parts) >= 3 else (-1, -1)
    except ValueError:
        return (-1, -1)


def failed_dependencies(store: JobStore, records: Iterable[JobRecord]) -> dict[str, str]:
    """Why each waiting job with dependencies can never run, for those that cannot: one of its
    dependencies failed, was cancelled, expired, or does not exist."""
    waiting = [r for r in records if r.depends_on and r.state is JobState.PENDING]
    reasons: dict[str, str] = {}
    for r in waiting:
        for dep in r.depends_on:
            try:
                state = store.state(dep)
            except JobNotFound:
                state = JobState.FAILED
            if (reason := _dependency_failed(dep, state)) is not None:
                reasons[r.job_id] = reason
                break
    return reasons


def _dependency_failed(dep: str, state: JobState) -> str | None:
    if state.is_terminal and state is not JobState.DONE:
        return f"dependency {dep} ended {state.value}"
    return None


def _long_running(records: Iterable[JobRecord], floor_s: float, now_s: float) -> list[str]:
    """RUNNING jobs whose chunk has run past the stuck floor: only those may need their own
    median chunk time (most chunks end long before)."""
    return [r.job_id for r in records
            if (since_s := r.chunk_running_since_s) is not None and now_s - since_s > floor_s]


def own_s_per_unit(store: JobStore, r: JobRecord) -> float | None:
    """The job's own median seconds per cost unit over its commits (None with fewer than
    :data:`OWN_MEDIAN_MIN_COMMITS`)."""
    return own_median(r, _commits_of(store.events(r.job_id)).values())


def _commits_of(events: Iterable[Mapping[str, str]]) -> dict[int, tuple[int, float]]:
    """A job's commits from its event stream: seq → (chunk, service seconds)."""
    return {int(e["seq"]): (int(e.get("chunk", -1)), float(e["service_s"]))
            for e in events if e.get("kind") == "commit"}


def own_median(r: JobRecord, commits: Iterable[tuple[int, float]]) -> float | None:
    """The median seconds per cost unit of ``r``'s commits ((chunk, service seconds) each) over
    chunks with a cost (None with fewer than :data:`OWN_MEDIAN_MIN_COMMITS`)."""
    rates = [service_s / r.cost_units[index] for index, service_s in commits
             if 0 <= index < r.num_chunks and r.cost_units[index] > 0]
    return float(statistics.median(rates)) if len(rates) >= OWN_MEDIAN_MIN_COMMITS else None


def worker_views(beats: Iterable[Any]) -> tuple[WorkerView, ...]:
    """Chunk workers from their heartbeats (scheduler workers, on ``control``, run ticks): a
    heartbeat read is one written within its chunk lease (its key expires with it), so each is
    alive; one that says it is idle says since when (not while it warms up: it may not consume
    yet)."""
    views = []
    for beat in beats:
        if CONTROL in beat.queues:
            continue
        idle = beat.idle_since if beat.busy_job is None and beat.warm else None
        views.append(WorkerView(name=beat.name, alive=True, busy_job=beat.busy_job,
                                queues=beat.queues, device=beat.device, idle_since_s=idle,
                                seen_at_s=beat.ts, loads=device_loads(beat)))
    return tuple(views)


HOLDING_TIERS = frozenset({"disk", "host", "adapter"})
"""Load tiers that hold the device (a background stage into host memory does not)."""


def device_loads(beat: Heartbeat) -> tuple[tuple[float, float], ...]:
    """The heartbeat's recent loads that held its device, as (end, seconds) on the heartbeat's
    wall clock: each load's end (``at``, on the residency's clock) moved by its age at the
    heartbeat (``clock`` − ``at``). Empty from a heartbeat without its time or clock."""
    residency = beat.residency
    clock, recent = residency.get("clock"), residency.get("recent")
    if beat.ts is None or not _is_number(clock) or not isinstance(recent, list):
        return ()
    out = []
    for load in recent:
        if isinstance(load, dict) and load.get("tier") in HOLDING_TIERS \
                and _is_number(load.get("at")) and _is_number(load.get("s")):
            out.append((beat.ts - (clock - load["at"]), float(load["s"])))
    return tuple(out)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _stored_cost(store: JobStore, policy: PolicyConfig) -> tuple[CostModel, str]:
    """The cost model the last tick stored under the policy's priors (the priors alone before
    the first), and the id of the last timing folded into it."""
    raw = store.redis.get(keys.COST)
    stored = json.loads(raw) if raw is not None else {}
    model = policy.new_cost_model() if "model" not in stored else CostModel.from_json(
        stored["model"]).with_priors(policy.cost_priors_s_per_unit, policy.default_s_per_unit,
                                     policy.cost_ewma_alpha, policy.cost_prior_samples)
    return model, stored.get("last_id", "0-0")


def stored_cost_model(store: JobStore, policy: PolicyConfig) -> CostModel:
    """The cost model the last tick stored, read without folding in newer timings: what the
    submit path prices a job with."""
    return _stored_cost(store, policy)[0]


def learned_cost_model(store: JobStore, policy: PolicyConfig) -> CostModel:
    """The stored cost model, updated with every chunk timing recorded since the last tick."""
    model, last_id = _stored_cost(store, policy)
    entries = store.read_stream(keys.TIMINGS, after_id=last_id, count=5000)
    for entry_id, fields in entries:
        model = model.observe(fields["cost_key"], fields["device"], 1.0,
                              float(fields["s_per_unit"]))
        last_id = entry_id
    if entries:
        store.redis.set(keys.COST, json.dumps({"model": model.to_json(), "last_id": last_id}))
    return model


def load_policy_state(store: JobStore) -> PolicyState:
    raw = store.redis.get(keys.POLICY_STATE)
    if raw is None:
        return PolicyState()
    try:
        return PolicyState.from_json(json.loads(raw))
    except (SchedulerError, ValueError):
        log.warning("stored policy state unreadable; starting afresh")
        return PolicyState()


class SnapshotCache:
    """The tick's snapshot kept between ticks in the scheduler worker: the live records (and
    unreadable ones) by id, each record's view, and the facts derived from them; each tick folds
    in only the records the change stream names since the last one.

    Every writer of a job record marks it on ``sl:changes`` in the same script (or MULTI) as
    its write, so a record read after its mark is at least as new as the mark. Each write also
    bumps the record's revision (``rev``), and a script's mark carries the new one: a record the
    cache holds at that revision or later is not read again. The tick's own writes come back
    with their revisions (:meth:`fold_written`): a record the cache held just before such a
    write (one revision less) is updated in place with what the write set, so the marks of a
    tick's own actions cost the next tick nothing; a write of anyone else in between leaves the
    revisions apart, and the record is read. The cache
    remembers the id of the last mark it folded and reads from it, inclusive: when that entry is
    gone (the stream was trimmed past it, or flushed), marks may have been lost, and the cache
    reads every record again — as it does on its first tick and after :meth:`invalidate` (the
    tick lease changed hands), and every :attr:`resync_s`. A full read first appends an anchor
    mark, so anything written after it is folded next tick.

    Derived facts come without a round trip per job: a waiting job's dependencies are live
    records in the cache or, once ended, states remembered (ended states never change; the rest
    is one pipelined read per tick); a long-running job's own chunk times are read from its
    event stream once, then kept up to date from the commits' marks (seq, chunk, service time).
    Heartbeats are read by name from ``sl:workers:live``, plus a scan of the keyspace every
    :attr:`heartbeat_scan_s` for workers that do not register there.

    :meth:`read` gives the snapshot :func:`read_snapshot` would give of the same store.
    """

    heartbeat_scan_s = 5.0
    resync_s = 300.0
    """Every record is read again at least this often: a Sentinel failover that lost the last
    writes a tick folded (asynchronous replication) would otherwise leave them in the cache."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._last_id: str | None = None
        self._read_all_at = float("-inf")
        self._items: dict[str, JobRecord | UnreadableRecord] = {}
        self._records: dict[str, JobRecord] = {}
        self._order: list[str] = []
        """The ids of ``_items``, sorted (the full read's order)."""
        self._views: dict[str, JobView] = {}
        self._block_groups = DIFFUSION_BLOCK_GROUPS
        self._learned = LearnedLoads()
        """The load times the views' ``reload_s`` count (the last read's)."""
        self._waiting_deps: set[str] = set()
        """PENDING jobs with dependencies."""
        self._running: set[str] = set()
        self._commits: dict[str, dict[int, tuple[int, float]]] = {}
        """Own commits (seq → chunk, service seconds) of jobs whose event stream was read."""
        self._ended: dict[str, JobState] = {}
        """Terminal states of dependencies outside the live set."""
        self._gone: dict[str, int] = {}
        """Jobs the tick's own writes ended since the last fold, and the revision each left
        (their marks, up to it, need no read: the job left the live set for good)."""
        self._scanned: list[str] = []
        self._scanned_at = float("-inf")
        self.full_reads = 0
        """How many times every record was read (the first tick's, gaps, lease changes)."""
        self.changed = 0
        """How many records the last tick read (all of them on a full read)."""
        self._built: _Built | None = None

    def invalidate(self) -> None:
        """Read every record at the next tick (the tick lease changed hands)."""
        self._last_id = None

    def fold(self) -> dict[str, JobRecord | UnreadableRecord]:
        """Fold in what changed since the last tick and return the live records (and unreadable
        ones) by id: what a full read of ``sl:jobs:active`` would find."""
        try:
            self._fold()
        except BaseException:
            self.invalidate()
            raise
        return dict(self._items)

    def fold_written(self, written: Iterable[Written]) -> None:
        """Fold in the writes the tick itself made (in the order made), without reading: a
        record held at one revision before a write is now the record with the write's fields
        set; a job a write ended leaves the cache. Any other record is left for the change
        stream to name (someone else wrote it in between, or it was never held)."""
        chains: dict[str, tuple[JobRecord, dict[str, str], int]] = {}
        """Per job: the record held, the fields its writes set over it, the last revision."""
        for w in written:
            if w.ended:
                chains.pop(w.job_id, None)
                self._gone[w.job_id] = w.rev
                if w.job_id in self._items:
                    self._built = None
                    self._drop(w.job_id)
                continue
            chain = chains.get(w.job_id)
            if chain is not None:
                if chain[2] == w.rev - 1:
                    chain[1].update(w.fields)
                    chains[w.job_id] = (chain[0], chain[1], w.rev)
                continue  # else someone else wrote in between: its mark names the record
            held = self._records.get(w.job_id)
            if held is not None and held.rev == w.rev - 1:
                chains[w.job_id] = (held, dict(w.fields), w.rev)
        for job_id, (held, fields, rev) in chains.items():
            fields["rev"] = str(rev)
            try:
                record = held.with_fields(fields)
            except UnreadableRecord:
                continue  # read back next tick, and reported as a full read reports it
            self._built = None
            self._put(job_id, record)

    def read(self, cost: CostModel, policy: PolicyConfig, now_s: float,
             diffusion_block_groups: int = DIFFUSION_BLOCK_GROUPS,
             learned: LearnedLoads | None = None) -> Seen:
        """What :func:`read_snapshot` reads, from the cache and what changed since (the
        views read now count the load times ``learned``; None: the priors)."""
        self._learned = LearnedLoads() if learned is None else learned
        if diffusion_block_groups != self._block_groups:
            self._block_groups, self._built = diffusion_block_groups, None
            self._views = {job_id: self._view(r) for job_id, r in self._records.items()}
        try:
            self._fold()
        except BaseException:
            self.invalidate()
            raise
        failed = self._failed_dependencies()
        own = {job_id: s for job_id, s in
               self._own(policy.recovery.stuck_min_s, now_s).items() if s is not None}
        if self._built is None:
            self._built = self._build()
        jobs, unreadable, records, index = self._built
        if failed or own:
            views = list(jobs)
            for job_id in {*failed, *own}:
                i = index[job_id]
                views[i] = replace(views[i], failed_dependency=failed.get(job_id),
                                   own_s_per_unit=own.get(job_id))
            jobs = tuple(views)
        beats = self._heartbeats()
        snapshot = ClusterSnapshot(jobs=jobs, workers=worker_views(beats.values()), cost=cost,
                                   state=load_policy_state(self.store), unreadable=unreadable)
        return Seen(snapshot, records, beats)

    def _build(self) -> _Built:
        """The views in the full read's order (by id), the unreadable records, a copy of the
        records for the tick's apply, and each view's index: rebuilt only after a change."""
        views, unreadable = [], []
        for job_id in self._order:
            view = self._views.get(job_id)
            if view is None:
                item = cast(UnreadableRecord, self._items[job_id])
                unreadable.append((job_id, item.problem))
            else:
                views.append(view)
        index = {view.job_id: i for i, view in enumerate(views)}
        return tuple(views), tuple(unreadable), dict(self._records), index

    # folding ---------------------------------------------------------------------------------
    def _fold(self) -> None:
        if self._last_id is None or time.monotonic() - self._read_all_at >= self.resync_s:
            self._read_all()
            return
        raw = cast(list[tuple[bytes, dict[bytes, bytes]]],
                   self.store.redis.xrange(keys.CHANGES, min=self._last_id, max="+"))
        if not raw or raw[0][0].decode() != self._last_id:
            log.info("the change stream was trimmed past the tick's last read: reading every "
                     "live record")
            self._read_all()
            return
        marked: dict[str, float] = {}
        """Each marked job's highest revision its marks carry (inf: a mark without one)."""
        commits: list[tuple[str, int, int, float]] = []
        for _, fields in raw[1:]:
            job_id = keys.job_id_of(fields[b"k"].decode())
            if not job_id:
                continue  # an anchor
            rev = fields.get(b"r")
            at = float(rev) if rev is not None else math.inf
            if marked.get(job_id, -1.0) < at:
                marked[job_id] = at
            if b"seq" in fields:
                commits.append((job_id, int(fields[b"seq"]), int(fields[b"chunk"]),
                                float(fields[b"service_s"])))
        self._last_id = raw[-1][0].decode()
        gone, self._gone = self._gone, {}
        changed = [job_id for job_id, at in marked.items()
                   if self._held_rev(job_id, gone) < at]
        self.changed = len(changed)
        self._fold_commits(commits)
        if not changed:
            return
        self._built = None
        pipe = self.store.redis.pipeline(transaction=False)
        for job_id in changed:
            pipe.hgetall(keys.job(job_id))
        pipe.smismember(keys.ACTIVE, changed)
        replies = pipe.execute()
        for job_id, fields, live in zip(changed, replies[:-1], replies[-1], strict=True):
            if live and fields:
                self._put(job_id, _parsed(job_id, fields))
            else:
                self._drop(job_id)

    def _held_rev(self, job_id: str, gone: Mapping[str, int]) -> float:
        """The revision of the job's record the cache holds (-1: none; a job the tick's own
        write ended, the revision that write left)."""
        held = self._records.get(job_id)
        if held is not None:
            return held.rev
        return gone.get(job_id, -1)

    def _fold_commits(self, commits: Iterable[tuple[str, int, int, float]]) -> None:
        for job_id, seq, chunk, service_s in commits:
            known = self._commits.get(job_id)
            if known is not None:
                known[seq] = (chunk, service_s)

    def _read_all(self) -> None:
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.xadd(keys.CHANGES, {"k": ""}, maxlen=keys.CHANGES_MAXLEN, approximate=True)
        pipe.smembers(keys.ACTIVE)
        anchor, members = pipe.execute()
        self._items, self._records, self._views, self._order = {}, {}, {}, []
        self._built = None
        self._waiting_deps, self._running, self._commits, self._ended = set(), set(), {}, {}
        self._gone = {}
        for item in self.store.records(sorted(m.decode() for m in members)):
            if isinstance(item, UnreadableRecord):
                log.error("job %s: %s", item.job_id, item)
                self._items[item.job_id] = item
            else:
                self._keep(item)
        self._order = sorted(self._items)
        self._last_id = anchor.decode()
        self._read_all_at = time.monotonic()
        self.full_reads += 1
        self.changed = len(self._items)

    def _put(self, job_id: str, item: JobRecord | UnreadableRecord) -> None:
        if job_id not in self._items:
            bisect.insort(self._order, job_id)
        self._forget(job_id)
        if isinstance(item, UnreadableRecord):
            log.error("job %s: %s", item.job_id, item)
            self._items[job_id] = item
        else:
            self._keep(item)

    def _keep(self, r: JobRecord) -> None:
        job_id = r.job_id
        self._items[job_id] = self._records[job_id] = r
        self._views[job_id] = self._view(r)
        if r.depends_on and r.state is JobState.PENDING:
            self._waiting_deps.add(job_id)
        if r.state is JobState.RUNNING:
            self._running.add(job_id)

    def _forget(self, job_id: str) -> None:
        self._records.pop(job_id, None)
        self._views.pop(job_id, None)
        self._waiting_deps.discard(job_id)
        self._running.discard(job_id)

    def _drop(self, job_id: str) -> None:
        if self._items.pop(job_id, None) is not None:
            del self._order[bisect.bisect_left(self._order, job_id)]
        self._forget(job_id)
        self._commits.pop(job_id, None)

    def _view(self, r: JobRecord) -> JobView:
        return job_view(r, None, None, self._block_groups, self._learned)

    # derived facts ---------------------------------------------------------------------------
    def _failed_dependencies(self) -> dict[str, str]:
        """:func:`failed_dependencies`, from the cache: a dependency in the live set is not
        terminal; one outside it is read once (in one round trip for all) and, once ended,
        remembered."""
        waiting = [self._records[job_id] for job_id in sorted(self._waiting_deps)]
        wanted = {dep for r in waiting for dep in r.depends_on}
        unknown = sorted(dep for dep in wanted
                         if dep not in self._records and dep not in self._ended)
        states: dict[str, JobState] = {}
        if unknown:
            pipe = self.store.redis.pipeline(transaction=False)
            for dep in unknown:
                pipe.hget(keys.job(dep), "state")
            for dep, raw in zip(unknown, pipe.execute(), strict=True):
                state = JobState.FAILED if raw is None else JobState(raw.decode())
                states[dep] = state
                if raw is not None and state.is_terminal:
                    self._ended[dep] = state
        if len(self._ended) > 2 * len(wanted) + 1000:
            self._ended = {dep: s for dep, s in self._ended.items() if dep in wanted}
        reasons: dict[str, str] = {}
        for r in waiting:
            for dep in r.depends_on:
                live = self._records.get(dep)
                if live is not None:
                    state = live.state
                else:
                    state = self._ended[dep] if dep in self._ended else states[dep]
                if (reason := _dependency_failed(dep, state)) is not None:
                    reasons[r.job_id] = reason
                    break
        return reasons

    def _own(self, floor_s: float, now_s: float) -> dict[str, float | None]:
        """:func:`own_s_per_unit` of each long-running job: its commits read from its event
        stream the first time (one round trip for all such jobs), then kept from the marks."""
        running = _long_running((self._records[job_id] for job_id in self._running),
                                floor_s, now_s)
        unread = [job_id for job_id in running if job_id not in self._commits]
        if unread:
            pipe = self.store.redis.pipeline(transaction=False)
            for job_id in unread:
                pipe.xrange(keys.job_events(job_id))
            for job_id, raw in zip(unread, pipe.execute(), strict=True):
                self._commits[job_id] = _commits_of(
                    {k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw)
        return {job_id: own_median(self._records[job_id], self._commits[job_id].values())
                for job_id in running}

    def _heartbeats(self) -> dict[str, Heartbeat]:
        """The heartbeats of the workers registered as live and of those the last scan found,
        in two round trips (a scan every :attr:`heartbeat_scan_s`)."""
        redis = self.store.redis
        now = time.monotonic()
        if now - self._scanned_at >= self.heartbeat_scan_s:
            self._scanned, self._scanned_at = self.store.heartbeat_names(), now
        pipe = redis.pipeline(transaction=False)
        pipe.zrange(keys.WORKERS_LIVE, 0, -1)
        pipe.zremrangebyscore(keys.WORKERS_LIVE, "-inf", int(time.time() * 1000) - 60_000)
        registered, _ = pipe.execute()
        names = sorted({*self._scanned, *(keys.worker(n.decode()) for n in registered)})
        bodies = cast(list[bytes | None], redis.mget(names)) if names else []
        return decode_heartbeats(names, bodies)


_Built = tuple[tuple[JobView, ...], tuple[tuple[str, str], ...], dict[str, JobRecord],
               dict[str, int]]


def _parsed(job_id: str, fields: Mapping[bytes, bytes]) -> JobRecord | UnreadableRecord:
    try:
        return JobRecord.from_hash(fields)
    except UnreadableRecord as exc:
        return UnreadableRecord(job_id, exc.problem)
