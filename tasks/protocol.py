"""The per-job chunk protocol of both task messages: claim → open attempts → run → close
attempts → one pipelined commit → hops. A chunk message is the one-member case of a batch
message; only its hop differs (the next chunk message, which the commit pushes itself)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from scheduler.batching import batch_cost_key
from scheduler.cost import chunk_cost_key
from scheduler.lifecycle import JobState
from tasks.affinity import hop_queues
from tasks.context import WorkerContext
from tasks.dispatch import (
    BatchMember,
    direct_publish,
    new_batch_id,
    next_chunk_message,
    publish_batch,
    publish_chunk,
)
from tasks.kind_hooks import KindHooks, hooks_of
from tasks.record import JobRecord, encode
from tasks.routing import class_queue_of
from tasks.store import JobStore
from tasks.store_calls import Commit, CommitRequest, CommitStatus, NextMessage
from workers.checkpoint import Checkpoint
from workers.errors import CheckpointError
from workers.runner import BatchItem, ChunkResult, JobRunner, ShouldYield

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One task message: each job's chunk and epoch (each fenced on its own), and the batch
    they run in (None: a chunk message of one job)."""

    members: tuple[BatchMember, ...]
    task_id: str = ""
    batch_id: str | None = None


@dataclass(slots=True)
class Attempt:
    """One claimed job inside the task: the chunk it runs from which state and sequence
    number, with which parameters, and what the run gave."""

    job: JobRecord
    chunk: int
    seq: int
    params: dict[str, Any]
    state: Checkpoint | None
    result: ChunkResult | None = None
    error: str | None = None
    yielded_to: str | None = None
    """The queue whose waiting work the chunk yielded to, inside (None: no such yield)."""

    @property
    def units(self) -> float:
        return self.job.cost_units[self.chunk]

    @property
    def size(self) -> int:
        """The size of the forward the chunk ran in (1: alone)."""
        return int(self.result.metrics.get("batch_size", 1)) if self.result else 1


def run_delivery(ctx: WorkerContext, delivery: Delivery) -> str:
    """Run one task message; returns what happened to each job, for logs and tests."""
    started = time.perf_counter()
    members, claims, blobs = _claim(ctx, delivery)
    ctx.profile.add("claim", started)
    outcomes: list[str] = []
    jobs: list[JobRecord] = []
    lost: list[JobRecord] = []
    for (job_id, chunk, epoch), got in zip(members, claims, strict=True):
        if isinstance(got, str):
            log.info("job %s chunk %d epoch %d (task %s): stale (%s)", job_id, chunk, epoch,
                     delivery.task_id, got)
            outcomes.append("stale")
            if (job := lost_successor(ctx.store, job_id, chunk, epoch)) is not None:
                lost.append(job)
        elif (stopped := _flag_stop(ctx, got)) is not None:
            outcomes.append(stopped)
        else:
            jobs.append(got)
    _republish(ctx, delivery, lost)
    if not jobs:  # nothing left: a batch closes (joiners that came meanwhile go on alone)
        _hop(ctx, delivery, None, {}, [])
        return ",".join(outcomes)
    # One canonical order: a batched step's numbers depend only on which jobs ran in it, so a
    # batch schedule (who ran with whom, step by step) replays to the same outputs anywhere.
    jobs.sort(key=lambda job: job.job_id)
    with ctx.running([job.job_id for job in jobs],
                     units_left=max(job.remaining_cost_units for job in jobs),
                     chunk_units=max(job.cost_units[job.next_chunk] for job in jobs)):
        outcomes += _run_attempts(ctx, delivery, jobs, blobs)
    return ",".join(outcomes)


