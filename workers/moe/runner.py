"""The text-job runner: a ``prefill`` chunk, then ``decode[i]`` chunks of ``chunk_tokens``
tokens; KV cache, generated ids, sampler RNG and routing metrics travel in the checkpoint.

Greedy output with ``routing: native`` is token-identical to ``model.generate()``, also when
every chunk runs on a fresh worker. Prefills, and decode chunks, of native-routed jobs on one
model and expert version can also run batched (:meth:`TextRunner.run_batch`): one forward per
step for all, each job's checkpoint exactly as its lone chunk would write it.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from workers.checkpoint import Checkpoint
from workers.errors import CheckpointError, NonFiniteOutput, ParamsError
from workers.moe.batching import (
    PaddedKV,
    PaddedPrompts,
    has_linear_attention,
    has_sliding_window,
)
from workers.moe.expert_cache import CacheConfig
from workers.moe.generation import (
    generator_from_state,
    kv_from_tensors,
    kv_to_tensors,
    new_generator,
    sample_next,
)
from workers.moe.params import TextParams, validate_params
from workers.moe.recipes import MODELS_DIR, build_model, load_recipe
from workers.moe.router import RouterConfig, RoutingTally
from workers.moe.session import ModelSession, moe_resident, open_session
from workers.moe.tokenizer import encode_prompt
from workers.moe.versioned import BASE_VERSION
from workers.residency import ModelResidency, process_residency
from workers.runner import Artifact, BatchItem, ChunkPlan, ChunkResult, ShouldYield

log = logging.getLogger(__name__)

STATE_FORMAT = "stepline.moe.text/1"
# Relative costs in "decode tokens": a prefill token is batched, so far cheaper than one.
_PREFILL_COST_PER_TOKEN = 0.125
_CHARS_PER_TOKEN = 4
_RUNNER_IDS = itertools.count(1)


@dataclass(slots=True)
class _Job:
    """One job's live generation state between checkpoint decode and encode."""

    ids: list[int]
    prompt_tokens: int
    kv: DynamicCache
    rng: torch.Generator
    router: RouterConfig
    routing: RoutingTally
    version: str = BASE_VERSION
    finished: bool = False
    latency_ms: float = 0.0
    cache_stats: dict[str, float] = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_tokens


@dataclass(slots=True)
class _Row:
    """One member of a batched decode: its job, and the new-token count that ends its chunk."""

    params: TextParams
    job: _Job
    target: int
    generated_before: int
    left_s: float | None = None
    """When the row left the batch (``time.perf_counter()``); None while it decodes."""

    @property
    def done(self) -> bool:
        return self.job.finished or self.job.generated >= self.target


