"""The store's script calls and what they answer: the requests a writer hands the job store
(a new job, a claim, a commit), the keys and arguments of the Lua script each becomes, and the
typed outcome parsed from the script's reply."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from scheduler.lifecycle import TRANSITIONS, JobState
from scheduler.model import ResourceProfile
from tasks import keys, scripts
from tasks.record import JobRecord, encode
from tasks.spec import JobSpec

for _source, _target in ((JobState.RUNNING, JobState.DONE), (JobState.RUNNING, JobState.QUEUED),
                         (JobState.RUNNING, JobState.PREEMPTED),
                         (JobState.RUNNING, JobState.CANCELLED)):
    assert _target in TRANSITIONS[_source], "the commit script's moves must be legal"


def commit_call(request: CommitRequest) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the commit script (``tasks/lua/commit.lua``)."""
    job_id = request.job_id
    keys_ = [keys.job(job_id), keys.job_checkpoint(job_id), keys.job_events(job_id),
             keys.ACTIVE, keys.DONE, keys.TIMINGS, keys.CHANGES, keys.FAIR_SERVICE]
    args = [
        request.chunk, request.epoch, request.seq, int(request.complete),
        int(request.checkpoint is not None), request.checkpoint or b"",
        repr(request.service_s), repr(time.time()), request.worker, request.task_id,
        commit_options(request), request.commit_id,
    ]
    return keys_, args


def commit_options(request: CommitRequest) -> str:
    """The commit's optional values as the script's one JSON argument."""
    timing: dict[str, str] | None = None
    if request.timing is not None:
        device, s_per_unit = request.timing
        timing = {"device": device, "s_per_unit": repr(s_per_unit)}
        if request.timing_key:
            timing["cost_key"] = request.timing_key
    message = request.next_message
    return scripts.json_arg(
        then_continue=request.then_continue or None, artifact=request.artifact,
        timing=timing, hop_queues=dict(request.hop_queues) or None,
        yielded=request.yielded or None,
        next_message=None if message is None else
        {"task_id": message.task_id, "before": message.before, "after": message.after})


def claim_call(request: ClaimRequest, now: str) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the claim script (``tasks/lua/claim.lua``)."""
    job_id = request.job_id
    held = "" if request.cached_seq is None else request.cached_seq
    return ([keys.job(job_id), keys.job_events(job_id), keys.job_checkpoint(job_id),
             keys.CHANGES],
            [request.chunk, request.epoch, request.worker, now, request.lease_s, held,
             request.cached_commit])


def as_commit_request(request: CommitRequest | tuple[str, Mapping[str, Any]]) -> CommitRequest:
    if isinstance(request, CommitRequest):
        return request
    job_id, fields = request
    return CommitRequest(job_id, **fields)


def joiners_of(raw: Any) -> list[tuple[str, int, int]]:
    joiners = []
    for item in raw:
        job_id, chunk, epoch = json.loads(item)
        joiners.append((str(job_id), int(chunk), int(epoch)))
    return joiners


def commit_of(reply: Any, commit_id: str) -> Commit:
    """A commit script's reply; ``commit_id`` the request's, kept when the commit landed."""
    status = CommitStatus(text(reply[0]))
    if len(reply) < 4:
        return Commit(status)
    return Commit(status, seq=int(reply[1]), next_chunk=int(reply[2]), queue=text(reply[3]),
                  published=text(reply[4]) or None if len(reply) > 4 else None,
                  replaced=bytes(reply[5]) or None if len(reply) > 5 else None,
                  commit_id=commit_id)


def claimed_of(reply: Any) -> tuple[JobRecord | str, bytes | None]:
    """A claim script's reply: the record (or why the claim is stale) and any checkpoint."""
    if text(reply[0]) != "ok":
        return " ".join(text(x) for x in reply), None
    flat = reply[1]
    record = JobRecord.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))
    blob = reply[2] if len(reply) > 2 and isinstance(reply[2], bytes) else None
    return record, blob


