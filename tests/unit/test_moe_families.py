"""The newer MoE families (gpt-oss): chunked generation equals model.generate() run in one go,
across preemption, migration to a fresh worker and a crash that loses a chunk's result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.checkpoint import Checkpoint
from workers.moe import recipes
from workers.moe import runner as runner_module
from workers.moe.expert_cache import CacheConfig
from workers.moe.recipes import build_model, load_recipe, save_model_dir
from workers.moe.runner import TextRunner
from workers.moe.tokenizer import encode_prompt
from workers.runner import ChunkResult

pytestmark = pytest.mark.timeout(180)

FAMILIES = ["gpt-oss-tiny"]
PROMPT = "Explain quantum computing in simple terms"
STEPS = 24


def _reference_ids(model: str, steps: int = STEPS, prompt: str = PROMPT) -> list[int]:
    loaded = build_model(load_recipe(model))
    ids = encode_prompt(loaded.tokenizer, prompt)
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return [int(t) for t in out[0, len(ids):]]


def _params(model: str, **extra: object) -> dict[str, object]:
    return {"prompt": PROMPT, "max_new_tokens": STEPS, "chunk_tokens": 5, "model": model,
            "routing": "native", **extra}


def _round_trip(result: ChunkResult) -> Checkpoint:
    """The checkpoint as another worker reads it: through its real serialization."""
    return Checkpoint.decode(result.state.encode())


def _generated(state: Checkpoint) -> list[int]:
    ids = state.tensors["ids"].tolist()
    return [int(t) for t in ids[state.meta["prompt_tokens"]:]]


def _run(params: dict[str, object], fresh_runner_per_chunk: bool, yield_every_token: bool,
         crash_each_chunk: bool = False, cache: CacheConfig | None = None) -> Checkpoint:
    """Run a job chunk by chunk; optionally a chunk first runs on a worker that crashes before
    committing (its result is lost) and then again from the last committed checkpoint."""
    plan = TextRunner().plan(params)
    shared = TextRunner(cache=cache)
    state: Checkpoint | None = None
    for index in range(plan.num_chunks):
        if crash_each_chunk:
            shared.run_chunk(params, index, state, lambda: False)  # never committed
        complete = False
        while not complete:
            runner = TextRunner(cache=cache) if fresh_runner_per_chunk else shared
            result = runner.run_chunk(params, index, state, lambda: yield_every_token)
            state, complete = _round_trip(result), result.complete
    assert state is not None
    return state


@pytest.mark.parametrize("model", FAMILIES)
def test_greedy_output_matches_generate_when_every_chunk_migrates_to_a_fresh_worker(
    model: str,
) -> None:
    # given greedy native decoding in chunks of 5 tokens, past the sliding window
    # when each chunk runs on a new runner from the decoded checkpoint of the last one
    state = _run(_params(model), fresh_runner_per_chunk=True, yield_every_token=False)
    # then the tokens are exactly model.generate()'s
    assert _generated(state) == _reference_ids(model)


@pytest.mark.parametrize("model", FAMILIES)
def test_greedy_output_matches_generate_when_preempted_after_every_token(model: str) -> None:
    # given a job that yields after every decoded token (a realtime job preempting it)
    # when every resume goes through the serialized checkpoint, on the same worker
    state = _run(_params(model), fresh_runner_per_chunk=False, yield_every_token=True)
    # then it generated exactly model.generate()'s tokens
    assert _generated(state) == _reference_ids(model)


@pytest.mark.parametrize("model", FAMILIES)
def test_greedy_output_matches_generate_when_every_chunk_is_lost_to_a_crash_and_rerun(
    model: str,
) -> None:
    # given a worker that runs each chunk but dies before committing it (its caches warm)
    # when a fresh worker reruns the chunk from the last committed checkpoint
    state = _run(_params(model), fresh_runner_per_chunk=True, yield_every_token=False,
                 crash_each_chunk=True)
    # then the rerun chunks give exactly model.generate()'s tokens
    assert _generated(state) == _reference_ids(model)


@pytest.mark.parametrize("model", FAMILIES)
def test_sampled_output_is_identical_uninterrupted_and_preempted_on_fresh_workers(
    model: str,
) -> None:
    # given a seeded sampled job
    params = _params(model, temperature=0.9, top_p=0.9, seed=11)
    # when it runs once uninterrupted, once yielding after every token on fresh workers
    plain = _run(params, fresh_runner_per_chunk=False, yield_every_token=False)
    preempted = _run(params, fresh_runner_per_chunk=True, yield_every_token=True)
    # then both drew the same tokens (and the sampler really sampled)
    assert _generated(plain) == _generated(preempted)
    assert _generated(plain) != _reference_ids(model)


def test_gpt_oss_checkpoint_keeps_the_sliding_window_and_how_many_tokens_it_has_seen() -> None:
    # given a gpt-oss job decoded past its sliding window
    loaded = build_model(load_recipe("gpt-oss-tiny"))
    config = loaded.model.config
    window = int(config.sliding_window)
    state = _run(_params("gpt-oss-tiny"), fresh_runner_per_chunk=True, yield_every_token=False)
    seen = len(state.tensors["ids"]) - 1  # the last sampled token is not in the cache yet
    assert seen > window
    # then a sliding layer saves its last window - 1 tokens and the count it has seen, and a
    # full-attention layer every token
    for layer, kind in enumerate(config.layer_types):
        keys = state.tensors[f"kv.{layer}.key"]
        if kind == "sliding_attention":
            assert keys.shape[2] == window - 1
            assert int(state.tensors[f"kv.{layer}.seen"]) == seen
        else:
            assert keys.shape[2] == seen
            assert f"kv.{layer}.seen" not in state.tensors


def test_gpt_oss_cache_loads_and_counts_per_expert_slices_with_their_biases() -> None:
    # given a budget of one expert slice per layer (weights and biases of gpt-oss's fused
    # experts), so every token misses and evicts
    loaded = build_model(load_recipe("gpt-oss-tiny"))
    experts = loaded.model.model.layers[0].mlp.experts
    slice_bytes = 4 * sum(t[0].numel() for t in (experts.gate_up_proj, experts.down_proj,
                                                 experts.gate_up_proj_bias,
                                                 experts.down_proj_bias))
    budget = int(slice_bytes * loaded.num_layers / 0.85) + 1
    cache = CacheConfig(budget_bytes=budget, prefetch_experts=0)
    # when the job runs chunk by chunk on fresh workers
    state = _run(_params("gpt-oss-tiny", max_new_tokens=12), fresh_runner_per_chunk=True,
                 yield_every_token=False, cache=cache)
    # then the output is unchanged, the cache evicted, and each load moved one slice's bytes
    assert _generated(state) == _reference_ids("gpt-oss-tiny", 12)
    stats = state.meta["cache"]
    assert stats["evictions"] > 0
    assert stats["bytes_moved"] == stats["loads"] * slice_bytes


@pytest.mark.parametrize("model", FAMILIES)
def test_a_save_pretrained_dir_loaded_through_weights_generates_the_same_text(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given the tiny model saved with save_pretrained and a recipe whose weights: point there
    built = build_model(load_recipe(model))
    want = _reference_ids(model)
    save_model_dir(built, tmp_path / "weights")
    family = load_recipe(model).family
    (tmp_path / "local.yaml").write_text(
        f"name: local\nkind: text\nfamily: {family}\nweights: {tmp_path / 'weights'}\n"
    )
    monkeypatch.setattr(recipes, "MODELS_DIR", tmp_path)
    monkeypatch.setattr(runner_module, "MODELS_DIR", tmp_path)
    # when a job on the local recipe runs chunk by chunk on fresh workers
    state = _run(_params("local"), fresh_runner_per_chunk=True, yield_every_token=False)
    # then it generates the built model's text
    assert _generated(state) == want
    assert state.meta["text"] == built.tokenizer.decode(want, skip_special_tokens=True)