def _claim(ctx: WorkerContext, delivery: Delivery
           ) -> tuple[list[BatchMember], list[JobRecord | str], dict[str, bytes]]:
    """Fence every member, each with its durable checkpoint unless this worker holds its state;
    a batch also takes the jobs the tick released into it since its last step (they run in this
    one). Returns the members with their claims (a record, or why it is stale) and the
    checkpoints by job id."""
    store, lease_s = ctx.store, ctx.settings.broker.chunk_lease
    members = list(delivery.members)
    claims, joiners, blobs = store.claim_chunks(members, ctx.name, lease_s,
                                                take_joiners_of=delivery.batch_id,
                                                cached_seqs=_held(ctx, members))
    named = {job_id for job_id, _, _ in members}
    joiners = [m for m in joiners if m[0] not in named]
    if joiners:
        more, _, more_blobs = store.claim_chunks(joiners, ctx.name, lease_s,
                                                 cached_seqs=_held(ctx, joiners))
        claims += more
        blobs.update(more_blobs)
    return [*members, *joiners], claims, blobs


def _held(ctx: WorkerContext, members: Sequence[BatchMember]) -> dict[str, tuple[int, str]]:
    """The sequence number and commit id of each member's state this worker holds in
    memory."""
    return {job_id: held for job_id, _, _ in members
            if (held := ctx.cache.held(job_id)) is not None}


def _flag_stop(ctx: WorkerContext, job: JobRecord) -> str | None:
    """A claimed job with a flag raised stops here, having run nothing."""
    if job.cancel:
        outcome = stop_attempt(ctx.store, job, JobState.CANCELLED, ctx.name,
                               "cancelled by client")
        _forget_if_ended(ctx, job.job_id)
        return outcome
    if job.preempt:
        return stop_attempt(ctx.store, job, JobState.PREEMPTED, ctx.name, "preempt flag")
    return None


def _run_attempts(ctx: WorkerContext, delivery: Delivery, jobs: list[JobRecord],
                  blobs: dict[str, bytes]) -> list[str]:
    """Open, run, close and commit the jobs' attempts (an atomic job's go on under the same
    claim), then hop the jobs that move on."""
    kind = jobs[0].kind
    runner, hooks = ctx.runner(kind.value), hooks_of(ctx, kind)
    loading = time.perf_counter()
    opened = [_open(ctx, runner, hooks, job, blobs.get(job.job_id)) for job in jobs]
    ctx.profile.add("load_state", loading)
    outcomes = [o for o in opened if isinstance(o, str)]
    attempts = [a for a in opened if isinstance(a, Attempt)]
    hops: dict[str, list[BatchMember]] = {}
    joiners: list[BatchMember] = []
    while attempts:
        poll = _should_yield(ctx, delivery, attempts)
        waited = ctx.load_wait_s()
        # the step's work: a model load it waited for is the load's, not the work's (the cost
        # model's sample, the job's service; the planner adds expected loads on their own)
        elapsed_s = max(_run_step(runner, attempts, poll) - (ctx.load_wait_s() - waited), 0.0)
        if isinstance(poll, YieldPoll):
            poll.mark(attempts)
        ran = _close(ctx, hooks, attempts, outcomes)
        commits, joined = _commit(ctx, delivery, hooks, ran, elapsed_s)
        joiners += joined
        attempts = []
        for attempt, commit in zip(ran, commits, strict=True):
            if commit.status is CommitStatus.CONTINUE:
                ctx.chunks_run += 1
                attempts.append(_next_attempt(attempt, commit))
            else:
                outcomes.append(_settle(ctx, attempt, commit, hops))
    _hop(ctx, delivery, jobs[0], hops, joiners)
    return outcomes


def _open(ctx: WorkerContext, runner: JobRunner, hooks: KindHooks, job: JobRecord,
          blob: bytes | None) -> Attempt | str:
    """The job's attempt: its state (``blob``: its durable checkpoint, when the claim brought
    it) and parameters as its kind prepares them. A job that cannot be opened fails alone
    (its kind counts a failed preparation as the chunk's outcome)."""
    params = dict(job.params)
    try:
        state = load_state(ctx, job, runner, params, blob)
    except redis.RedisError:
        raise  # the store went away, not the job: leave it RUNNING for the lease watchdog
    except Exception as exc:
        log.exception("job %s: could not load its state for chunk %d", job.job_id,
                      job.next_chunk)
        return _fail(ctx, job, job.seq, f"chunk {job.next_chunk}: {exc}")
    try:
        params = hooks.prepare(job, params, state)
    except redis.RedisError:
        raise
    except Exception as exc:
        log.exception("job %s: could not prepare chunk %d", job.job_id, job.next_chunk)
        hooks.outcome(job, job.next_chunk, params, None)
        return _fail(ctx, job, job.seq, f"chunk {job.next_chunk}: {exc}")
    return Attempt(job, job.next_chunk, job.seq, params, state)