@dataclass(frozen=True, slots=True)
class Written:
    """A write of a job record that took effect, as its writer knows it: the record's revision
    right after it (``rev``: the write's own mark carries it), the hash fields it set, and
    whether it ended the job (it left the live set). A reader that held the record at
    ``rev - 1`` holds it at ``rev`` by setting ``fields`` (``tasks.snapshot``)."""

    job_id: str
    rev: int
    fields: Mapping[str, str]
    ended: bool = False


def flat_fields(fields: Mapping[str, str]) -> list[str]:
    return [x for pair in fields.items() for x in pair]


def flat_json(fields: Mapping[str, str]) -> str:
    """Record fields as one script argument: a JSON list [field, value, ...], in order."""
    return json.dumps(flat_fields(fields), separators=(",", ":"), ensure_ascii=False)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class CommitStatus(str, Enum):
    """What a chunk commit did."""

    STALE = "stale"
    """Another delivery committed first, or the job moved on: nothing changed."""
    NEEDS_CHECKPOINT = "needs_checkpoint"
    """The job must stop here and the commit carried no durable checkpoint: send one."""
    HOP = "hop"
    """Committed; the job is QUEUED for its next chunk on ``queue``: publish it there."""
    CONTINUE = "continue"
    """Committed; an atomic job stays RUNNING and this worker runs its next chunk."""
    DONE = "done"
    """Committed the last chunk; the job is DONE."""
    PREEMPTED = "preempted"
    """Committed; a preempt flag (or a yield inside the chunk) stopped the job: PREEMPTED."""
    CANCELLED = "cancelled"
    """Committed; the client's cancel stopped the job: CANCELLED."""


@dataclass(frozen=True, slots=True)
class Commit:
    """The outcome of a chunk commit and the job's cursor after it."""

    status: CommitStatus
    seq: int = -1
    next_chunk: int = -1
    queue: str = ""
    published: str | None = None
    """The task id of the next chunk's message when the commit pushed it (a hop given a
    ``next_message``); None when the caller publishes."""
    replaced: bytes | None = None
    """The object-store reference (:mod:`tasks.checkpoint_objects`) that the commit's
    checkpoint took the place of in Redis: nothing reads its object any more. None: the
    commit wrote no checkpoint, or replaced one kept in Redis itself."""
    commit_id: str = ""
    """The id of the state the commit made (``CommitRequest.commit_id``; '' when it did not
    land): with ``seq``, what a worker keeping that state in memory holds it under."""


