"""Stepline's Redis keyspace: every key and key builder, defined here once.

All keys start with ``sl:``. A running stack upgrades in place, so the strings below never change
(except ``sl:workers:queues``, formerly ``sl:worker:queues``, moved out of the heartbeat scan).
The Lua scripts that write them atomically are files in ``tasks/lua/`` (loaded by
``tasks.scripts``), each with a legend of the keys it takes.

Jobs
  ``sl:job:<id>``              hash    the job record (fields: ``tasks.record.JobRecord``)
  ``sl:job:<id>:events``       stream  the job's lifecycle and commit events, kept while it lives
  ``sl:job:<id>:ckpt``         string  the durable checkpoint (safetensors + JSON, never pickle)
  ``sl:jobs:active``           set     ids of jobs not yet terminal (what the tick snapshots)
  ``sl:jobs:index``            zset    every job id by submit time (listing, newest first)
  ``sl:done``                  stream  (job id, final state) of every job that ended
  ``sl:changes``               stream  a mark (``k``: the record's key) per write of a job
                                       record, for the tick to fold only what changed
  ``sl:idem:<tenant>:<key>``   string  idempotency key → the first job's id (24 h)

Batches (step-level batching)
  ``sl:batch:<id>:open``       string  set while the batch is in flight (PX: the chunk lease)
  ``sl:batch:<id>:joins``      list    jobs the tick released into the batch, taken at its next
                                       step boundary (JSON: id, chunk, epoch)

The scheduler
  ``sl:tick:lease``            string  the scheduler worker holding the tick (PX lease)
  ``sl:tick:last_holder``      string  the last scheduler that took the tick lease (no expiry)
  ``sl:tick:stats``            stream  tick durations and start times
  ``sl:policy``                string  the policy switched at run time (outranks the settings)
  ``sl:policy:state``          string  the policy's memory between ticks (JSON)
  ``sl:origin``                string  the current origin job id
  ``sl:admission``             string  the admission status the submit path reads (JSON)
  ``sl:scores``                string  the top scores of the last tick (JSON)
  ``sl:cost``                  string  the learned cost model and the last timing read (JSON)
  ``sl:timings``               stream  measured seconds per cost unit of each chunk

Workers
  ``sl:worker:<name>``         string  a worker's heartbeat (JSON, expires with its lease)
  ``sl:workers:live``          zset    worker → when its heartbeat lapses (ms since the epoch)
  ``sl:workers:queues``        hash    worker → the queues the tick last told it to consume
  ``sl:autoscale:events``      stream  the autoscaler's decisions (with reasons) and drains

MoE expert versions
  ``sl:experts:<model>``       string  the model's version record (JSON)
  ``sl:experts:<model>:step``  string  the update's current step number (while one runs)
  ``sl:experts:<model>:stats:<step>:<version>``  list  outcomes of a version in a step
  ``sl:experts:updating``      set     models with a hot update in progress

The API
  ``sl:tenant:<name>:live``    set     ids of a tenant's unfinished jobs (its queue quota)
  ``sl:tenant:<name>:bucket``  hash    a tenant's rate-limit token bucket
  ``sl:metrics:seen``          zset    finished job ids already counted by the metrics
  ``sl:metrics:finished``      hash    finished jobs per (class, state)
  ``sl:metrics:latency:<class>``  hash  latency histogram buckets of a class
"""

from __future__ import annotations

PREFIX = "sl:"

ACTIVE = PREFIX + "jobs:active"
INDEX = PREFIX + "jobs:index"
LIVE_BY_STATE = PREFIX + "jobs:live:state"
"""Unfinished jobs per ``STATE|slo`` (a hash), kept by every state change (``_events.lua``)."""
LIVE_BY_TENANT = PREFIX + "jobs:live:tenant"
"""Unfinished jobs per tenant (a hash): the queue quotas read it."""
RAN = PREFIX + "jobs:ran"
"""Jobs that held a worker in the last hour, scored by when they last left RUNNING (+inf while
running): a zset the state changes keep (``_events.lua``), read by the dashboard's timeline."""
DONE = PREFIX + "done"
"""A stream of (job id, final state): clients block on it instead of polling every job."""
CHANGES = PREFIX + "changes"
"""A mark per write of a job record (``k``: the record's key; ``r``: the record's revision after
the write, from a script; a commit's mark adds its ``seq``, ``chunk`` and ``service_s``): the
tick reads records only when marked, and only when it does not hold that revision already
(``tasks.snapshot``)."""
CHANGES_MAXLEN = 100_000
"""About how many marks the change stream keeps (``_events.lua``'s ``CHANGES_MAXLEN``): a tick
that finds its last-read mark trimmed away reads every record again."""