class TextRunner:
    """Runs text jobs on MoE models; keep one per worker process (it holds loaded models)."""

    kind = "text"

    def __init__(
        self,
        router: RouterConfig | None = None,
        cache: CacheConfig | None = None,
        device: str = "cpu",
        clock_s: Callable[[], float] = time.monotonic,
        residency: ModelResidency | None = None,
    ) -> None:
        self.router = router or RouterConfig()
        self.cache_config = cache or CacheConfig()
        self.device = device
        self._clock_s = clock_s
        self._pads: dict[str, bool] = {}
        self.models = residency or process_residency()
        self._prefix = f"text:{next(_RUNNER_IDS)}:"
        """This runner's models in the residency are ``text:<n>:<model>``: runners of other
        router and cache configurations hold their own sessions."""
        weakref.finalize(self, self.models.forget, self._prefix)

    def plan(self, params: Mapping[str, Any]) -> ChunkPlan:
        """``prefill`` then ``decode[i]``; costs in decode-token units."""
        p = validate_params(params)
        est_tokens = max(1, math.ceil(len(p.prompt) / _CHARS_PER_TOKEN))
        names = ["prefill"] + [f"decode[{i}]" for i in range(p.num_decode_chunks)]
        costs = [1.0 + est_tokens * _PREFILL_COST_PER_TOKEN]
        for i in range(1, p.num_decode_chunks + 1):
            costs.append(float(p.tokens_after_chunk(i) - p.tokens_after_chunk(i - 1)))
        bucket = max(16, 1 << (est_tokens - 1).bit_length())
        return ChunkPlan(tuple(names), tuple(costs), cost_key=f"{p.model}:p{bucket}",
                         resource_profile="memory")

    def session(self, model: str) -> ModelSession:
        """The worker's session for ``model``, held by the model residency: built (and warmed
        up) on first use, and again after an eviction."""
        return self.models.acquire(self._prefix + model, lambda: self._open(model),
                                      moe_resident(self.device))

    def _open(self, model: str) -> ModelSession:
        loaded = build_model(load_recipe(model, MODELS_DIR))
        session = open_session(loaded, self.cache_config, self.device)
        session.cache.tick(self._clock_s())
        session.calibrate_and_warm_up()
        return session

    def residency(self, hot_experts: int = 16) -> dict[str, dict[str, object]]:
        """Per loaded model, what its expert cache holds (for the worker's heartbeat)."""
        return {name: session.cache.residency_summary(hot_experts)
                for name, session in self.loaded_sessions().items()}

    def tick(self, now_s: float) -> int:
        """Idle-unload experts of every loaded model (``now_s`` on this runner's clock); the
        worker's heartbeat thread calls it between chunks (``workers.moe.unload_idle``), so
        experts unload on a worker that gets no text work. Returns how many were unloaded."""
        return sum(session.experts.tick(now_s) for session in self.loaded_sessions().values())

    def loaded_sessions(self) -> dict[str, ModelSession]:
        """The models this runner holds now (device or host tier), by name."""
        held = self.models.holding(self._prefix)
        return {key[len(self._prefix):]: session for key, session in held.items()}

    def run_chunk(
        self,
        params: Mapping[str, Any],
        index: int,
        state: Checkpoint | None,
        should_yield: ShouldYield,
    ) -> ChunkResult:
        """Run chunk ``index``: the prefill (index 0) or up to ``chunk_tokens`` decode steps."""
        p = validate_params(params)
        if index < 0 or index > p.num_decode_chunks:
            raise ParamsError(f"chunk {index} is outside this job's 0..{p.num_decode_chunks}")
        session = self.session(p.model)
        version = _version_of(p, state, session)
        session.experts.use(version)
        started_s = time.perf_counter()
        session.cache.tick(self._clock_s())
        before = session.cache.counters.as_dict()
        job = self._start(p, session) if state is None else self._restore(p, session, state)
        generated_before = 0 if state is None else int(state.meta["generated"])
        self._decode_until(p, session, job, p.tokens_after_chunk(index), should_yield)
        produced = job.generated - generated_before
        complete = job.finished or job.generated >= p.tokens_after_chunk(index)
        after = session.cache.counters.as_dict()
        job.cache_stats = {k: job.cache_stats.get(k, 0) + after[k] - before[k] for k in after}
        chunk_ms = (time.perf_counter() - started_s) * 1000.0
        job.latency_ms += chunk_ms
        job.routing = session.context.totals()
        return _finish(p, session, job, produced, chunk_ms, complete)

    def batch_key(self, params: Mapping[str, Any], index: int) -> str | None:
        """Decode chunks of natively routed jobs on one model share a key, and their prefills
        another (a prefill's forward is a whole prompt, a decode step's one token). Configured
        routing runs alone: its capacity, noise and diversity penalty act on a forward's tokens
        together and on the job's own usage."""
        return _batch_key(validate_params(params), index)

    def run_batch(self, items: Sequence[BatchItem]) -> list[ChunkResult]:
        """Run each item's chunk; items with equal :meth:`batch_key` and expert version run
        together: prefills as one forward of their left-padded prompts, decode chunks as one
        forward of one token per job each step. One result per item, in order;
        the same items in the same order give the same tokens. A prefill whose prompt does not
        fit the model raises its :class:`ParamsError` before any forward runs (the task layer
        then runs each member alone, so that job fails alone)."""
        params = [validate_params(item.params) for item in items]
        groups: dict[tuple[str, str], list[int]] = {}
        order: list[tuple[str, str] | int] = []
        for position, (item, p) in enumerate(zip(items, params, strict=True)):
            key = self._group_key(item, p)
            if key is None:
                order.append(position)
            elif key not in groups:
                groups[key] = [position]
                order.append(key)
            else:
                groups[key].append(position)
        results: dict[int, ChunkResult] = {}
        for entry in order:
            members = [entry] if isinstance(entry, int) else groups[entry]
            if len(members) == 1:
                results[members[0]] = self._run_alone(items[members[0]])
                continue
            run = self._prefill_group if items[members[0]].index == 0 else self._run_group
            done = run([items[i] for i in members], [params[i] for i in members])
            results.update(zip(members, done, strict=True))
        return [results[position] for position in range(len(items))]

    # -- batched decode -----------------------------------------------------------------------

    def _group_key(self, item: BatchItem, p: TextParams) -> tuple[str, str] | None:
        """The (batch key, expert version) of an item that may join a batch; None: it runs alone
        (also every item run_chunk would refuse, so it raises the same error). A fresh prefill's
        prompt is checked here, so a prompt that does not fit raises before any forward."""
        key = _batch_key(p, item.index)
        if key is None or not self._pads_cleanly(p.model):
            return None
        session = self.session(p.model)
        if item.index == 0:
            if item.state is not None:
                return None
            _prompt_ids(p, session)
            return key, _version_of(p, None, session)
        if item.state is None or item.index > p.num_decode_chunks:
            return None
        if item.state.meta.get("router") != RouterConfig.native().to_meta():
            return None
        return key, _version_of(p, item.state, session)

    def _pads_cleanly(self, model: str) -> bool:
        """Whether ``model``'s KV cache keeps every token, so left-padded rows stay aligned, and
        no linear-attention state runs through the padding."""
        if model not in self._pads:
            config = self.session(model).loaded.model.config
            self._pads[model] = not has_sliding_window(config) and not has_linear_attention(config)
        return self._pads[model]

    def _run_alone(self, item: BatchItem) -> ChunkResult:
        result = self.run_chunk(item.params, item.index, item.state, lambda: False)
        result.metrics["batch_size"] = 1
        return result

    def _run_group(self, items: Sequence[BatchItem], params: Sequence[TextParams],
                   ) -> list[ChunkResult]:
        """Decode the members' chunks together; each runs to its chunk's end."""
        started_s = time.perf_counter()
        session = self.session(params[0].model)
        session.experts.use(_version_of(params[0], items[0].state, session))
        session.cache.tick(self._clock_s())
        rows = [self._row(p, session, item) for p, item in zip(params, items, strict=True)]
        session.new_context(RouterConfig.native())
        self._decode_rows(session, [row for row in rows if not row.done])
        ended_s = time.perf_counter()
        results = []
        for row in rows:
            chunk_ms = ((ended_s if row.left_s is None else row.left_s) - started_s) * 1000.0
            row.job.latency_ms += chunk_ms
            produced = row.job.generated - row.generated_before
            result = _finish(row.params, session, row.job, produced, chunk_ms, True)
            result.metrics["batch_size"] = len(rows)
            results.append(result)
        log.debug("batched decode on %s: %d jobs, %d tokens", params[0].model, len(rows),
                  sum(r.metrics["tokens"] for r in results))
        return results

    def _row(self, p: TextParams, session: ModelSession, item: BatchItem) -> _Row:
        assert item.state is not None  # _group_key keeps stateless items out of groups
        job = self._load(p, session, item.state)
        return _Row(p, job, p.tokens_after_chunk(item.index), job.generated)

    def _decode_rows(self, session: ModelSession, active: list[_Row]) -> None:
        """Step the rows at once until each has met its target or stopped; a row that stops
        leaves the batch with a cache of exactly its own tokens."""
        if not active:
            return
        kv = PaddedKV.stack([row.job.kv for row in active], session.loaded.model.config)
        while active:
            self._batch_step(session, active, kv)
            now_s = time.perf_counter()
            for i, row in enumerate(active):
                if row.done:
                    row.job.kv, row.left_s = kv.row_cache(i), now_s
            staying = [i for i, row in enumerate(active) if not row.done]
            if staying and len(staying) < len(active):
                kv.keep(staying)
            active = [active[i] for i in staying]

    def _batch_step(self, session: ModelSession, active: list[_Row], kv: PaddedKV) -> None:
        """One forward of one new token per active row, and one sampled token per row.

        Native routing draws no random numbers, so the routing context's step seed is unused;
        each row's routing is counted in its own tally, the forward's cache counters in all."""
        mask, positions = kv.step_inputs()
        input_ids = torch.tensor([row.job.ids[-1:] for row in active], dtype=torch.int64,
                                 device=session.device)
        before = session.cache.counters.as_dict()
        session.context.rows = [row.job.routing for row in active]
        try:
            with torch.inference_mode():
                out = session.loaded.model(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    cache=kv.cache, use_cache=True, logits_to_keep=1,
                )
        finally:
            session.context.rows = None
        session.cache.end_forward()
        kv.advance(out.cache, mask)
        after = session.cache.counters.as_dict()
        for i, row in enumerate(active):
            stats = row.job.cache_stats
            row.job.cache_stats = {k: stats.get(k, 0) + after[k] - before[k] for k in after}
            _take_token(row.params, session, row.job, out.logits[i, -1])

    # -- batched prefill ---------------------------------------------------------------------

    def _prefill_group(self, items: Sequence[BatchItem], params: Sequence[TextParams],
                       ) -> list[ChunkResult]:
        """The members' prefills as one left-padded forward; each job then holds exactly what
        its lone prefill (:meth:`_start`) would: its own cache, first token, RNG and routing.
        Each job's cache counters are the forward's, as in a batched decode step."""
        assert all(item.index == 0 and item.state is None for item in items)  # see _group_key
        started_s = time.perf_counter()
        session = self.session(params[0].model)
        session.experts.use(_version_of(params[0], None, session))
        session.cache.tick(self._clock_s())
        before = session.cache.counters.as_dict()
        jobs = [self._new_job(p, session, _prompt_ids(p, session), _empty_tally(session),
                              RouterConfig.native()) for p in params]
        logits, kv = self._prefill_forward(session, jobs)
        after = session.cache.counters.as_dict()
        chunk_ms = (time.perf_counter() - started_s) * 1000.0
        results = []
        for row, (p, job) in enumerate(zip(params, jobs, strict=True)):
            job.kv, job.latency_ms = kv.row_cache(row), chunk_ms
            job.cache_stats = {k: after[k] - before[k] for k in after}
            _take_token(p, session, job, logits[row])
            result = _finish(p, session, job, job.generated, chunk_ms, True)
            result.metrics["batch_size"] = len(jobs)
            results.append(result)
        log.debug("batched prefill on %s: %d jobs, %d prompt tokens", params[0].model,
                  len(jobs), sum(job.prompt_tokens for job in jobs))
        return results

    def _prefill_forward(self, session: ModelSession, jobs: list[_Job],
                         ) -> tuple[torch.Tensor, PaddedKV]:
        """One forward over the jobs' prompts, left-padded: each row's last-position logits
        ``[rows, V]`` and the padded cache. Padding goes to no expert; each row's routing is
        counted in its job's tally, the batch's in the routing context."""
        prompts = PaddedPrompts.of([job.ids for job in jobs], _pad_id(session), session.device)
        context = session.new_context(RouterConfig.native())
        context.rows, context.token_mask = [job.routing for job in jobs], prompts.token_mask
        try:
            with torch.inference_mode():
                out = session.loaded.model(
                    input_ids=prompts.input_ids, attention_mask=prompts.mask,
                    position_ids=prompts.positions,
                    cache=DynamicCache(config=session.loaded.model.config),
                    use_cache=True, logits_to_keep=1,
                )
        finally:
            context.rows, context.token_mask = None, None
        session.cache.end_forward()
        return out.logits[:, -1], PaddedKV(out.cache, prompts.mask,
                                           session.loaded.model.config)

    # -- chunk steps -------------------------------------------------------------------------

    def _start(self, p: TextParams, session: ModelSession) -> _Job:
        router = RouterConfig.native() if p.routing == "native" else self.router
        ids = _prompt_ids(p, session)
        context = session.new_context(router)
        job = self._new_job(p, session, ids, context.totals(), router)
        self._step(p, session, job, ids)
        return job

    def _new_job(self, p: TextParams, session: ModelSession, ids: list[int],
                 routing: RoutingTally, router: RouterConfig) -> _Job:
        """A job before its prefill: its prompt, an empty cache, a fresh RNG."""
        kv = DynamicCache(config=session.loaded.model.config)
        return _Job(ids, len(ids), kv, new_generator(p.seed), router, routing,
                    version=session.experts.active_version)

    def _restore(self, p: TextParams, session: ModelSession, state: Checkpoint) -> _Job:
        """The job in ``state``, its routing counts in a fresh routing context."""
        job = self._load(p, session, state)
        context = session.new_context(job.router)
        context.expert_counts = job.routing.expert_counts
        context.score_sum, context.score_count = job.routing.score_sum, job.routing.score_count
        return job

    def _load(self, p: TextParams, session: ModelSession, state: Checkpoint) -> _Job:
        """The job in ``state``, on the session's active expert version."""
        meta = state.meta
        if meta.get("format") != STATE_FORMAT or meta.get("model") != p.model:
            raise CheckpointError(
                f"checkpoint is not a {p.model} text-job state (format {meta.get('format')!r}, "
                f"model {meta.get('model')!r})"
            )
        kv = kv_from_tensors(state.tensors, session.loaded.model.config, session.device)
        routing = RoutingTally(state.tensors["routing.expert_counts"].clone(),
                               float(meta["score_sum"]), int(meta["score_count"]))
        return _Job(
            ids=[int(i) for i in state.tensors["ids"].tolist()],
            prompt_tokens=int(meta["prompt_tokens"]),
            kv=kv,
            rng=generator_from_state(state.tensors["rng"]),
            router=RouterConfig.from_meta(meta["router"]),
            routing=routing,
            version=session.experts.active_version,
            finished=bool(meta["finished"]),
            latency_ms=float(meta["latency_ms"]),
            cache_stats={str(k): v for k, v in meta["cache"].items()},
        )

    def _decode_until(
        self,
        p: TextParams,
        session: ModelSession,
        job: _Job,
        target: int,
        should_yield: ShouldYield,
    ) -> None:
        while not job.finished and job.generated < target:
            self._step(p, session, job, job.ids[-1:])
            if job.generated < target and should_yield():
                break

    def _step(self, p: TextParams, session: ModelSession, job: _Job, new_ids: list[int]) -> None:
        """One forward pass over ``new_ids`` (not yet in the KV cache) and one sampled token."""
        session.context.step_seed = p.seed * 1_000_003 + len(job.ids)
        input_ids = torch.tensor([new_ids], dtype=torch.int64, device=session.device)
        with torch.inference_mode():
            out = session.loaded.model(
                input_ids=input_ids, cache=job.kv, use_cache=True, logits_to_keep=1
            )
        session.cache.end_forward()
        job.kv = out.cache
        _take_token(p, session, job, out.logits[0, -1])