@dataclass(frozen=True, slots=True)
class NextMessage:
    """The broker message of a job's next chunk, its queue still open: the commit that hops the
    job pushes ``before + <queue name as a JSON string> + after`` onto the list of the queue it
    chooses (``tasks.dispatch.next_chunk_message`` builds it; the store does not know Celery)."""

    task_id: str
    before: str
    after: str

    def for_queue(self, queue: str) -> str:
        """The message as it lands on ``queue``."""
        return self.before + json.dumps(queue) + self.after


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A worker's claim of one chunk message: the message's fence (job, chunk, epoch), who
    claims it and for how long, and the sequence number and commit id of the job's state the
    worker holds in memory (-1: it holds none, so the claim brings the durable checkpoint;
    None: it wants none). The claim brings the checkpoint unless both match the record's: a
    sequence number alone is not a state's identity once a failover has lost a commit and
    its replay reached that sequence number again (:attr:`JobRecord.commit_id`)."""

    job_id: str
    chunk: int
    epoch: int
    worker: str
    lease_s: float
    cached_seq: int | None = -1
    cached_commit: str = ""


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """One chunk's commit and the job's next step (:meth:`JobStore.commit`)."""

    job_id: str
    chunk: int
    epoch: int
    seq: int
    """The sequence number the worker claimed: the commit is a compare-and-set on it."""
    complete: bool
    """The chunk ran to its end (False: it yielded inside, and the job stops here)."""
    checkpoint: bytes | None
    """The job's durable state after the chunk (or a reference to it in the object store,
    :mod:`tasks.checkpoint_objects`), or None when this commit writes none."""
    service_s: float
    """Worker time charged to the job."""
    worker: str
    task_id: str = ""
    hop_queues: Mapping[str, str] = field(default_factory=dict)
    """Class queue → where this worker sends the job's next chunk of that class (its own
    affinity queue); a class not named hops to its class queue."""
    then_continue: bool = False
    """An atomic job stays RUNNING and this worker runs its next chunk."""
    artifact: tuple[str, str] | None = None
    """(name, media type) of the last chunk's stored output."""
    timing: tuple[str, float] | None = None
    """(device, seconds per cost unit) for the cost model, learned under ``timing_key``."""
    timing_key: str = ""
    """The chunk kind's cost key (:func:`scheduler.cost.chunk_cost_key`); the job's cost key
    when empty."""
    next_message: NextMessage | None = None
    """The next chunk's message, pushed by the commit when the job hops
    (``Commit.published``), so a hop is one round trip."""
    yielded: bool = False
    """The chunk (``complete`` False) yielded for work its worker takes first, not for a flag:
    the job stays in flight and hops with the same next chunk (``checkpoint`` required)."""
    commit_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This commit's id, unique: the record keeps it as the id of the state the job is at
    (:attr:`JobRecord.commit_id`), so a worker's memory of a commit a failover lost is never
    taken for the state its replay made at the same sequence number."""

    def with_checkpoint(self, checkpoint: bytes) -> CommitRequest:
        """The same commit carrying the job's durable state (the store asked for one)."""
        return replace(self, checkpoint=checkpoint)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to store as PENDING (:meth:`JobStore.create_many`): its spec, what its plan and
    the submit decision made of it, and the submit time."""

    spec: JobSpec
    tenant: str
    tier: str
    num_chunks: int
    cost_key: str
    cost_units: tuple[float, ...]
    deadline_s: float
    """Seconds from ``now_s`` to its deadline."""
    now_s: float
    queue: str
    atomic: bool = False
    chunk_names: tuple[str, ...] = ()
    resource_profile: ResourceProfile = ResourceProfile.COMPUTE
    events_ttl_s: float | None = None
    batch_group: str | None = None
    batch_growth: float | None = None
    degraded: str | None = None
    """JSON of the degradation admission chose (None: none); its reason is the job's first
    event's."""

    def fields(self, job_id: str) -> dict[str, str]:
        """The record this job is stored as under ``job_id``."""
        spec, now_s = self.spec, self.now_s
        return encode(
            job_id=job_id, kind=spec.kind, state=JobState.PENDING, slo=spec.slo,
            tenant=self.tenant, tier=self.tier, params=spec.params, depends_on=spec.depends_on,
            submitted_at_s=now_s, deadline_at_s=now_s + self.deadline_s,
            num_chunks=self.num_chunks, next_chunk=0, seq=0, epoch=0, queue=self.queue,
            preempt=False, cancel=False, preemptions=0, service_s=0.0, cost_key=self.cost_key,
            cost_units=tuple(self.cost_units), updated_at_s=now_s, atomic=self.atomic,
            chunk_names=tuple(self.chunk_names), resource_profile=self.resource_profile,
            shed_if_late=spec.shed_if_late, events_ttl_s=self.events_ttl_s,
            batch_group=self.batch_group, batch_growth=self.batch_growth,
            degraded=self.degraded,
        )

    def create_call(self, job_id: str, fields: Mapping[str, str]) -> tuple[list[str], list[Any]]:
        """The ``create`` script's keys and arguments for this job under ``job_id``."""
        spec = self.spec
        idem = (keys.idempotency(self.tenant, spec.idempotency_key)
                if spec.idempotency_key else "")
        keys_ = [keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.INDEX, idem,
                 keys.CHANGES]
        note = "accepted" if self.degraded is None else (
            "accepted; " + json.loads(self.degraded)["reason"])
        return keys_, [job_id, repr(self.now_s), flat_json(fields), note]