def _should_yield(ctx: WorkerContext, delivery: Delivery,
                  attempts: list[Attempt]) -> ShouldYield:
    """A chunk message's lone chunk may stop at a block-group boundary for a flag, or for work
    its worker takes first (:class:`YieldPoll`); a batched chunk always runs to its end (a
    batch yields between steps)."""
    if delivery.batch_id is None and len(attempts) == 1:
        job = attempts[0].job
        ahead = queues_ahead(ctx.consuming(), job.queue) \
            if ctx.settings.scheduler.yield_to_waiting and not job.atomic else ()
        return YieldPoll(ctx, job.job_id, ahead)
    return _never


def _never() -> bool:
    return False


def _run_step(runner: JobRunner, attempts: list[Attempt], should_yield: ShouldYield) -> float:
    """Every attempt's chunk, batched where the runner can; if the batched run fails, each
    runs alone, so one bad job fails alone. Returns the seconds it took."""
    started = time.monotonic()
    if not _run_batched(runner, attempts):
        for attempt in attempts:
            _run_alone(runner, attempt, should_yield)
    return time.monotonic() - started


def _run_batched(runner: JobRunner, attempts: list[Attempt]) -> bool:
    run_batch: Callable[[list[BatchItem]], list[ChunkResult]] | None = getattr(
        runner, "run_batch", None)
    if run_batch is None or len(attempts) < 2:
        return False
    items = [BatchItem(a.params, a.chunk, a.state) for a in attempts]
    try:
        for attempt, result in zip(attempts, run_batch(items), strict=True):
            attempt.result = result
        return True
    except redis.RedisError:
        raise
    except Exception:
        log.warning("batched step of %s failed; running each job alone",
                    ",".join(a.job.job_id for a in attempts), exc_info=True)
        return False


def _run_alone(runner: JobRunner, attempt: Attempt, should_yield: ShouldYield) -> None:
    try:
        attempt.result = runner.run_chunk(attempt.params, attempt.chunk, attempt.state,
                                          should_yield)
        attempt.result.metrics.setdefault("batch_size", 1)
    except redis.RedisError:
        raise  # the store went away, not the job: leave it RUNNING for the lease watchdog
    except Exception as exc:
        log.exception("job %s chunk %d failed", attempt.job.job_id, attempt.chunk)
        attempt.error = f"chunk {attempt.chunk}: {exc}"


def _close(ctx: WorkerContext, hooks: KindHooks, attempts: list[Attempt],
           outcomes: list[str]) -> list[Attempt]:
    """Record each chunk's outcome and fail the jobs whose chunk failed; returns the ones
    that ran, to commit."""
    ran = []
    for attempt in attempts:
        hooks.outcome(attempt.job, attempt.chunk, attempt.params, attempt.result)
        if attempt.result is None:
            outcomes.append(_fail(ctx, attempt.job, attempt.seq,
                                  attempt.error or f"chunk {attempt.chunk}: no result"))
        else:
            ran.append(attempt)
    return ran


def _fail(ctx: WorkerContext, job: JobRecord, seq: int, reason: str) -> str:
    outcome = stop_attempt(ctx.store, job, JobState.FAILED, ctx.name, reason[:500], seq=seq)
    _forget_if_ended(ctx, job.job_id)
    return outcome


def _forget_if_ended(ctx: WorkerContext, job_id: str) -> None:
    """Remove an ended job's checkpoint objects (a job that moved on instead keeps them)."""
    if not ctx.checkpoint_objects.enabled:
        return
    try:
        ended = ctx.store.state(job_id).is_terminal
    except Exception:
        log.warning("job %s: could not read its state; its checkpoint objects are left to the "
                    "sweep", job_id, exc_info=True)
        return
    if ended:
        ctx.checkpoint_objects.forget_job(job_id)


