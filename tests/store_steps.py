"""One job's steps through the store's production writes, for tests that drive a job by hand:
the submit path's ``create_many``, the worker's ``claim_chunks`` and its heartbeat's lease
renewal, each given one job."""

from __future__ import annotations

from typing import Any

from tasks.record import JobRecord
from tasks.spec import JobSpec
from tasks.store import JobStore, queue_lease_renewal
from tasks.store_calls import NewJob


def create_job(store: JobStore, spec: JobSpec, **fields: Any) -> tuple[str, bool]:
    """Store one new PENDING job (``fields``: those of :class:`NewJob`) as the submit path
    does: (job id, created); an idempotency key seen before returns the first job's id."""
    job_id, created, _ = store.create_many([NewJob(spec, **fields)])[0]
    return job_id, created


def claim_with_state(
    store: JobStore, job_id: str, chunk: int, epoch: int, worker: str, lease_s: float, *,
    cached_seq: int | None = -1, cached_commit: str = "",
) -> tuple[JobRecord | str, bytes | None]:
    """Claim one chunk message as the worker does (``claim_chunks``), holding the job's state
    at (``cached_seq``, ``cached_commit``) in memory: the record as claimed (or why the claim
    is stale) and the checkpoint the claim brought (None: none)."""
    claims, _, blobs = store.claim_chunks([(job_id, chunk, epoch)], worker, lease_s,
                                          cached_seqs={job_id: (cached_seq, cached_commit)})
    return claims[0], blobs.get(job_id)


def claim_chunk(store: JobStore, job_id: str, chunk: int, epoch: int, worker: str,
                lease_s: float) -> JobRecord | str:
    """:func:`claim_with_state` wanting no checkpoint: the record as claimed, or why not."""
    return claim_with_state(store, job_id, chunk, epoch, worker, lease_s, cached_seq=None)[0]


def renew_lease(store: JobStore, job_id: str, lease_s: float) -> None:
    """Renew the running job's lease as its worker's heartbeat does."""
    pipe = store.redis.pipeline(transaction=True)
    queue_lease_renewal(pipe, [job_id], lease_s)
    pipe.execute()
