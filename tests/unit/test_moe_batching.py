"""Step-level batching of MoE text decode: TextRunner.run_batch against run_chunk, job by job."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from workers.checkpoint import Checkpoint
from workers.errors import ParamsError
from workers.moe.expert_cache import CacheConfig, ExpertCache, HostExperts
from workers.moe.runner import TextRunner
from workers.moe.versioned import BASE_VERSION, perturbed_experts
from workers.runner import BatchItem, ChunkResult

pytestmark = pytest.mark.timeout(60)

MODEL = "qwen3-moe-tiny"
PROMPTS = (
    "Explain quantum computing in simple terms",
    "hi",
    "Tell me a story about a dragon and a brave knight",
    "What is the capital of France?",
)
_RUN_DEPENDENT = {"latency_ms", "cache"}
"""Checkpoint meta that depends on the run (timing, the worker's cache), not on the job."""

Params = dict[str, Any]


def _params(prompt: str, **overrides: Any) -> Params:
    return {"prompt": prompt, "max_new_tokens": 9, "chunk_tokens": 4, "model": MODEL,
            "routing": "native", **overrides}


@pytest.fixture(scope="module")
def runner() -> TextRunner:
    return TextRunner()


def _prefill(runner: TextRunner, jobs: Sequence[Params]) -> list[Checkpoint]:
    return [runner.run_chunk(p, 0, None, lambda: False).state for p in jobs]


def _alone(runner: TextRunner, params: Params, state: Checkpoint, first: int = 1,
           last: int | None = None) -> ChunkResult:
    """Chunks ``first..last`` (default: to the end) one by one with run_chunk."""
    end = runner.plan(params).num_chunks if last is None else last + 1
    result = None
    for index in range(first, end):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = result.state
    assert result is not None
    return result


def _batched(runner: TextRunner, jobs: Sequence[Params], states: Sequence[Checkpoint],
             first: int = 1, last: int | None = None) -> list[ChunkResult]:
    """Chunks ``first..last`` of every job, each chunk index as one run_batch of the jobs that
    still have it; the last result per job."""
    states = list(states)
    finals: dict[int, ChunkResult] = {}
    end = max(runner.plan(p).num_chunks for p in jobs) if last is None else last + 1
    for index in range(first, end):
        members = [i for i, p in enumerate(jobs) if index < runner.plan(p).num_chunks]
        results = runner.run_batch([BatchItem(jobs[i], index, states[i]) for i in members])
        for i, result in zip(members, results, strict=True):
            states[i], finals[i] = result.state, result
    return [finals[i] for i in range(len(jobs))]


def _ids(state: Checkpoint) -> list[int]:
    return [int(t) for t in state.tensors["ids"].tolist()]


def _kv_length(state: Checkpoint) -> int:
    return int(state.tensors["kv.0.key"].shape[2])


def _same_state(a: Checkpoint, b: Checkpoint) -> bool:
    tensors_equal = a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    meta = [{k: v for k, v in m.items() if k not in _RUN_DEPENDENT} for m in (a.meta, b.meta)]
    return tensors_equal and meta[0] == meta[1]


def test_batched_decode_gives_identical_results_for_the_same_items_in_the_same_order(
    runner: TextRunner,
) -> None:
    # given four prefilled jobs
    jobs = [_params(p) for p in PROMPTS]
    items = [BatchItem(p, 1, s) for p, s in zip(jobs, _prefill(runner, jobs), strict=True)]
    # when their first decode chunk runs batched twice
    first, second = runner.run_batch(items), runner.run_batch(items)
    # then every state is identical and each ran in a forward of four
    for a, b in zip(first, second, strict=True):
        assert _same_state(a.state, b.state)
        assert a.metrics["batch_size"] == b.metrics["batch_size"] == 4
        assert a.metrics["tokens"] == b.metrics["tokens"] == 4


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny",
                                   "deepseek-v3-tiny"])