def _commit(ctx: WorkerContext, delivery: Delivery, hooks: KindHooks, ran: list[Attempt],
            elapsed_s: float) -> tuple[list[Commit], list[BatchMember]]:
    """Every job's commit (each its own compare-and-set) in one round trip, with a batch's
    joiners; each job is charged its share of the step by cost units. A job the store stops
    here without a durable checkpoint commits again with one. Returns the commits and the
    joiners."""
    if not ran:
        return [], []
    total_units = sum(a.units for a in ran) or 1.0
    requests = [commit_request(ctx, hooks, a, elapsed_s * a.units / total_units, delivery)
                for a in ran]
    committing = time.perf_counter()
    commits, joiners = ctx.store.commit_chunks(
        requests, take_joiners_of=delivery.batch_id, lease_s=ctx.settings.broker.chunk_lease,
        timing=_batch_timing(ctx, ran, elapsed_s))
    ctx.profile.add("commit", committing)
    settled = []
    for attempt, request, commit in zip(ran, requests, commits, strict=True):
        if commit.status is CommitStatus.NEEDS_CHECKPOINT:
            request, commit = _with_checkpoint(ctx, attempt, request)
        _tidy_objects(ctx, request, commit)
        settled.append(commit)
    return settled, joiners


def _with_checkpoint(ctx: WorkerContext, attempt: Attempt, request: CommitRequest
                     ) -> tuple[CommitRequest, Commit]:
    """The commit again, carrying the durable checkpoint the store asked for."""
    if request.checkpoint is not None:
        raise AssertionError("a commit with a checkpoint never asks for one")
    request = request.with_checkpoint(_durable(ctx, attempt))
    committing = time.perf_counter()
    commit = ctx.store.commit(request)
    ctx.profile.add("commit", committing)
    return request, commit


def _tidy_objects(ctx: WorkerContext, request: CommitRequest, commit: Commit) -> None:
    """Remove the checkpoint objects nobody reads after this commit: the one it wrote if it
    came back stale, the one it replaced if it landed, every one of the job's if it ended."""
    objects = ctx.checkpoint_objects
    if commit.status is CommitStatus.STALE:
        objects.forget([request.checkpoint])
    elif commit.status in (CommitStatus.DONE, CommitStatus.CANCELLED):
        objects.forget_job(request.job_id)
    else:
        objects.forget([commit.replaced])


def commit_request(ctx: WorkerContext, hooks: KindHooks, attempt: Attempt, service_s: float,
                   delivery: Delivery) -> CommitRequest:
    """The attempt's commit (:meth:`JobStore.commit`): the artifact stored, the
    durable checkpoint every ``checkpoint_every`` chunks of the kind (the store asks for one
    when the job stops here); what the cost model learns unless the chunk ran batched (the
    batched step's key learns then); the next chunk's message when the commit may hop the
    job and push it (:func:`pushes_next_message`)."""
    job, chunk, result = attempt.job, attempt.chunk, attempt.result
    assert result is not None
    last = result.complete and chunk + 1 == job.num_chunks
    every = hooks.checkpoint_every
    durable = not result.complete or (not last and (chunk + 1) % every == 0)
    artifact = None
    if last and result.artifact is not None:  # stored first: the commit that ends the job names it
        artifact = (ctx.artifacts.put(job.job_id, result.artifact), result.artifact.media_type)
    timing = (ctx.settings.device, service_s / max(attempt.units, 1e-9)) \
        if result.complete and attempt.size == 1 else None
    yielded = attempt.yielded_to is not None and not result.complete
    pushes = delivery.batch_id is None and (result.complete or yielded) and not last \
        and pushes_next_message(ctx, job)
    follows = chunk + 1 if result.complete else chunk  # a yielded chunk resumes where it stopped
    return CommitRequest(
        job.job_id, chunk=chunk, epoch=job.epoch, seq=attempt.seq, complete=result.complete,
        checkpoint=_durable(ctx, attempt) if durable else None,
        service_s=service_s, worker=ctx.name, task_id=delivery.task_id,
        hop_queues=hop_queues(ctx.settings, ctx.name, ctx.consuming(), job.kind.value,
                              job.params),
        then_continue=job.atomic, artifact=artifact, timing=timing,
        timing_key=chunk_cost_key(job.cost_key, job.chunk_name),
        next_message=_next_message(ctx, job, follows) if pushes else None, yielded=yielded,
    )