def _batch_key(p: TextParams, index: int) -> str | None:
    if index < 0 or p.routing != "native":
        return None
    return f"{p.model}:native:prefill" if index == 0 else f"{p.model}:native"


def _prompt_ids(p: TextParams, session: ModelSession) -> list[int]:
    """The prompt's token ids; raises :class:`ParamsError` if they and ``max_new_tokens`` do not
    fit the model's positions."""
    ids = encode_prompt(session.loaded.tokenizer, p.prompt)
    limit = int(session.loaded.model.config.max_position_embeddings)
    if len(ids) + p.max_new_tokens > limit:
        raise ParamsError(
            f"prompt ({len(ids)} tokens) plus max_new_tokens ({p.max_new_tokens}) exceeds "
            f"{p.model}'s {limit} positions; shorten the prompt or lower max_new_tokens"
        )
    return ids


def _empty_tally(session: ModelSession) -> RoutingTally:
    """A job's routing counts before its first token."""
    counts = torch.zeros(len(session.moe_layers), session.loaded.num_experts, dtype=torch.int64)
    return RoutingTally(counts)


def _pad_id(session: ModelSession) -> int:
    """The token left padding holds (masked, and routed to no expert: any valid id serves)."""
    pad = session.loaded.tokenizer.pad_token_id
    return int(pad) if pad is not None else 0