TICK_LEASE = PREFIX + "tick:lease"
TICK_LAST_HOLDER = PREFIX + "tick:last_holder"
TICK_STATS = PREFIX + "tick:stats"
POLICY = PREFIX + "policy"
POLICY_STATE = PREFIX + "policy:state"
FAIR_SERVICE = PREFIX + "fair:service"
"""Hash "band<TAB>tenant<TAB>tier" → measured worker-seconds (the commit script adds to it)."""
FAIR_STATE = PREFIX + "fair:state"
"""JSON of the fair-share ledger's lifts, active set and floors (the tick writes it)."""
ORIGIN = PREFIX + "origin"
ADMISSION = PREFIX + "admission"
SCORES = PREFIX + "scores"
COST = PREFIX + "cost"
TIMINGS = PREFIX + "timings"

WORKER_PREFIX = PREFIX + "worker:"
"""Heartbeat keys, one per worker; ``WORKER_PREFIX + "*"`` finds the live workers."""
WORKERS_LIVE = PREFIX + "workers:live"
"""Worker name → when its heartbeat lapses (ms): the tick reads heartbeats by name, without a
scan of the keyspace."""
PLACEMENT_VIEW = PREFIX + "placement"
"""The last tick's view for placement (JSON, expiring): per worker the seconds until the work
that stays on it ends, and the queued jobs per model; a submit places by it between ticks."""
WORKER_QUEUES = PREFIX + "workers:queues"
"""What the adapter last told each worker to consume (so consumers are not churned)."""
AUTOSCALE_EVENTS = PREFIX + "autoscale:events"
"""Every scaling decision of ``stepline up --workers MIN:MAX`` with its reason, and every drain."""

EXPERTS_PREFIX = PREFIX + "experts:"
EXPERT_UPDATES = PREFIX + "experts:updating"
"""Models with an expert hot update in progress (see ``tasks.expert_updates``)."""

METRICS_SEEN = PREFIX + "metrics:seen"
METRICS_FINISHED = PREFIX + "metrics:finished"
METRICS_LATENCY_PREFIX = PREFIX + "metrics:latency:"


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_id_of(key: str) -> str:
    """The job id in a job record's key (``sl:job:<id>``)."""
    return key.removeprefix(f"{PREFIX}job:")


def job_events(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def job_checkpoint(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:ckpt"


def batch_open(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:open"


def batch_joins(batch_id: str) -> str:
    return f"{PREFIX}batch:{batch_id}:joins"


def idempotency(tenant: str, key: str) -> str:
    return f"{PREFIX}idem:{tenant}:{key}"


def worker(name: str) -> str:
    return WORKER_PREFIX + name


PLACED_PREFIX = PREFIX + "placed:"
"""Per worker, the chunks placement gave it lately (a sorted set, expiring: member
``<seconds of work>:<nonce>``, score when): work its free time counts until the tick's snapshot
or its heartbeat does."""
STAGE_PREFIX = PREFIX + "stage:"
"""Per worker, the models the tick asks it to read into host memory ahead of their jobs (a list
of JSON requests ``{"kind", "params"}``, expiring; the worker's stager thread pops them)."""


def placed(worker_name: str) -> str:
    return PLACED_PREFIX + worker_name


def stage(worker_name: str) -> str:
    return STAGE_PREFIX + worker_name


def expert_record(model: str) -> str:
    return EXPERTS_PREFIX + model


def expert_step(model: str) -> str:
    return f"{EXPERTS_PREFIX}{model}:step"


def expert_stats_prefix(model: str) -> str:
    return f"{EXPERTS_PREFIX}{model}:stats:"


def tenant_bucket(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:bucket"


def metrics_latency(slo: str) -> str:
    return METRICS_LATENCY_PREFIX + slo
