"""Following one job from a request: its record until it ends, the text a text job has generated
so far (read from each committed chunk's checkpoint header), and cancelling it when the client
that waits for it goes away."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from fastapi.concurrency import run_in_threadpool

from app.api.context import ApiContext
from scheduler.lifecycle import JobState
from tasks.checkpoint_objects import (
    CheckpointObjects,
    CheckpointReference,
    CheckpointReferenceError,
    is_reference,
)
from tasks.read_model import ReadModel
from tasks.record import JobRecord

log = logging.getLogger(__name__)

TEXT_STATE_FORMAT = "stepline.moe.text/1"
"""``workers.moe.runner.STATE_FORMAT``: a text job's checkpoint (named here to spare the API
importing the runner)."""
_META_ENTRY = "stepline"
"""``workers.checkpoint._META_KEY``: the safetensors header entry holding the JSON metadata."""
_HEAD_BYTES = 64 * 1024
"""Read at once: the 8-byte length and a header of this size cover a checkpoint of ~500
tensors; a larger header takes a second, fenced read."""


class ClientGone(Exception):
    """Raised when the client of a waiting request disconnected (its job was cancelled)."""


@dataclass(frozen=True, slots=True)
class TextSoFar:
    """What a text job's latest checkpoint says it has generated."""

    seq: int
    text: str
    generated: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Progress:
    """One observation of a followed job: its record, and its text when newly committed."""

    record: JobRecord
    text: TextSoFar | None = None

    @property
    def ended(self) -> bool:
        return self.record.state.is_terminal


async def follow(
    ctx: ApiContext,
    job_id: str,
    *,
    read_text: bool = False,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
    heartbeat_s: float | None = None,
) -> AsyncIterator[Progress]:
    """Poll the job every ``api.poll_interval`` until it ends; yield on each state change, on
    each commit whose checkpoint text is readable (with ``read_text``), at least every
    ``heartbeat_s``, and last on the end. If ``disconnected()`` turns true, cancel the job
    and raise :class:`ClientGone`."""
    last: tuple[JobState, int] | None = None
    text_seq = -1
    yielded_at = time.monotonic()
    while True:
        if disconnected is not None and await disconnected():
            await cancel_unfinished(ctx, job_id)
            raise ClientGone(f"the client of job {job_id} went away; the job was cancelled")
        record = await run_in_threadpool(ctx.reads.record, job_id)
        text = None
        if read_text and record.seq > text_seq and record.ckpt_seq == record.seq:
            text = await run_in_threadpool(read_text_so_far, ctx.reads, job_id, record.seq,
                                           CheckpointObjects(ctx.artifacts, None))
            text_seq = record.seq
        beat = heartbeat_s is not None and time.monotonic() - yielded_at >= heartbeat_s
        if text is not None or (record.state, record.seq) != last or beat or \
                record.state.is_terminal:
            last, yielded_at = (record.state, record.seq), time.monotonic()
            yield Progress(record, text)
        if record.state.is_terminal:
            return
        await asyncio.sleep(ctx.settings.api.poll_interval)


async def await_end(
    ctx: ApiContext, job_id: str, disconnected: Callable[[], Awaitable[bool]] | None = None
) -> JobRecord:
    """The job's record once it ended (see :func:`follow`)."""
    async for progress in follow(ctx, job_id, disconnected=disconnected):
        if progress.ended:
            return progress.record
    raise AssertionError("follow() ends only with an ended job")


async def cancel_unfinished(ctx: ApiContext, job_id: str) -> None:
    """Cancel the job unless it already ended (a running one stops at its next chunk); safe to
    call from a request being torn down, and never raises."""
    with anyio.CancelScope(shield=True):
        try:
            await run_in_threadpool(_cancel_unfinished, ctx, job_id)
        except Exception:
            log.warning("job %s: could not cancel it for a departed client", job_id,
                        exc_info=True)


def _cancel_unfinished(ctx: ApiContext, job_id: str) -> None:
    if not ctx.store.state(job_id).is_terminal:
        state = ctx.store.request_cancel(job_id)
        log.info("job %s: its client went away; cancel requested (%s)", job_id, state.value)


def read_text_so_far(reads: ReadModel, job_id: str, seq: int,
                     objects: CheckpointObjects | None = None) -> TextSoFar | None:
    """The generated text in the job's durable checkpoint, if that checkpoint is the one of
    commit ``seq`` and a text job's (None otherwise: none yet, a later commit replaced it, or a
    worker that does not write the text). Reads only the checkpoint's header, never its
    tensors, and the header and the checkpoint's sequence number in one transaction; a
    checkpoint in the object store (Redis holding its reference) is read from ``objects``."""
    head = reads.checkpoint_bytes(job_id, seq, 0, _HEAD_BYTES - 1)
    read = functools.partial(reads.checkpoint_bytes, job_id, seq)
    if head is not None and is_reference(head) and objects is not None:
        try:
            reference = CheckpointReference.decode(head)
        except CheckpointReferenceError as exc:
            log.warning("job %s: checkpoint reference at seq %d is unreadable: %s", job_id, seq,
                        exc)
            return None
        read = functools.partial(objects.read_range, reference)
        head = read(0, _HEAD_BYTES - 1)
    if head is None or len(head) < 8:
        return None
    size = int.from_bytes(head[:8], "little")
    header = head[8 : 8 + size] if 8 + size <= len(head) else read(8, 8 + size - 1)
    if header is None:
        return None
    try:
        meta = json.loads(json.loads(header)["__metadata__"][_META_ENTRY])
        if meta.get("format") != TEXT_STATE_FORMAT or not isinstance(meta.get("text"), str):
            return None
        return TextSoFar(seq, meta["text"], int(meta["generated"]), int(meta["prompt_tokens"]))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("job %s: checkpoint header at seq %d is unreadable: %s", job_id, seq, exc)
        return None