def test_greedy_batched_tokens_equal_the_tokens_decoded_one_job_at_a_time(model: str) -> None:
    # given four greedy jobs of different prompt lengths, prefilled
    runner = TextRunner()
    jobs = [_params(p, model=model) for p in PROMPTS]
    states = _prefill(runner, jobs)
    # when they decode to the end batched, and again one by one
    batched = _batched(runner, jobs, states)
    alone = [_alone(runner, p, s) for p, s in zip(jobs, states, strict=True)]
    # then every token is the same (measured: 100% agreement on every tiny recipe)
    _assert_same_outputs(batched, alone)


def test_a_job_decoded_partly_batched_then_alone_and_the_other_way_round_finishes_validly(
    runner: TextRunner,
) -> None:
    # given two jobs whose checkpoints travel as bytes between chunks
    jobs = [_params(PROMPTS[0]), _params(PROMPTS[2])]
    states = _prefill(runner, jobs)
    reference = [_alone(runner, p, s) for p, s in zip(jobs, states, strict=True)]
    # when the first decodes chunk 1 batched (with a partner), then the rest alone on a fresh
    # runner, and the second decodes chunk 1 alone, then the rest batched with a partner
    partner = _params(PROMPTS[3])
    partner_state = _prefill(runner, [partner])[0]
    one = runner.run_batch([BatchItem(jobs[0], 1, states[0]),
                            BatchItem(partner, 1, partner_state)])[0]
    assert one.metrics["batch_size"] == 2
    first = _alone(TextRunner(), jobs[0], Checkpoint.decode(one.state.encode()), first=2)
    two = Checkpoint.decode(_alone(runner, jobs[1], states[1], last=1).state.encode())
    partner_two = runner.run_chunk(partner, 1, partner_state, lambda: False).state
    second = _batched(runner, [jobs[1], partner], [two, partner_two], first=2)[0]
    # then both finish with the artifact, tokens and cache invariant of an unbatched run
    for result, want in zip((first, second), reference, strict=True):
        assert result.artifact is not None and want.artifact is not None
        assert result.metrics["finished"]
        body = json.loads(result.artifact.data)
        assert body["output"] == json.loads(want.artifact.data)["output"]
        assert body["metrics"]["tokens"] == 9
        assert _ids(result.state) == _ids(want.state)
        assert _kv_length(result.state) == len(_ids(result.state)) - 1


def test_rows_of_different_prompt_lengths_keep_caches_of_exactly_their_own_tokens(
    runner: TextRunner,
) -> None:
    # given jobs whose prompts tokenize to different lengths
    jobs = [_params(p) for p in PROMPTS]
    states = _prefill(runner, jobs)
    assert len({int(s.meta["prompt_tokens"]) for s in states}) == len(jobs)
    # when one decode chunk runs batched and, for comparison, alone
    batched = runner.run_batch([BatchItem(p, 1, s) for p, s in zip(jobs, states, strict=True)])
    alone = [runner.run_chunk(p, 1, s, lambda: False) for p, s in zip(jobs, states, strict=True)]
    # then each saved cache holds its own tokens only, equal to the unbatched cache
    for b, a in zip(batched, alone, strict=True):
        assert _kv_length(b.state) == len(_ids(b.state)) - 1
        for name, tensor in a.state.tensors.items():
            if name.startswith("kv."):
                assert b.state.tensors[name].shape == tensor.shape
                torch.testing.assert_close(b.state.tensors[name], tensor, rtol=1e-4, atol=1e-4)