def pushes_next_message(ctx: WorkerContext, job: JobRecord) -> bool:
    """Whether the commit of ``job``'s chunk pushes its next chunk's message itself
    (:func:`~tasks.dispatch.direct_publish`): a job on the chunk task that hops (not an atomic
    one, not a batchable one, whose hops are batch messages)."""
    return direct_publish(ctx.settings) and not job.atomic and job.batch_group is None


def _next_message(ctx: WorkerContext, job: JobRecord, chunk: int) -> NextMessage:
    building = time.perf_counter()
    message = next_chunk_message(job, chunk, job.epoch)
    ctx.profile.add("message", building)
    return message


def _durable(ctx: WorkerContext, attempt: Attempt) -> bytes:
    """The attempt's checkpoint as its commit writes it in Redis: the encoded state, or, above
    the offload threshold, a reference to it, written first to the object store under the
    sequence number the commit gives the job."""
    assert attempt.result is not None
    encoding = time.perf_counter()
    blob = attempt.result.state.encode()
    offloading = ctx.profile.add("encode", encoding)
    reference = ctx.checkpoint_objects.offload(attempt.job.job_id, attempt.seq + 1, blob)
    if reference is None:
        return blob
    ctx.profile.add("offload", offloading)
    return reference.encode()


def _batch_timing(ctx: WorkerContext, ran: list[Attempt],
                  elapsed_s: float) -> tuple[str, str, float] | None:
    """The cost model's sample of a batched step — (its key, the device, seconds per cost
    unit of one member) — when the whole task was one forward of every member of one chunk
    kind (the steady state of a batch); the lone chunk kind's key is measured by lone steps
    only, so the two give the growth (``scheduler.batching.learned_growth``)."""
    if len(ran) < 2 or any(a.size != len(ran) or not a.result or not a.result.complete
                           for a in ran):
        return None
    kinds = {chunk_cost_key(a.job.cost_key, a.job.chunk_name) for a in ran}
    units = {a.units for a in ran}
    if len(kinds) != 1 or len(units) != 1 or min(units) <= 0:
        return None
    return (batch_cost_key(kinds.pop(), len(ran)), ctx.settings.device,
            elapsed_s / units.pop())


def _next_attempt(attempt: Attempt, commit: Commit) -> Attempt:
    """An atomic job's next chunk under the same claim, from the state it just committed."""
    assert attempt.result is not None
    return Attempt(attempt.job, commit.next_chunk, commit.seq, attempt.params,
                   attempt.result.state)


def _settle(ctx: WorkerContext, attempt: Attempt, commit: Commit,
            hops: dict[str, list[BatchMember]]) -> str:
    """Keep or drop the job's state after its commit, and note its hop if the commit did not
    push its next message itself; returns what the commit did."""
    job = attempt.job
    if commit.status is CommitStatus.STALE:
        log.warning("job %s chunk %d: another delivery committed it first", job.job_id,
                    attempt.chunk)
        return "duplicate"
    ctx.chunks_run += 1
    if commit.status is CommitStatus.HOP:
        assert attempt.result is not None
        ctx.cache.put(job.job_id, commit.seq, commit.commit_id, attempt.result.state)
        if commit.published is None:
            hops.setdefault(commit.queue, []).append((job.job_id, commit.next_chunk, job.epoch))
    else:
        ctx.cache.drop(job.job_id)  # done, or stopped: another worker may resume it
    return commit.status.value