def _take_token(p: TextParams, session: ModelSession, job: _Job, logits: torch.Tensor) -> None:
    """Sample the job's next token from its row of logits with its own sampler and RNG; the
    end-of-sequence token is never drawn before ``min_new_tokens`` and ends the job unless
    ``ignore_eos``. Both depend on the params and the tokens so far only, so a resumed job
    decides exactly as an uninterrupted one."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteOutput(
            f"{p.model} produced non-finite logits on expert version {job.version!r}; "
            "its weights are broken (the hot update rolls such a version back)"
        )
    eos = session.loaded.tokenizer.eos_token_id
    if eos is not None and job.generated < p.min_new_tokens:
        # generate()'s MinNewTokensLengthLogitsProcessor: the EOS logit masked before sampling
        logits = logits.clone()
        logits[eos] = -math.inf
    token = sample_next(logits, p.temperature, p.top_p, job.rng)
    job.ids.append(token)
    if token == eos and not p.ignore_eos:
        job.finished = True


def _finish(p: TextParams, session: ModelSession, job: _Job, produced: int, chunk_ms: float,
            complete: bool) -> ChunkResult:
    """The chunk's result: the checkpoint, the artifact once the job is done, and metrics."""
    job.finished = job.finished or job.generated >= p.max_new_tokens
    artifact = _artifact(p, session, job) if job.finished else None
    metrics = {"tokens": produced, "latency_ms": chunk_ms, "finished": job.finished,
               "expert_version": job.version}
    return ChunkResult(_encode(p, session, job), complete, artifact, metrics)


