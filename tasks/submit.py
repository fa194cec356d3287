"""Submitting jobs: validate the spec against its kind, plan its chunks, store it, release it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scheduler import (
    JobKind,
    JobView,
    PolicyConfig,
    ResourceProfile,
    SubmitAction,
    SubmitDecision,
    Tier,
    decide_submit,
)
from scheduler.lifecycle import JobState, SloClass
from tasks.adapter import load_admission, policy_config
from tasks.affinity import WorkerDirectory, needs_directory, release_queue
from tasks.dispatch import release
from tasks.errors import InvalidJob, Overloaded
from tasks.settings import Settings
from tasks.spec import JobSpec, SimulatedParams
from tasks.store import JobStore
from workers.diffusion.adapters import adapter_registry
from workers.errors import ParamsError
from workers.kinds import get_runner
from workers.runner import ChunkPlan

log = logging.getLogger(__name__)

TEXT_CHUNK_TOKENS = {SloClass.REALTIME: 4, SloClass.INTERACTIVE: 8, SloClass.BATCH: 32}
"""Tokens per MoE decode chunk: a realtime job yields often, a batch job hops rarely."""


def validate_params(kind: str, params: dict[str, Any],
                    adapters_dir: Path | None = None) -> dict[str, Any]:
    """The kind's own schema applied to ``params``; :class:`InvalidJob` says what to fix.
    A diffusion job's adapters must be in ``adapters_dir`` (default: configs/adapters)."""
    try:
        if kind == "simulated":
            return SimulatedParams.model_validate(params).stored()
        if kind in ("image", "video"):
            from workers.diffusion import (
                validate_params as validate_diffusion,  # deferred: loads torch
            )

            return dict(validate_diffusion(kind, params,
                                           adapters=adapter_registry(adapters_dir)))
        if kind == "text":
            from workers.moe import validate_params as validate_text  # deferred: loads torch

            return dataclasses.asdict(validate_text(params))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'params'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidJob(f"invalid {kind} params: {problems}") from exc
    except ParamsError as exc:
        raise InvalidJob(f"invalid {kind} params: {exc}") from exc
    raise InvalidJob(f"unknown job kind {kind!r}; use simulated, image, video or text")


def prepare_submits(jobs: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Validate and plan one job of each ``(kind, params)`` without submitting it: the first
    real submit of each kind then finds torch, diffusers, the recipes and the runners' planners
    already loaded (warm start of an API process)."""
    for kind, params in jobs:
        get_runner(kind).plan(validate_params(kind, params))


class JobService:
    """The one path every client (CLI, REST, Python) takes into the store."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    def submit(
        self, spec: JobSpec, *, tenant: str = "default", tier: str = "standard"
    ) -> tuple[str, bool]:
        """Store and release a job as :func:`scheduler.decide_submit` decides (the simulator
        decides with the same function); returns (job id, created). Raises
        :class:`InvalidJob`, or :class:`Overloaded` when admission sheds it."""
        raw = dict(spec.params)
        if spec.kind == "text":  # decode chunk length adapts to the class: short for realtime
            raw.setdefault("chunk_tokens", TEXT_CHUNK_TOKENS[spec.slo])
        params = validate_params(spec.kind, raw, self.settings.diffusion.adapters_dir)
        spec = spec.model_copy(update={"params": params})
        runner = get_runner(spec.kind)
        plan = runner.plan(params)
        policy = policy_config(self.settings, self.store)
        group = self._batch_group(spec, runner, params, plan, policy.policy.value)
        target_s = self.settings.scheduler.slo_classes[spec.slo.value].target_s
        for dep in spec.depends_on:
            self.store.state(dep)  # raises JobNotFound for an unknown dependency
        now_s = time.time()
        deadline_s = spec.deadline_s or target_s
        decision = self._decide(spec, tier, plan, deadline_s, group, policy, now_s)
        if decision.action is SubmitAction.SHED:
            raise Overloaded(decision.reason, retry_after_s=decision.retry_after_s)
        job_id, created = self.store.create(
            spec, tenant=tenant, tier=tier, num_chunks=plan.num_chunks, cost_key=plan.cost_key,
            cost_units=plan.cost_units, deadline_s=deadline_s, now_s=now_s,
            queue=decision.queue, atomic=decision.atomic, chunk_names=plan.names,
            resource_profile=ResourceProfile(plan.resource_profile),
            events_ttl_s=self.settings.broker.event_retention, batch_group=group,
            batch_growth=params.get("batch_growth") if spec.kind == "simulated" else None,
        )
        if not created:  # the same job submitted again: it stands where it is
            return job_id, created
        if decision.action is SubmitAction.SUSPEND:
            self.store.try_transition(job_id, JobState.SUSPENDED, by="submit",
                                      reason=decision.reason)
        elif decision.action is SubmitAction.RELEASE:
            self._release_now(job_id)
        return job_id, created

    def _batch_group(self, spec: JobSpec, runner: Any, params: dict[str, Any], plan: ChunkPlan,
                     policy: str) -> str | None:
        """The job's batch group (its first batchable chunk's key), or None when it runs alone:
        batching off, the FIFO baseline (atomic jobs), an exact job, or nothing to batch."""
        batching = self.settings.scheduler.batching
        exact = spec.exact if spec.exact is not None else (
            spec.slo is SloClass.REALTIME and batching.realtime_exact)
        key_of = getattr(runner, "batch_key", None)
        if not batching.enabled or policy == "fifo" or exact or key_of is None:
            return None
        # the key of the job's main chunks (denoise, decode), after an encode or prefill
        for index in (1, 0, 2):
            if index < plan.num_chunks and (key := key_of(params, index)) is not None:
                return str(key)
        return None

    def _decide(
        self, spec: JobSpec, tier: str, plan: ChunkPlan, deadline_s: float, group: str | None,
        policy: PolicyConfig, now_s: float,
    ) -> SubmitDecision:
        """The submit decision from the job as it will be stored and the last tick's admission
        status (admitted without one)."""
        view = JobView(
            job_id="new", tenant="-", tier=Tier(tier), slo_class=spec.slo,
            kind=JobKind(spec.kind), state=JobState.PENDING, submitted_at_s=now_s,
            deadline_s=now_s + deadline_s, cost_key=plan.cost_key, num_chunks=plan.num_chunks,
            next_chunk=0, remaining_cost_units=float(sum(plan.cost_units)),
            depends_on=tuple(spec.depends_on), batch_group=group,
        )
        return decide_submit(view, policy, load_admission(self.store), now_s)

    def _release_now(self, job_id: str) -> None:
        """Admitted work goes straight to its class queue; the tick re-plans from there."""

        job = self.store.record(job_id)
        if job.state is JobState.PENDING:
            directory = (WorkerDirectory.read(self.store,
                                              mark_ttl_s=self.settings.broker.chunk_lease)
                         if needs_directory(self.settings, job) else None)
            queue = release_queue(self.settings, job, job.queue, directory)
            release(self.store, job, queue=queue, by="submit", reason=f"admitted to {queue}")