def _hop(ctx: WorkerContext, delivery: Delivery, lead: JobRecord | None,
         hops: dict[str, list[BatchMember]], joiners: list[BatchMember]) -> None:
    """A chunk message's job hops as a chunk message; a batch goes on as one batch message per
    queue (the largest keeps its id), with the jobs the tick released into it meanwhile
    (``joiners``, taken with the commits); with no job left it closes, and its joiners go out
    as a batch of their own."""
    store, lease_s = ctx.store, ctx.settings.broker.chunk_lease
    if delivery.batch_id is None:
        for queue, group in hops.items():
            for _, chunk, epoch in group:
                assert lead is not None
                publish_chunk(store, lead, chunk=chunk, epoch=epoch, queue=queue,
                              profile=ctx.profile)
        return
    if not hops:
        joiners = [*joiners, *store.take_joiners(delivery.batch_id, keep=False, lease_s=lease_s)]
        if joiners:  # the batch ended as they joined: they go on together, on their queue
            first = store.record(joiners[0][0])
            publish_batch(store, new_batch_id(first.job_id), first, joiners, queue=first.queue,
                          lease_s=lease_s)
        return
    assert lead is not None
    ordered = sorted(hops.items(), key=lambda item: -len(item[1]))
    for n, (queue, group) in enumerate(ordered):
        if n == 0:
            hopping = {job_id for job_id, _, _ in group}
            group = [*group, *(j for j in joiners if j[0] not in hopping)]
            publish_batch(store, delivery.batch_id, lead, group, queue=queue,
                          profile=ctx.profile, lease_s=lease_s, mark_open=False)
        else:
            publish_batch(store, new_batch_id(group[0][0]), lead, group, queue=queue,
                          lease_s=lease_s)


def _republish(ctx: WorkerContext, delivery: Delivery, lost: list[JobRecord]) -> None:
    """Publish the successors a worker committed but died before publishing: a chunk
    message's job alone, a batch's together per queue (the batch goes on together)."""
    store, lease_s = ctx.store, ctx.settings.broker.chunk_lease
    if delivery.batch_id is None:
        for job in lost:
            publish_chunk(store, job, chunk=job.next_chunk, epoch=job.epoch, queue=job.queue)
        return
    by_queue: dict[str, list[JobRecord]] = {}
    for job in lost:
        by_queue.setdefault(job.queue, []).append(job)
    for queue, jobs in by_queue.items():
        publish_batch(store, new_batch_id(jobs[0].job_id), jobs[0],
                      [(job.job_id, job.next_chunk, job.epoch) for job in jobs], queue=queue,
                      lease_s=lease_s)


def queues_ahead(consuming: Sequence[str], job_queue: str) -> tuple[str, ...]:
    """The queues this worker takes before the job's next chunk: those it consumes ahead of the
    job's class queue and of its own affinity queue for that class (strict priority order).
    A job whose class the worker does not consume (a reserved worker's lent chunk) yields to
    none: the tick's flags stay in charge of it."""
    cls = class_queue_of(job_queue)
    ahead: list[str] = []
    for queue in consuming:
        if class_queue_of(queue) == cls:
            return tuple(ahead)
        ahead.append(queue)
    return ()


YIELD_GRACE_S = 0.003
"""How long waiting work must stay queued before a chunk yields to it: a worker idle in its
blocking pop takes a new message well within it, so a chunk does not yield for work another
worker is already taking."""


