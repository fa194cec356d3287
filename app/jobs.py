"""Submitting jobs: validate the spec against its kind, plan its chunks, store it, release it."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pydantic import ValidationError

from app.errors import InvalidJob
from app.schemas import JobSpec, SimulatedParams
from app.settings import Settings
from app.store import JobStore
from scheduler.lifecycle import JobState, SloClass
from tasks.routing import CLASS_QUEUE, FIFO_QUEUE
from workers.errors import ParamsError
from workers.kinds import get_runner

log = logging.getLogger(__name__)

TEXT_CHUNK_TOKENS = {SloClass.REALTIME: 4, SloClass.INTERACTIVE: 8, SloClass.BATCH: 32}
"""Tokens per MoE decode chunk: a realtime job yields often, a batch job hops rarely."""


def validate_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """The kind's own schema applied to ``params``; :class:`InvalidJob` says what to fix."""
    try:
        if kind == "simulated":
            return SimulatedParams.model_validate(params).model_dump()
        if kind in ("image", "video"):
            from workers.diffusion import validate_params as validate_diffusion

            return dict(validate_diffusion(kind, params))
        if kind == "text":
            from workers.moe import validate_params as validate_text

            return dataclasses.asdict(validate_text(params))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidJob(f"invalid {kind} params: {problems}") from exc
    except ParamsError as exc:
        raise InvalidJob(f"invalid {kind} params: {exc}") from exc
    raise InvalidJob(f"unknown job kind {kind!r}; use simulated, image, video or text")


class JobService:
    """The one path every client (CLI, REST, Python) takes into the store."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    def submit(
        self, spec: JobSpec, *, tenant: str = "default", tier: str = "standard"
    ) -> tuple[str, bool]:
        """Store and release a job; returns (job id, created). Raises :class:`InvalidJob`."""
        raw = dict(spec.params)
        if spec.kind == "text":  # decode chunk length adapts to the class: short for realtime
            raw.setdefault("chunk_tokens", TEXT_CHUNK_TOKENS[spec.slo])
        params = validate_params(spec.kind, raw)
        spec = spec.model_copy(update={"params": params})
        plan = get_runner(spec.kind).plan(params)
        policy = self.store.active_policy(self.settings.scheduler.policy)
        target_s = self.settings.scheduler.slo_classes[spec.slo.value].target_s
        for dep in spec.depends_on:
            self.store.state(dep)  # raises JobNotFound for an unknown dependency
        job_id, created = self.store.create(
            spec, tenant=tenant, tier=tier, num_chunks=plan.num_chunks, cost_key=plan.cost_key,
            cost_units=plan.cost_units, deadline_s=spec.deadline_s or target_s, now_s=time.time(),
            queue=FIFO_QUEUE if policy == "fifo" else CLASS_QUEUE[spec.slo],
            extra={"atomic": "1" if policy == "fifo" else "0", "chunk_names": ",".join(plan.names)},
        )
        if created and not spec.depends_on:
            self._release_now(job_id)
        return job_id, created

    def _release_now(self, job_id: str) -> None:
        from tasks.dispatch import release

        fields = self.store.fields(job_id)
        if fields["state"] == JobState.PENDING.value:
            release(self.store, job_id, queue=fields["queue"], by="submit", reason="admitted")