def _encode(p: TextParams, session: ModelSession, job: _Job) -> Checkpoint:
    routing = job.routing
    tensors = kv_to_tensors(job.kv)
    tensors["ids"] = torch.tensor(job.ids, dtype=torch.int64)
    tensors["rng"] = job.rng.get_state()
    tensors["routing.expert_counts"] = routing.expert_counts.clone()
    meta = {
        "format": STATE_FORMAT,
        "model": p.model,
        "prompt_tokens": job.prompt_tokens,
        "generated": job.generated,
        # the text so far, decoded as the artifact's output is: what a stream sends per chunk
        "text": session.loaded.tokenizer.decode(job.ids[job.prompt_tokens :],
                                                skip_special_tokens=True),
        "finished": job.finished,
        "latency_ms": job.latency_ms,
        "router": job.router.to_meta(),
        "expert_version": job.version,
        "score_sum": routing.score_sum,
        "score_count": routing.score_count,
        "cache": job.cache_stats,
    }
    return Checkpoint(tensors=tensors, meta=meta)


def _version_of(p: TextParams, state: Checkpoint | None, session: ModelSession) -> str:
    """A resumed job keeps the version its checkpoint names; a new one takes the version its
    params name (the hot update's routing), else the live one."""
    if state is not None:
        return str(state.meta.get("expert_version", BASE_VERSION))
    return p.expert_version or session.experts.live_version


def _artifact(p: TextParams, session: ModelSession, job: _Job) -> Artifact:
    tokenizer = session.loaded.tokenizer
    new_ids = job.ids[job.prompt_tokens :]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    routing = job.routing
    stats = dict(job.cache_stats)
    lookups = stats.get("hits", 0) + stats.get("late", 0) + stats.get("misses", 0)
    hit_rate = round(stats.get("hits", 0) / lookups, 6) if lookups else 0.0
    routed = stats.get("token_lookups", 0)
    token_hit_rate = round(stats.get("token_hits", 0) / routed, 6) if routed else 0.0
    metrics = {
        "activated_experts": routing.activated_experts(),
        "activated_experts_by_layer": routing.activated_by_layer(session.context.layer_order),
        "routing_score": round(routing.routing_score, 6),
        "latency_ms": round(job.latency_ms, 3),
        "tokens": job.generated,
        "prompt_tokens": job.prompt_tokens,
        "expert_version": job.version,
        "cache": {**stats, "hit_rate": hit_rate, "token_hit_rate": token_hit_rate},
    }
    body = {"output": text, "metrics": metrics}
    log.debug("text job finished on %s: %d tokens", p.model, job.generated)
    return Artifact(json.dumps(body).encode(), "application/json", "json")