def test_a_row_that_reaches_its_max_new_tokens_leaves_the_batch_while_the_others_continue(
    runner: TextRunner,
) -> None:
    # given three jobs, one of which wants only 3 new tokens (2 after the prefill's first)
    jobs = [_params(PROMPTS[0]), _params(PROMPTS[1], max_new_tokens=3), _params(PROMPTS[2])]
    states = _prefill(runner, jobs)
    # when their first decode chunk runs batched
    results = runner.run_batch([BatchItem(p, 1, s) for p, s in zip(jobs, states, strict=True)])
    # then the short job finished after 2 tokens with its artifact, the others took their 4
    short = results[1]
    assert (short.metrics["tokens"], short.metrics["finished"]) == (2, True)
    assert short.artifact is not None and _kv_length(short.state) == len(_ids(short.state)) - 1
    assert short.metrics["latency_ms"] <= results[0].metrics["latency_ms"]
    for i in (0, 2):
        assert (results[i].metrics["tokens"], results[i].metrics["finished"]) == (4, False)
        alone = runner.run_chunk(jobs[i], 1, states[i], lambda: False)
        assert _ids(results[i].state) == _ids(alone.state)
    assert _ids(short.state) == _ids(runner.run_chunk(jobs[1], 1, states[1], lambda: False).state)


def test_per_job_routing_counts_sum_to_the_batch_total(runner: TextRunner) -> None:
    # given four prefilled jobs and their routing counts so far
    jobs = [_params(p) for p in PROMPTS]
    states = _prefill(runner, jobs)
    # when a decode chunk runs batched
    results = runner.run_batch([BatchItem(p, 1, s) for p, s in zip(jobs, states, strict=True)])
    # then each job's new counts are its own tokens', and together they are the batch's
    batch = runner.session(MODEL).context
    deltas = [r.state.tensors["routing.expert_counts"] - s.tensors["routing.expert_counts"]
              for r, s in zip(results, states, strict=True)]
    assert torch.equal(torch.stack(deltas).sum(dim=0), batch.expert_counts)
    layers, top_k = batch.expert_counts.shape[0], runner.session(MODEL).loaded.native_top_k
    for delta, result in zip(deltas, results, strict=True):
        assert int(delta.sum()) == result.metrics["tokens"] * layers * top_k
    counts = [r.state.meta["score_count"] - s.meta["score_count"]
              for r, s in zip(results, states, strict=True)]
    sums = [r.state.meta["score_sum"] - s.meta["score_sum"]
            for r, s in zip(results, states, strict=True)]
    assert sum(counts) == batch.score_count
    assert sum(sums) == pytest.approx(batch.score_sum, rel=1e-9)


def test_configured_routing_prefill_and_decode_run_alone_and_equal_run_chunk_exactly(
    runner: TextRunner,
) -> None:
    # given configured-routing jobs at their prefill and at decode
    configured = [_params(PROMPTS[2], routing="configured", temperature=0.8, seed=5),
                  _params(PROMPTS[3], routing="configured")]
    prefilled = _prefill(runner, configured)
    items = [BatchItem(configured[0], 0, None), BatchItem(configured[0], 1, prefilled[0]),
             BatchItem(configured[1], 0, None), BatchItem(configured[1], 1, prefilled[1])]
    assert [runner.batch_key(i.params, i.index) for i in items] == [None] * 4
    native = _params(PROMPTS[0])
    assert runner.batch_key(native, 0) == f"{MODEL}:native:prefill"
    assert runner.batch_key(native, 1) == f"{MODEL}:native"
    # when they run as one batch, and each alone on another worker
    batched = runner.run_batch(items)
    alone = [TextRunner().run_chunk(i.params, i.index, i.state, lambda: False) for i in items]
    # then each ran in a forward of its own, with exactly run_chunk's result
    for b, a in zip(batched, alone, strict=True):
        assert b.metrics["batch_size"] == 1
        assert _same_state(b.state, a.state)
        assert (b.complete, b.metrics["tokens"]) == (a.complete, a.metrics["tokens"])


