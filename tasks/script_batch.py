"""Script calls sent together: a pipeline of bare ``EVALSHA`` calls that reloads a script a
restarted Redis forgot, and the fenced batch of writes the tick sends in one round trip."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import redis

from scheduler.lifecycle import JobState
from tasks import keys, scripts
from tasks.record import JobRecord, encode, field_name
from tasks.store_calls import Written, flat_fields, flat_json, text

if TYPE_CHECKING:
    from tasks.store import JobStore


class ScriptPipeline:
    """A pipeline of script calls (and plain commands) in one round trip. redis-py sends a
    ``SCRIPT EXISTS`` for a pipeline's scripts before the pipeline itself — one more round trip
    each time; here scripts go as bare ``EVALSHA``, and a call the server refuses as
    ``NOSCRIPT`` (a restarted or flushed Redis: the call did not run) is sent again with its
    script loaded."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self.calls: list[tuple[Any, list[str], list[Any]] | None] = []

    def script(self, script: Any, keys_: list[str], args: list[Any]) -> None:
        self.pipe.evalsha(script.sha, len(keys_), *keys_, *args)
        self.calls.append((script, keys_, args))

    def command(self, name: str, *args: Any, **kwargs: Any) -> None:
        getattr(self.pipe, name)(*args, **kwargs)
        self.calls.append(None)

    def execute(self) -> list[Any]:
        replies = self.pipe.execute(raise_on_error=False)
        again = [i for i, reply in enumerate(replies)
                 if isinstance(reply, redis.exceptions.NoScriptError) and self.calls[i]]
        if again:
            retry = self.client.pipeline(transaction=False)
            for i in again:
                script, keys_, args = cast(tuple[Any, list[str], list[Any]], self.calls[i])
                script(keys=keys_, args=args, client=retry)  # redis-py loads it first
            for i, reply in zip(again, retry.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return list(replies)


class ScriptBatch:
    """Fenced writes of many jobs sent together, in one round trip per :meth:`execute`: each is
    the script the store's own method sends, fenced the same way, so a job that moved since
    the writer saw it is left alone; :meth:`execute` returns whether each write took effect,
    in the order queued, and adds what each wrote to :attr:`written`. For a tick's thousands
    of actions."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._pipe = ScriptPipeline(store.redis)
        self._kinds: list[tuple[str, str, Mapping[str, str], bool]] = []
        """Per write: its kind, the job, the fields it sets when it takes effect, whether it
        ends the job."""
        self.written: list[Written] = []
        """The writes that took effect so far, in order, with the revision each left."""

    def __len__(self) -> int:
        return len(self._kinds)

    def transition_as_seen(self, seen: JobRecord, target: JobState, *, by: str, reason: str,
                           expect: Mapping[str, str] | None = None,
                           updates: Mapping[str, str] | None = None,
                           push: tuple[str, str] | None = None) -> None:
        """:meth:`JobStore.transition_as_seen`, queued (an illegal move, or a job gone, is a
        refusal: False). ``push``: (queue, message) pushed with the move (a release's chunk
        message; its note on the record goes in ``updates``)."""
        fence = encode(state=seen.state, epoch=seen.epoch, seq=seen.seq)
        options = scripts.json_arg(expect={**fence, **(expect or {})},
                                   set=flat_fields(updates or {}) or None)
        job_id, now = seen.job_id, repr(time.time())
        queue, message = push if push is not None else ("", "")
        self._pipe.script(self.store._transition,
                          [keys.job(job_id), keys.job_events(job_id), keys.ACTIVE, keys.DONE,
                           keys.CHANGES, queue],
                          [target.value, now, by, reason, options, message])
        written = {**(updates or {}), "state": target.value, "updated_at": now}
        self._kinds.append(("transition", job_id, written, target.is_terminal))

    def update_as_seen(self, seen: JobRecord, **values: Any) -> None:
        """:meth:`JobStore.update_as_seen`, queued."""
        fields = encode(**values)
        self._pipe.script(self.store._update_as_seen, [keys.job(seen.job_id), keys.CHANGES],
                          [seen.state.value, str(seen.epoch), str(seen.seq), flat_json(fields)])
        self._kinds.append(("rev", seen.job_id, fields, False))

    def request_preempt(self, job_id: str, *, state: JobState, epoch: int) -> None:
        """:meth:`JobStore.request_preempt`, queued."""
        self._pipe.script(self.store._flag_preempt, [keys.job(job_id), keys.CHANGES],
                          [state.value, str(epoch)])
        self._kinds.append(("rev", job_id, encode(preempt=True), False))

    def keep_first_estimate(self, job_id: str, estimate_s: float) -> None:
        """:meth:`JobStore.keep_first_estimate`, queued (True whether or not an estimate was
        kept already)."""
        name = field_name("first_estimate_s")
        self._pipe.script(self.store._first_estimate, [keys.job(job_id), keys.CHANGES],
                          [name, repr(estimate_s)])
        self._kinds.append(("always", job_id, {name: repr(estimate_s)}, False))

    def set_fields(self, job_id: str, **values: Any) -> None:
        """:meth:`JobStore.set_fields`, queued."""
        fields = encode(**values)
        self._pipe.script(self.store._set_fields, [keys.job(job_id), keys.CHANGES],
                          [flat_json(fields)])
        self._kinds.append(("always", job_id, fields, False))

    def execute(self) -> list[bool]:
        """Send everything queued in one round trip; whether each write took effect."""
        if not self._kinds:
            return []
        out = []
        for (kind, job_id, fields, ends), reply in zip(self._kinds, self._pipe.execute(),
                                                       strict=True):
            if kind == "transition":
                moved = text(reply[0]) == "ok"
                rev = int(reply[2]) if moved else 0
            else:
                rev = int(reply)
                moved = kind == "always" or rev > 0
            if rev > 0:
                self.written.append(Written(job_id, rev, fields, ends))
            out.append(moved)
        self._pipe, self._kinds = ScriptPipeline(self.store.redis), []
        return out