class YieldPoll:
    """The runner's ``should_yield`` between block groups of a lone chunk, asked of Redis at
    most once per fifth of the preemption timeout (short steps — most of a small job's hops —
    skip the round trip): a preempt or cancel flag (the tick's, the client's, a drain's) stops
    the job; otherwise, when a queue this worker takes first (``ahead``: more urgent classes)
    still holds work after :data:`YIELD_GRACE_S`, the chunk yields at this boundary and its job
    hops back to its own queue, still in flight, to resume from this block group — so urgent
    work that lands behind a running chunk waits one block group, not for a tick to flag it.

    Which jobs are in flight stays the scheduler's decision (it releases, requeues, trims and
    flags); the worker only orders the chunks already in flight, by the queue priority the
    scheduler gave it."""

    def __init__(self, ctx: WorkerContext, job_id: str, ahead: Sequence[str]) -> None:
        self.ctx, self.job_id, self.ahead = ctx, job_id, tuple(ahead)
        self.gap_s = ctx.settings.scheduler.preemption_timeout / 5
        self.last_s = -math.inf  # the first boundary always asks
        self.yielded_to: str | None = None

    def __call__(self) -> bool:
        now_s = time.monotonic()
        if now_s - self.last_s < self.gap_s:
            return False
        self.last_s = now_s
        flagged, waiting = self._ask()
        if flagged:
            self.yielded_to = None
            return True
        if waiting is not None:
            time.sleep(YIELD_GRACE_S)
            flagged, waiting = self._ask()
            self.yielded_to = None if flagged else waiting
            return flagged or waiting is not None
        return False

    def _ask(self) -> tuple[bool, str | None]:
        """(a flag is raised, the first queue ahead that holds work), in one round trip."""
        return self.ctx.store.chunk_signals(self.job_id, self.ahead)

    def mark(self, attempts: Sequence[Attempt]) -> None:
        """Name, on the lone attempt that stopped inside its chunk, the work it yielded to."""
        for attempt in attempts:
            if attempt.result is not None and not attempt.result.complete:
                attempt.yielded_to = self.yielded_to


def load_state(
    ctx: WorkerContext, job: JobRecord, runner: JobRunner, params: dict[str, Any],
    blob: bytes | None = None,
) -> Checkpoint | None:
    """The job's state at ``job.seq``: from this worker's memory (only the very state its
    record names, by sequence number and commit id: the state of a commit a failover lost may
    sit there under the same sequence number), else the durable checkpoint (``blob`` when the
    claim brought it, else read from Redis; fetched from the object store and checked when
    Redis holds a reference), replayed up to ``job.seq``."""
    if job.seq == 0:
        return None
    cached = ctx.cache.get(job.job_id, job.seq, job.commit_id)
    if cached is not None:
        return cached
    if blob is None:
        blob = ctx.store.load_checkpoint(job.job_id)
    if blob is None or job.ckpt_seq is None:
        raise CheckpointError(f"job {job.job_id}: no durable checkpoint at seq {job.seq}")
    state = Checkpoint.decode(ctx.checkpoint_objects.resolve(job.job_id, blob))
    # The durable copy may be a few steps behind (checkpoint_every > 1): replay them here.
    for index in range(job.ckpt_chunk or 0, job.next_chunk):
        log.info("job %s: replaying chunk %d from the durable checkpoint", job.job_id, index)
        state = runner.run_chunk(params, index, state, _never).state
    return state


def stop_attempt(store: JobStore, job: JobRecord, target: JobState, worker: str,
                 reason: str, seq: int | None = None) -> str:
    """End or pause the claimed attempt without a commit (a flag seen at claim, or a failure),
    only if nothing moved since the claim — nor since the attempt's last commit at ``seq``
    (an atomic job's; default: the claimed sequence number)."""
    updates = encode(error=reason) if target is JobState.FAILED else {}
    if target is JobState.PREEMPTED:
        updates = encode(preempt=False, preemptions=job.preemptions + 1,
                         preempted_at_s=time.time())
    store.try_transition(job.job_id, target, by=worker, reason=reason,
                         expect=encode(state=JobState.RUNNING, epoch=job.epoch,
                                       seq=job.seq if seq is None else seq),
                         updates=updates)
    return target.value.lower()


def lost_successor(store: JobStore, job_id: str, chunk: int, epoch: int) -> JobRecord | None:
    """The job, if ``chunk`` committed but the message of its next chunk was never published;
    None otherwise (or if the record cannot be read)."""
    try:
        job = store.record(job_id)
    except Exception:
        return None
    nxt = job.next_chunk
    if (job.state is JobState.QUEUED and job.epoch == epoch and nxt == chunk + 1
            and (job.published if job.published is not None else -1) < nxt):
        log.warning("job %s: chunk %d was never published; publishing it now", job_id, nxt)
        return job
    return None