def test_results_keep_the_item_order_when_batched_and_lone_items_interleave(
    runner: TextRunner,
) -> None:
    # given a prefill between two native decode chunks, and a configured-routing prefill
    jobs = [_params(PROMPTS[0]), _params(PROMPTS[1]), _params(PROMPTS[2]),
            _params(PROMPTS[3], routing="configured")]
    states = _prefill(runner, [jobs[0], jobs[2]])
    items = [BatchItem(jobs[0], 1, states[0]), BatchItem(jobs[1], 0, None),
             BatchItem(jobs[2], 1, states[1]), BatchItem(jobs[3], 0, None)]
    # when they run as one batch
    results = runner.run_batch(items)
    # then the decode chunks shared a forward, each prefill ran alone (the only native one, and
    # a configured one), and every result sits at its item's place
    assert [r.metrics["batch_size"] for r in results] == [2, 1, 2, 1]
    assert [r.metrics["tokens"] for r in results] == [4, 1, 4, 1]
    prompts = [r.state.meta["prompt_tokens"] for r in results]
    assert prompts == [states[0].meta["prompt_tokens"], prompts[1],
                       states[1].meta["prompt_tokens"], prompts[3]]


def test_jobs_on_different_expert_versions_never_share_a_forward() -> None:
    # given a second expert version, and two jobs on it beside two on the base version
    runner = TextRunner()
    session = runner.session(MODEL)
    session.experts.add("v2", perturbed_experts(session.experts.host(BASE_VERSION), 0.5, 1))
    jobs = [_params(PROMPTS[0], expert_version="v2"), _params(PROMPTS[1]),
            _params(PROMPTS[2], expert_version="v2"), _params(PROMPTS[3])]
    states = _prefill(runner, jobs)
    # when their decode chunks run as one batch
    results = runner.run_batch([BatchItem(p, 1, s) for p, s in zip(jobs, states, strict=True)])
    # then each version's jobs decoded together, and each on its own version
    assert [r.metrics["batch_size"] for r in results] == [2, 2, 2, 2]
    assert [r.metrics["expert_version"] for r in results] == ["v2", "base", "v2", "base"]
    alone = runner.run_chunk(jobs[2], 1, states[2], lambda: False)
    assert _ids(results[2].state) == _ids(alone.state)


def test_a_batched_step_runs_each_routed_expert_once_per_layer_for_all_rows(
    runner: TextRunner,
) -> None:
    # given four jobs whose decode chunks are one token long
    jobs = [_params(p, chunk_tokens=1) for p in PROMPTS]
    states = _prefill(runner, jobs)
    counters = runner.session(MODEL).cache.counters
    runs, lookups = counters.expert_runs, counters.token_lookups
    # when one batched step runs
    runner.run_batch([BatchItem(p, 1, s) for p, s in zip(jobs, states, strict=True)])
    # then each (layer, expert) routed in it ran once, serving all the rows routed to it
    routed = runner.session(MODEL).context.expert_counts
    assert counters.expert_runs - runs == int((routed > 0).sum())
    assert counters.token_lookups - lookups == int(routed.sum()) == 4 * routed.shape[0] * 2
    assert counters.expert_runs - runs < counters.token_lookups - lookups


def test_the_cache_counts_token_routings_per_expert_run_and_per_load() -> None:
    # given a cache with room for every expert, and nothing resident
    gen = torch.Generator().manual_seed(0)
    host = HostExperts(gate_up={0: torch.randn(4, 6, 4, generator=gen)},
                       down={0: torch.randn(4, 4, 3, generator=gen)})
    cache = ExpertCache(host, CacheConfig(prefetch_experts=0, warmup_experts=0))
    # when a forward runs experts 1 (3 tokens) and 2 (1 token), then again, then expert 1 alone
    for _ in range(2):
        cache.acquire(0, [1, 2], tokens={1: 3, 2: 1})
        cache.release(0, [1, 2])
    cache.acquire(0, [1])  # no token counts: one token's routing
    # then runs and routings are counted, and only resident experts' routings are hits
    c = cache.counters
    assert (c.expert_runs, c.token_lookups, c.token_hits, c.loads) == (5, 9, 5, 2)
    assert (c.hits, c.misses) == (3, 2)  # the per-access counters keep their meaning
    assert c.tokens_per_run == pytest.approx(9 / 5)
    assert c.tokens_per_load == pytest.approx(9 / 2)
    assert c.token_hit_rate == pytest.approx(5 / 9)
    assert {"expert_runs", "token_lookups", "token_hits"} <= set(c.as_dict())


