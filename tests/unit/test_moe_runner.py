"""The text runner: chunked generation equals model.generate() across simulated preemption."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from workers.checkpoint import Checkpoint
from workers.errors import ParamsError
from workers.moe import get_runner
from workers.moe.expert_cache import CacheConfig
from workers.moe.params import validate_params
from workers.moe.recipes import build_model, load_recipe
from workers.moe.router import RouterConfig
from workers.moe.runner import TextRunner
from workers.moe.tokenizer import encode_prompt
from workers.runner import BatchItem, ChunkResult

pytestmark = pytest.mark.timeout(60)

PROMPT = "Explain quantum computing in simple terms"


def _reference_ids(model: str, prompt: str, max_new_tokens: int) -> list[int]:
    loaded = build_model(load_recipe(model))
    ids = encode_prompt(loaded.tokenizer, prompt)
    out = loaded.model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
    )
    return [int(t) for t in out[0, len(ids) :]]


def _run_preempted(params: dict[str, object], cache: CacheConfig | None = None) -> ChunkResult:
    """Every chunk on a fresh runner (another worker), the state through bytes in between."""
    plan = TextRunner().plan(params)
    state: Checkpoint | None = None
    result = None
    for index in range(plan.num_chunks):
        runner = TextRunner(cache=cache)
        result = runner.run_chunk(params, index, state, lambda: False)
        state = Checkpoint.decode(result.state.encode())
    assert result is not None
    return result


def _generated(result: ChunkResult) -> list[int]:
    ids = result.state.tensors["ids"].tolist()
    return [int(t) for t in ids[result.state.meta["prompt_tokens"] :]]


@pytest.mark.parametrize("model", ["mixtral-tiny", "qwen3-moe-tiny"])
def test_greedy_output_matches_generate_when_every_chunk_moves_to_a_fresh_worker(
    model: str,
) -> None:
    # given native routing, greedy decoding and chunks of 5 tokens
    params = {"prompt": PROMPT, "max_new_tokens": 24, "chunk_tokens": 5, "model": model,
              "routing": "native"}
    # when each chunk runs on a new runner from a decoded checkpoint
    result = _run_preempted(params)
    # then the tokens are exactly model.generate()'s
    assert _generated(result) == _reference_ids(model, PROMPT, 24)


def test_greedy_output_matches_generate_when_the_cache_holds_one_expert_per_layer() -> None:
    # given a budget that fits a single expert per layer (misses and evictions every token)
    loaded = build_model(load_recipe("mixtral-tiny"))
    expert = loaded.model.model.layers[0].mlp.experts
    expert_bytes = (expert.gate_up_proj[0].numel() + expert.down_proj[0].numel()) * 4
    budget = int(expert_bytes * loaded.num_layers / 0.85) + 1
    params = {"prompt": PROMPT, "max_new_tokens": 12, "chunk_tokens": 4, "routing": "native"}
    # when the job runs chunk by chunk
    result = _run_preempted(params, CacheConfig(budget_bytes=budget))
    # then the output is unchanged and the cache really evicted
    assert _generated(result) == _reference_ids("mixtral-tiny", PROMPT, 12)
    assert result.state.meta["cache"]["evictions"] > 0


def test_sampled_output_is_identical_with_and_without_preemption_and_yields() -> None:
    # given a sampled job
    params = {"prompt": "Tell me a story", "max_new_tokens": 20, "chunk_tokens": 6,
              "temperature": 0.9, "top_p": 0.9, "seed": 7, "model": "qwen3-moe-tiny"}
    runner = TextRunner()
    plan = runner.plan(params)
    state = None
    for index in range(plan.num_chunks):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    # when it runs again, yielding after every token, with a fresh runner per call
    yielded_state: Checkpoint | None = None
    calls = 0
    for index in range(plan.num_chunks):
        complete = False
        while not complete:
            result = TextRunner().run_chunk(params, index, yielded_state, lambda: True)
            yielded_state = Checkpoint.decode(result.state.encode())
            complete, calls = result.complete, calls + 1
    # then both runs drew the same tokens, and the yields really split the chunks
    assert yielded_state is not None
    assert torch.equal(state.tensors["ids"], yielded_state.tensors["ids"])
    assert calls > plan.num_chunks


def _generate_ids(model: str, prompt: str, max_new_tokens: int, **kwargs: object) -> list[int]:
    loaded = build_model(load_recipe(model))
    ids = encode_prompt(loaded.tokenizer, prompt)
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                do_sample=False, **kwargs)
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.timeout(300)  # nine model builds and three generate() calls on a shared CPU
def test_eos_ends_the_job_after_min_new_tokens_and_never_with_ignore_eos_across_preemption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given a token the greedy continuation draws early, made the tokenizer's EOS (the tiny
    # random models draw their real EOS about once in 512 tokens)
    model, steps = "mixtral-tiny", 9
    plain = _reference_ids(model, PROMPT, steps)
    eos = plain[2]
    tokenizer_class = type(build_model(load_recipe(model)).tokenizer)
    monkeypatch.setattr(tokenizer_class, "eos_token_id", property(lambda _: eos),
                        raising=False)
    base = {"prompt": PROMPT, "max_new_tokens": steps, "chunk_tokens": 4, "model": model,
            "routing": "native"}
    # when the job runs chunk by chunk on fresh workers: plainly, with min_new_tokens, ignoring EOS
    stopped = _generated(_run_preempted(base))
    held = _generated(_run_preempted({**base, "min_new_tokens": 5}))
    ignoring = _generated(_run_preempted({**base, "ignore_eos": True}))
    # then each equals model.generate() with the same setting
    assert stopped == _generate_ids(model, PROMPT, steps, eos_token_id=eos)
    assert stopped[-1] == eos and len(stopped) < steps
    assert held == _generate_ids(model, PROMPT, steps, eos_token_id=eos, min_new_tokens=5)
    assert eos not in held[:5] and len(held) > len(stopped)
    assert ignoring == plain and len(ignoring) == steps and eos in ignoring


@pytest.mark.timeout(300)  # a dozen model builds on a shared CPU
def test_sampled_fixed_length_output_is_identical_with_and_without_preemption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer_class = type(build_model(load_recipe("qwen3-moe-tiny")).tokenizer)
    for setting in ({"min_new_tokens": 6}, {"ignore_eos": True}):
        # given a sampled job whose EOS is the second token it draws unconstrained
        params = {"prompt": "Tell me a story", "max_new_tokens": 9, "chunk_tokens": 4,
                  "temperature": 0.8, "seed": 3, "model": "qwen3-moe-tiny", **setting}
        eos = _run_whole(params)[1]
        monkeypatch.setattr(tokenizer_class, "eos_token_id", property(lambda _, t=eos: t),
                            raising=False)
        # when it runs uninterrupted, then chunk by chunk on fresh workers
        whole = _run_whole(params)
        preempted = _generated(_run_preempted(params))
        monkeypatch.undo()
        # then both drew the same tokens, and EOS came no earlier than allowed
        assert preempted == whole
        assert eos not in whole[: setting.get("min_new_tokens", 0)]
        assert len(whole) == 9 if setting.get("ignore_eos") else len(whole) >= 6


def _generated_of(state: Checkpoint) -> list[int]:
    return [int(t) for t in state.tensors["ids"].tolist()[state.meta["prompt_tokens"] :]]


def _run_whole(params: dict[str, object]) -> list[int]:
    runner = TextRunner()
    state = None
    for index in range(runner.plan(params).num_chunks):
        state = runner.run_chunk(params, index, state, lambda: False).state
    assert state is not None
    return _generated_of(state)

def test_lone_and_batched_chunks_use_no_deprecated_transformers_argument() -> None:
    # given every transformers deprecation turned into an error
    params = {"prompt": PROMPT, "max_new_tokens": 6, "chunk_tokens": 3, "routing": "native"}
    other = {**params, "prompt": "hi"}
    runner = TextRunner()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        # when a job runs its chunks alone, resumed from bytes, and two jobs run batched
        state = None
        for index in range(runner.plan(params).num_chunks):
            restored = None if state is None else Checkpoint.decode(state.encode())
            state = runner.run_chunk(params, index, restored, lambda: False).state
        prefills = runner.run_batch([BatchItem(params, 0, None), BatchItem(other, 0, None)])
        decodes = runner.run_batch([BatchItem(p, 1, r.state)
                                    for p, r in zip((params, other), prefills, strict=True)])
    # then they finish without a single deprecation
    assert state is not None and (state.meta["finished"] or state.meta["generated"] == 6)
    assert [r.metrics["batch_size"] for r in decodes] == [2, 2]


def test_final_chunk_returns_the_reference_api_json() -> None:
    # given a short job
    params = {"inputs": PROMPT, "max_new_tokens": 9, "chunk_tokens": 4}
    # when it runs to the end
    result = _run_preempted(params)
    # then the artifact is the POST /v1/inference body
    assert result.artifact is not None and result.artifact.media_type == "application/json"
    body = json.loads(result.artifact.data)
    metrics = body["metrics"]
    assert isinstance(body["output"], str)
    assert metrics["activated_experts"] == sorted(set(metrics["activated_experts"]))
    assert 0.0 < metrics["routing_score"] <= 1.0
    assert metrics["tokens"] == 9 and metrics["latency_ms"] > 0
    assert {"hits", "misses", "bytes_moved", "hit_rate"} <= set(metrics["cache"])


def test_configured_routing_differs_from_native_only_in_weights_not_in_validity() -> None:
    # given the reference design's router (temperature 0.5, capacity 256)
    runner = TextRunner(router=RouterConfig())
    params = {"prompt": PROMPT, "max_new_tokens": 8, "chunk_tokens": 8}
    state = None
    for index in range(runner.plan(params).num_chunks):
        result = runner.run_chunk(params, index, state, lambda: False)
        state = result.state
    # then the job finishes and records the router config it ran with
    assert result.artifact is not None
    assert result.state.meta["router"]["temperature"] == 0.5


def test_plan_names_prefill_then_decode_chunks_with_a_model_bucket_cost_key() -> None:
    # given 20 new tokens in chunks of 8
    plan = get_runner().plan({"prompt": "hi", "max_new_tokens": 20, "chunk_tokens": 8})
    # then the prefill yields token 1, and decode chunks carry 8, 8 and 3 tokens
    assert plan.names == ("prefill", "decode[0]", "decode[1]", "decode[2]")
    assert plan.cost_units[1:] == (8.0, 8.0, 3.0)
    assert plan.cost_key == "mixtral-tiny:p16"


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({}, "non-empty string"),
        ({"prompt": "x", "inputs": "y"}, "not both"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "model": "gpt-huge"}, "known recipes"),
        ({"prompt": "x", "max_tokens": 5}, "accepted"),
        ({"prompt": "x", "routing": "fast"}, "routing"),
        ({"prompt": "x", "ignore_eos": "yes"}, "true or false"),
        ({"prompt": "x", "max_new_tokens": 4, "min_new_tokens": 5}, "exceeds max_new_tokens"),
    ],
)
def test_invalid_params_raise_a_params_error_naming_the_fix(
    params: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ParamsError, match=fragment):
        validate_params(params)


def test_get_runner_maps_the_moe_settings_onto_router_and_cache() -> None:
    from tasks.settings.moe import MoeSettings, cache_config, router_config

    settings = MoeSettings.model_validate(
        {"router": {"fallback_strategy": "next_best"}, "cache": {"budget_mb": 2, "policy": "lru"}}
    )
    router, cache = router_config(settings), cache_config(settings, "cpu")
    assert (router.k, router.temperature, router.expert_capacity) == (8, 0.5, 256)
    assert router.fallback == "next_best"
    assert cache.budget_bytes == 2 * 1024 * 1024 and cache.policy == "lru"
    assert cache.idle_unload_s == 300.0 and cache.memory_threshold == 0.85
    assert get_runner(router, cache) is get_runner(router_config(settings), cache)
