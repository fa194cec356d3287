"""Submitting jobs: validate the spec against its kind, plan its chunks, store it, release it."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scheduler import (
    AdmissionStatus,
    JobKind,
    JobView,
    PolicyConfig,
    ResourceProfile,
    SubmitAction,
    SubmitDecision,
    Tier,
    decide_submit,
)
from scheduler.cost import CostModel
from scheduler.degradation import Degradation, choose_level
from scheduler.lifecycle import JobState, SloClass
from tasks import keys
from tasks.adapter import configured_policy
from tasks.admission import PublishedAdmission
from tasks.affinity import WorkerDirectory, needs_directory, release_queue
from tasks.dispatch import (
    direct_publish,
    publish_chunks,
    queue_release,
)
from tasks.errors import InvalidJob, Overloaded
from tasks.load_estimates import LearnedLoads
from tasks.quality_floor import check_floor, level_params, quality_ladder
from tasks.record import JobRecord
from tasks.script_batch import ScriptBatch
from tasks.settings import Settings
from tasks.snapshot import stored_cost_model
from tasks.spec import JobSpec, SimulatedParams
from tasks.store import JobStore
from tasks.store_calls import NewJob
from workers.diffusion.adapters import adapter_registry
from workers.errors import ParamsError, WorkerError
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


@dataclass(frozen=True, slots=True)
class Prepared:
    """One job checked and planned, not stored yet."""

    spec: JobSpec
    plan: ChunkPlan
    group: str | None
    deadline_s: float
    """Seconds from submit to its deadline."""
    degradation: Degradation | None = None
    """What admission lowered it to (None: the quality it asked for)."""


@dataclass(frozen=True, slots=True)
class Submitted:
    """What became of one job of :meth:`JobService.submit_many`: stored (``created`` False for
    an idempotency-key replay, which returns the first job's id), or shed by admission."""

    job_id: str | None
    created: bool = False
    shed: Overloaded | None = None


class JobService:
    """The one path every client (CLI, REST, Python) takes into the store."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.learned = LearnedLoads()
        """The load times this service's placements count, learned from the heartbeats its
        submits read."""

    def submit(
        self, spec: JobSpec, *, tenant: str = "default", tier: str = "standard"
    ) -> tuple[str, bool]:
        """Store and release a job as :func:`scheduler.decide_submit` decides (the simulator
        decides with the same function); returns (job id, created). Raises
        :class:`InvalidJob`, or :class:`Overloaded` when admission sheds it."""
        (outcome,) = self.submit_many([spec], tenant=tenant, tier=tier)
        if outcome.shed is not None:
            raise outcome.shed
        assert outcome.job_id is not None
        return outcome.job_id, outcome.created

    def submit_many(self, specs: Sequence[JobSpec], *, tenant: str = "default",
                    tier: str = "standard") -> list[Submitted]:
        """:meth:`submit` of each job, in a few round trips whatever their number: every job
        is checked first (one :class:`InvalidJob` naming each bad one, ``jobs[i]``, and nothing
        stored), then decided against one read of the policy and the admission status, stored
        in one pipeline, and moved and published in one more each. A job admission sheds is
        reported in its entry; the others stand."""
        policy, admission = self._policy_and_admission()
        prepared = self.prepare(specs, policy.policy.value)
        now_s = time.time()
        prepared = self._degrade_all(prepared, policy, admission, now_s)
        decisions = [self._decide(p, tier, policy, admission, now_s) for p in prepared]
        kept = [(p, d) for p, d in zip(prepared, decisions, strict=True)
                if d.action is not SubmitAction.SHED]
        stored = iter(self.store.create_many([self._new_job(p, d, tenant, tier, now_s)
                                              for p, d in kept]))
        out: list[Submitted] = []
        moves = ScriptBatch(self.store)
        # per queued move, the publish that follows it once it took effect (None: no publish)
        queued: list[tuple[JobRecord, int, int, str] | None] = []
        direct = direct_publish(self.settings)
        directory: WorkerDirectory | None = None
        for decision in decisions:
            if decision.action is SubmitAction.SHED:
                out.append(Submitted(None, shed=Overloaded(
                    decision.reason, retry_after_s=decision.retry_after_s)))
                continue
            job_id, created, record = next(stored)
            out.append(Submitted(job_id, created))
            if not created or record is None or record.state is not JobState.PENDING:
                continue  # the same job submitted again: it stands where it is
            if decision.action is SubmitAction.SUSPEND:
                moves.transition_as_seen(record, JobState.SUSPENDED, by="submit",
                                         reason=decision.reason)
                queued.append(None)
            elif decision.action is SubmitAction.RELEASE:
                if directory is None and needs_directory(self.settings, record):
                    directory = WorkerDirectory.read(
                        self.store, mark_ttl_s=self.settings.broker.chunk_lease,
                        learned=self.learned)
                queue = release_queue(self.settings, record, record.queue, directory)
                epoch, pushed = queue_release(moves, record, queue, by="submit",
                                              reason=f"admitted to {queue}", direct=direct)
                queued.append(None if pushed else (record, record.next_chunk, epoch, queue))
        publish = [item for item, moved in zip(queued, moves.execute(), strict=True)
                   if item is not None and moved]
        if publish:
            publish_chunks(self.store, publish)
        return out

    def prepare(self, specs: Sequence[JobSpec], policy: str) -> list[Prepared]:
        """Each job checked against its kind and planned under ``policy`` (the one in force);
        one :class:`InvalidJob` naming every bad one (``jobs[i]`` when there are several)."""
        out: list[Prepared] = []
        problems: list[str] = []
        for index, spec in enumerate(specs):
            try:
                out.append(self._prepare(spec, policy))
            except InvalidJob as exc:
                text = str(exc)
            except WorkerError as exc:
                text = f"invalid {spec.kind} job: {exc}"
            else:
                continue
            problems.append(text if len(specs) == 1 else f"jobs[{index}]: {text}")
        if problems:
            raise InvalidJob("; ".join(problems))
        return out

    def _prepare(self, spec: JobSpec, policy: str) -> Prepared:
        raw = dict(spec.params)
        if spec.kind == "text":  # decode chunk length adapts to the class: short for realtime
            raw.setdefault("chunk_tokens", TEXT_CHUNK_TOKENS[spec.slo])
        params = validate_params(spec.kind, raw, self.settings.diffusion.adapters_dir)
        spec = spec.model_copy(update={"params": params})
        runner = get_runner(spec.kind)
        plan = runner.plan(params)
        group = self._batch_group(spec, runner, params, plan, policy)
        for dep in spec.depends_on:
            self.store.state(dep)  # raises JobNotFound for an unknown dependency
        if spec.quality_floor is not None:
            check_floor(spec.kind, params, spec.quality_floor)  # refuses a bad floor
        target_s = self.settings.scheduler.slo_classes[spec.slo.value].target_s
        return Prepared(spec, plan, group, spec.deadline_s or target_s)

    def _degrade_all(self, prepared: list[Prepared], policy: PolicyConfig,
                     admission: AdmissionStatus | None, now_s: float) -> list[Prepared]:
        """Each job that gave a quality floor, at the level :func:`choose_level` picks under the
        last tick's load (a fresh status only: a stale one degrades nothing)."""
        if admission is None or now_s - admission.measured_at_s > policy.admission_status_ttl_s \
                or admission.load <= policy.degrade_load \
                or all(p.spec.quality_floor is None for p in prepared):
            return prepared
        cost = stored_cost_model(self.store, policy)
        return [self._degrade(p, policy, admission.load, cost) for p in prepared]

    def _degrade(self, p: Prepared, policy: PolicyConfig, load: float,
                 cost: CostModel) -> Prepared:
        floor, params = p.spec.quality_floor, dict(p.spec.params)
        if floor is None:
            return p
        ladder = quality_ladder(p.spec.kind, params, p.plan, floor, cost)
        chosen = choose_level(ladder, p.deadline_s, load, policy)
        if chosen is None:
            return p
        params = validate_params(p.spec.kind, level_params(p.spec.kind, params, floor, chosen),
                                 self.settings.diffusion.adapters_dir)
        spec = p.spec.model_copy(update={"params": params})
        runner = get_runner(spec.kind)
        plan = runner.plan(params)
        group = self._batch_group(spec, runner, params, plan, policy.policy.value)
        log.info("job degraded at submit: %s", chosen.reason)
        return dataclasses.replace(p, spec=spec, plan=plan, group=group, degradation=chosen)

    def _policy_and_admission(self) -> tuple[PolicyConfig, AdmissionStatus | None]:
        """The policy in force and the last tick's admission status, in one round trip."""
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.get(keys.POLICY)
        pipe.get(keys.ADMISSION)
        active, admission = pipe.execute()
        chosen = self.settings.scheduler.policy if active is None else active.decode()
        return (configured_policy(self.settings, chosen),
                None if admission is None else PublishedAdmission.decode(admission).status)

    def _new_job(self, p: Prepared, decision: SubmitDecision, tenant: str, tier: str,
                 now_s: float) -> NewJob:
        spec, plan = p.spec, p.plan
        return NewJob(
            spec, tenant=tenant, tier=tier, num_chunks=plan.num_chunks, cost_key=plan.cost_key,
            cost_units=tuple(plan.cost_units), deadline_s=p.deadline_s, now_s=now_s,
            queue=decision.queue, atomic=decision.atomic, chunk_names=tuple(plan.names),
            resource_profile=ResourceProfile(plan.resource_profile),
            events_ttl_s=self.settings.broker.event_retention, batch_group=p.group,
            batch_growth=spec.params.get("batch_growth") if spec.kind == "simulated" else None,
            degraded=None if p.degradation is None else json.dumps(p.degradation.as_json()),
        )

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

    def _decide(self, p: Prepared, tier: str, policy: PolicyConfig,
                admission: AdmissionStatus | None, now_s: float) -> SubmitDecision:
        """The submit decision from the job as it will be stored and the last tick's admission
        status (admitted without one)."""
        spec, plan = p.spec, p.plan
        view = JobView(
            job_id="new", tenant="-", tier=Tier(tier), slo_class=spec.slo,
            kind=JobKind(spec.kind), state=JobState.PENDING, submitted_at_s=now_s,
            deadline_s=now_s + p.deadline_s, cost_key=plan.cost_key, num_chunks=plan.num_chunks,
            next_chunk=0, remaining_cost_units=float(sum(plan.cost_units)),
            depends_on=tuple(spec.depends_on), batch_group=p.group,
        )
        return decide_submit(view, policy, admission, now_s, p.degradation)