def test_a_member_with_nothing_left_to_decode_keeps_its_state_and_the_others_decode(
    runner: TextRunner,
) -> None:
    # given a job already finished (3 new tokens, all done) and a live one
    done_job, live_job = _params(PROMPTS[1], max_new_tokens=3), _params(PROMPTS[0])
    done = _alone(runner, done_job, _prefill(runner, [done_job])[0])
    live = _prefill(runner, [live_job])[0]
    assert done.metrics["finished"]
    # when its last chunk runs again batched with the live job, and with a copy of itself
    mixed = runner.run_batch([BatchItem(done_job, 1, done.state), BatchItem(live_job, 1, live)])
    both_done = runner.run_batch([BatchItem(done_job, 1, done.state)] * 2)
    # then it adds no token and keeps its artifact, while the live job decodes its chunk
    for result in (mixed[0], *both_done):
        assert (result.metrics["tokens"], result.metrics["finished"]) == (0, True)
        assert _ids(result.state) == _ids(done.state) and result.artifact is not None
    assert mixed[1].metrics["tokens"] == 4


# -- batched prefill --------------------------------------------------------------------------


def _prefill_batched(runner: TextRunner, jobs: Sequence[Params]) -> list[ChunkResult]:
    return runner.run_batch([BatchItem(p, 0, None) for p in jobs])


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny",
                                   "deepseek-v3-tiny"])
def test_batched_prefill_of_different_prompt_lengths_gives_the_lone_tokens_and_continuation(
    model: str,
) -> None:
    # given greedy jobs whose prompts tokenize to different lengths
    runner = TextRunner()
    jobs = [_params(p, model=model) for p in PROMPTS]
    # when their prefills run as one batch, and again one by one
    batched = _prefill_batched(runner, jobs)
    alone = _prefill(runner, jobs)
    # then each ran in the batch and took the lone prefill's first token
    assert [r.metrics["batch_size"] for r in batched] == [len(jobs)] * len(jobs)
    assert [_ids(r.state) for r in batched] == [_ids(s) for s in alone]
    # and decoding on from the batched prefills (batched) gives the lone run's sequence
    # (measured: 100% agreement on every tiny recipe, also at 8 jobs)
    continued = _batched(runner, jobs, [r.state for r in batched])
    reference = [_alone(runner, p, s) for p, s in zip(jobs, alone, strict=True)]
    _assert_same_outputs(continued, reference)


def _assert_same_outputs(results: list[ChunkResult], reference: list[ChunkResult]) -> None:
    """Same ids and the same output text, job by job."""
    for b, a in zip(results, reference, strict=True):
        assert _ids(b.state) == _ids(a.state)
        assert b.artifact is not None and a.artifact is not None
        assert json.loads(b.artifact.data)["output"] == json.loads(a.artifact.data)["output"]


def test_each_batched_prefill_saves_the_checkpoint_of_its_lone_prefill(
    runner: TextRunner,
) -> None:
    # given jobs of different prompt lengths, one sampled with its own seed
    jobs = [_params(p) for p in PROMPTS[:3]] + [_params(PROMPTS[3], temperature=0.8, seed=7)]
    # when their prefills run batched, and alone
    batched = _prefill_batched(runner, jobs)
    alone = _prefill(runner, jobs)
    # then each cache holds exactly its own prompt, and the checkpoint is the lone one's: same
    # tensors (the cache to float tolerance), same meta but for timing and the cache counters
    for b, a in zip(batched, alone, strict=True):
        assert _kv_length(b.state) == b.state.meta["prompt_tokens"] == len(_ids(b.state)) - 1
        assert b.state.tensors.keys() == a.tensors.keys()
        for name, tensor in a.tensors.items():
            if name.startswith("kv."):
                assert b.state.tensors[name].shape == tensor.shape
                torch.testing.assert_close(b.state.tensors[name], tensor, rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(b.state.tensors[name], tensor), name
        meta = [{k: v for k, v in m.items() if k not in _RUN_DEPENDENT | {"score_sum"}}
                for m in (b.state.meta, a.meta)]
        assert meta[0] == meta[1]
        assert b.state.meta["score_sum"] == pytest.approx(a.meta["score_sum"], rel=1e-5)


def test_per_job_prefill_routing_counts_exclude_the_padding(runner: TextRunner) -> None:
    # given jobs whose prompts pad to the longest
    jobs = [_params(p) for p in PROMPTS]
    session = runner.session(MODEL)
    counters = session.cache.counters
    lookups = counters.token_lookups
    # when their prefills run batched
    results = _prefill_batched(runner, jobs)
    # then each job counted its own prompt tokens only, in every MoE layer
    layers, top_k = len(session.moe_layers), session.loaded.native_top_k
    prompt_tokens = [int(r.state.meta["prompt_tokens"]) for r in results]
    counts = [r.state.tensors["routing.expert_counts"] for r in results]
    for tokens, count, result in zip(prompt_tokens, counts, results, strict=True):
        assert int(count.sum()) == tokens * layers * top_k
        assert result.state.meta["score_count"] == tokens * layers
    # and so did the batch's context and the expert cache: padding routed to no expert
    assert torch.equal(torch.stack(counts).sum(dim=0), session.context.expert_counts)
    assert counters.token_lookups - lookups == sum(prompt_tokens) * layers * top_k


def test_a_prefill_whose_prompt_does_not_fit_raises_its_own_error_before_any_forward(
    runner: TextRunner,
) -> None:
    # given two good prefills and one whose prompt plus max_new_tokens exceeds 1024 positions
    good = [_params(PROMPTS[0]), _params(PROMPTS[2])]
    bad = _params(PROMPTS[1], max_new_tokens=1024)
    with pytest.raises(ParamsError) as lone:
        runner.run_chunk(bad, 0, None, lambda: False)
    runs = runner.session(MODEL).cache.counters.expert_runs
    # when the three run as one batch
    with pytest.raises(ParamsError) as batched:
        runner.run_batch([BatchItem(good[0], 0, None), BatchItem(bad, 0, None),
                          BatchItem(good[1], 0, None)])
    # then the batch raised the bad job's own error before running anything, so the task layer
    # runs each member alone (tasks.batches) and the good ones, batched or not, succeed
    assert str(batched.value) == str(lone.value)
    assert runner.session(MODEL).cache.counters.expert_runs == runs
    results = _prefill_batched(runner, good)
    assert [r.metrics["batch_size"] for r in results] == [2, 2]
    assert [_ids(r.state) for r in results] == [_ids(s) for s in _prefill(runner, good)]


def test_a_job_that_ends_in_its_batched_prefill_finishes_with_its_artifact(
    runner: TextRunner,
) -> None:
    # given a job that wants one new token, batched with a longer one
    jobs = [_params(PROMPTS[0], max_new_tokens=1), _params(PROMPTS[2])]
    # when their prefills run batched
    results = _prefill_batched(runner, jobs)
    # then the short job finished with the lone prefill's artifact, the other goes on
    lone = runner.run_chunk(jobs[0], 0, None, lambda: False)
    short = results[0]
    assert (short.metrics["finished"], short.metrics["tokens"]) == (True, 1)
    assert short.artifact is not None and lone.artifact is not None
    body, want = json.loads(short.artifact.data), json.loads(lone.artifact.data)
    assert body["output"] == want["output"]
    assert body["metrics"]["prompt_tokens"] == want["metrics"]["prompt_tokens"]
    assert (results[1].metrics["finished"], results[1].artifact) == (False, None)
