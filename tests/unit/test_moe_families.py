"""The newer MoE families (gpt-oss, DeepSeek-V3, Qwen3-Next): chunked generation equals
model.generate() run in one go, across preemption, migration to a fresh worker and a crash that
loses a chunk's result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from workers.checkpoint import Checkpoint
from workers.errors import ExpertCacheError
from workers.moe import recipes
from workers.moe import runner as runner_module
from workers.moe.deepseek import GroupLimitedRouter
from workers.moe.expert_cache import CacheConfig
from workers.moe.recipes import build_model, load_recipe, save_model_dir
from workers.moe.router import RouterConfig, RoutingContext, StepRouter
from workers.moe.runner import TextRunner
from workers.moe.tokenizer import encode_prompt
from workers.registry import default_registry
from workers.runner import BatchItem, ChunkResult

pytestmark = pytest.mark.timeout(180)

FAMILIES = ["gpt-oss-tiny", "deepseek-v3-tiny", "qwen3-next-tiny"]
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


@pytest.mark.parametrize(("experts", "groups", "topk_group", "top_k"),
                         [(8, 2, 1, 2), (16, 4, 2, 4), (12, 3, 3, 3)])
def test_deepseek_group_limited_routing_equals_transformers_gate_on_random_inputs(
    experts: int, groups: int, topk_group: int, top_k: int,
) -> None:
    # given DeepSeek-V3's own gate with random weights and a random score-correction bias
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=experts, n_group=groups,
                              topk_group=topk_group, num_experts_per_tok=top_k,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    gen = torch.Generator().manual_seed(experts)
    gate = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
        gate.e_score_correction_bias.copy_(0.1 * torch.randn(experts, generator=gen))
    context = RoutingContext(RouterConfig.native(), torch.zeros(1, experts, dtype=torch.int64))
    router = GroupLimitedRouter(gate, 0, True, context)
    hidden = torch.randn(3, 7, 32, generator=gen)
    # when both route the same tokens natively
    want_logits, want_weights, want_index = gate(hidden)
    logits, weights, index = router(hidden)
    # then logits, chosen experts (in the gate's order) and weights are bit-identical
    assert torch.equal(logits, want_logits)
    assert torch.equal(index, want_index)
    assert torch.equal(weights, want_weights)
    # and every token's experts lie in its topk_group groups
    per_token = [len({int(e) // (experts // groups) for e in row}) for row in index]
    assert max(per_token) <= topk_group


def test_deepseek_checkpoint_holds_the_compressed_latent_kv_equal_to_generates_cache() -> None:
    # given a DeepSeek-V3 job migrated to a fresh worker every chunk
    loaded = build_model(load_recipe("deepseek-v3-tiny"))
    config = loaded.model.config
    state = _run(_params("deepseek-v3-tiny"), fresh_runner_per_chunk=True,
                 yield_every_token=False)
    seen = len(state.tensors["ids"]) - 1  # the last sampled token is not in the cache yet
    # when model.generate() decodes the same job in one go, keeping its cache
    ids = encode_prompt(loaded.tokenizer, PROMPT)
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                return_dict_in_generate=True)
    reference = out.past_key_values
    # then every layer's checkpoint holds the latent c_kv (after its norm) and the roped k_pe,
    # not per-head K/V, bit-identical to generate()'s own cache
    for layer in range(config.num_hidden_layers):
        latent, rope_key = state.tensors[f"kv.{layer}.key"], state.tensors[f"kv.{layer}.value"]
        assert latent.shape == (1, 1, seen, config.kv_lora_rank)
        assert rope_key.shape == (1, 1, seen, config.qk_rope_head_dim)
        assert torch.equal(latent, reference.layers[layer].keys)
        assert torch.equal(rope_key, reference.layers[layer].values)
    # and it is (kv_lora_rank + qk_rope_head_dim) / (heads x (qk_head_dim + v_head_dim)) of
    # the per-head form per token: 24 of 160 floats a layer in the tiny model
    full = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    assert (config.kv_lora_rank + config.qk_rope_head_dim, full) == (24, 160)


def test_deepseek_shared_experts_take_their_bytes_out_of_the_expert_budget_first() -> None:
    # given DeepSeek-V3's routed slice bytes and its always-resident shared experts' bytes
    loaded = build_model(load_recipe("deepseek-v3-tiny"))
    moe = [layer.mlp for layer in loaded.model.model.layers if hasattr(layer.mlp, "experts")]
    experts = moe[0].experts
    slice_bytes = 4 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    shared = sum(4 * p.numel() for block in moe for p in block.shared_experts.parameters())
    routed_only = int(slice_bytes * len(moe) / 0.85) + 1
    # when the budget holds one slice per MoE layer but not the shared experts too
    # then no worker opens the model, naming the shared experts in its hint
    with pytest.raises(ExpertCacheError, match=f"beside {shared} bytes of shared experts"):
        _run(_params("deepseek-v3-tiny", max_new_tokens=2), fresh_runner_per_chunk=False,
             yield_every_token=False,
             cache=CacheConfig(budget_bytes=routed_only, prefetch_experts=0))
    # and when it holds the shared experts plus one slice per layer, every token evicts
    cache = CacheConfig(budget_bytes=int((shared + slice_bytes * len(moe)) / 0.85) + 1,
                        prefetch_experts=0)
    state = _run(_params("deepseek-v3-tiny", max_new_tokens=12), fresh_runner_per_chunk=True,
                 yield_every_token=False, cache=cache)
    # then the output is unchanged and each load moved one routed slice's bytes
    assert _generated(state) == _reference_ids("deepseek-v3-tiny", 12)
    stats = state.meta["cache"]
    assert stats["evictions"] > 0
    assert stats["bytes_moved"] == stats["loads"] * slice_bytes


def test_deepseek_configured_routing_resumes_exactly_on_fresh_workers() -> None:
    # given DeepSeek-V3 under the configured router (temperature, a capacity of one token per
    # expert with random fallback, a diversity penalty): the group-limited sigmoid scores
    params = _params("deepseek-v3-tiny", routing="configured", max_new_tokens=10)
    runner_config = RouterConfig(k=2, temperature=0.5, expert_capacity=1,
                                 diversity_penalty=0.3)
    # when it runs uninterrupted, and again preempted after every token on fresh workers
    plain = _run_routed(params, runner_config, fresh=False, yield_every_token=False)
    preempted = _run_routed(params, runner_config, fresh=True, yield_every_token=True)
    # then both generate the same tokens and count the same routing
    assert _generated(plain) == _generated(preempted)
    assert torch.equal(plain.tensors["routing.expert_counts"],
                       preempted.tensors["routing.expert_counts"])
    assert int(plain.tensors["routing.expert_counts"].sum()) > 0


def _run_routed(params: dict[str, object], router: RouterConfig, fresh: bool,
                yield_every_token: bool) -> Checkpoint:
    plan = TextRunner().plan(params)
    shared = TextRunner(router=router)
    state: Checkpoint | None = None
    for index in range(plan.num_chunks):
        complete = False
        while not complete:
            runner = TextRunner(router=router) if fresh else shared
            result = runner.run_chunk(params, index, state, lambda: yield_every_token)
            state, complete = _round_trip(result), result.complete
    assert state is not None
    return state


def test_deepseek_recipe_builds_identical_weights_and_score_biases_dense_layers_first() -> None:
    # given the DeepSeek-V3 recipe, listed as a text model (GET /v1/models reads the registry)
    assert "deepseek-v3-tiny" in default_registry().names("text")
    assert "deepseek-v3-tiny" in recipes.list_recipes()
    # when it is built twice (as two worker processes would do)
    first, second = (build_model(load_recipe("deepseek-v3-tiny")) for _ in range(2))
    # then every parameter and buffer is equal, the score-correction bias is seeded (not zero)
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    layers = first.model.model.layers
    dense = int(first.model.config.first_k_dense_replace)
    assert all(not hasattr(layer.mlp, "experts") for layer in layers[:dense])
    for layer in layers[dense:]:
        assert layer.mlp.experts.gate_up_proj.dim() == 3
        assert bool(layer.mlp.gate.e_score_correction_bias.abs().sum() > 0)


def test_qwen3_next_checkpoint_holds_deltanet_states_and_full_attention_kv_of_generate() -> None:
    # given a Qwen3-Next job migrated to a fresh worker every chunk
    loaded = build_model(load_recipe("qwen3-next-tiny"))
    config = loaded.model.config
    state = _run(_params("qwen3-next-tiny"), fresh_runner_per_chunk=True,
                 yield_every_token=False)
    seen = len(state.tensors["ids"]) - 1  # the last sampled token is not in the cache yet
    # when model.generate() decodes the same job in one go, keeping its cache
    ids = encode_prompt(loaded.tokenizer, PROMPT)
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                                return_dict_in_generate=True)
    reference = out.past_key_values.layers
    # then a gated-DeltaNet layer saves its conv window, recurrent state and token count, a
    # full-attention layer its keys and values, each bit-identical to generate()'s own cache
    for layer, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            conv = state.tensors[f"kv.{layer}.conv.0"]
            recurrent = state.tensors[f"kv.{layer}.recurrent.0"]
            assert conv.shape[-1] == config.linear_conv_kernel_dim
            assert torch.equal(conv, reference[layer].conv_states[0])
            assert torch.equal(recurrent, reference[layer].recurrent_states[0])
            assert int(state.tensors[f"kv.{layer}.seen"]) == seen
            assert f"kv.{layer}.key" not in state.tensors
        else:
            assert state.tensors[f"kv.{layer}.key"].shape[2] == seen
            assert torch.equal(state.tensors[f"kv.{layer}.key"], reference[layer].keys)
            assert torch.equal(state.tensors[f"kv.{layer}.value"], reference[layer].values)


def test_qwen3_next_router_equals_its_own_gate_and_its_shared_expert_counts_in_the_budget(
) -> None:
    # given Qwen3-Next's gate and a step router on its weight, routing natively
    loaded = build_model(load_recipe("qwen3-next-tiny"))
    gate = loaded.model.model.layers[0].mlp.gate
    context = RoutingContext(RouterConfig.native(),
                             torch.zeros(1, loaded.num_experts, dtype=torch.int64))
    router = StepRouter(gate.weight, 0, loaded.native_top_k, True, context)
    hidden = torch.randn(2, 5, loaded.model.config.hidden_size,
                         generator=torch.Generator().manual_seed(5))
    # when both route the same tokens
    # then logits, weights and experts are bit-identical
    for a, b in zip(router(hidden), gate(hidden), strict=True):
        assert torch.equal(a, b)
    # and a budget of one routed slice per layer, without room for the always-resident shared
    # expert and its gate, is refused naming exactly their bytes
    layers = loaded.model.model.layers
    experts = layers[0].mlp.experts
    slice_bytes = 4 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    shared = sum(4 * p.numel() for layer in layers
                 for m in (layer.mlp.shared_expert, layer.mlp.shared_expert_gate)
                 for p in m.parameters())
    cache = CacheConfig(budget_bytes=int(slice_bytes * len(layers) / 0.85) + 1,
                        prefetch_experts=0)
    with pytest.raises(ExpertCacheError, match=f"beside {shared} bytes of shared experts"):
        _run(_params("qwen3-next-tiny", max_new_tokens=2), fresh_runner_per_chunk=False,
             yield_every_token=False, cache=cache)


def test_qwen3_next_evicting_budget_keeps_the_output_and_jobs_run_alone_not_batched() -> None:
    # given a budget of the shared experts plus one routed slice per layer
    loaded = build_model(load_recipe("qwen3-next-tiny"))
    layers = loaded.model.model.layers
    experts = layers[0].mlp.experts
    slice_bytes = 4 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    shared = sum(4 * p.numel() for layer in layers
                 for m in (layer.mlp.shared_expert, layer.mlp.shared_expert_gate)
                 for p in m.parameters())
    cache = CacheConfig(budget_bytes=int((shared + slice_bytes * len(layers)) / 0.85) + 1,
                        prefetch_experts=0)
    # when a job runs chunk by chunk on fresh workers
    state = _run(_params("qwen3-next-tiny", max_new_tokens=12), fresh_runner_per_chunk=True,
                 yield_every_token=False, cache=cache)
    # then the output is unchanged, the cache evicted, each load moved one slice's bytes
    assert _generated(state) == _reference_ids("qwen3-next-tiny", 12)
    stats = state.meta["cache"]
    assert stats["evictions"] > 0
    assert stats["bytes_moved"] == stats["loads"] * slice_bytes
    # and two prefills handed over as a batch run alone (the DeltaNet state would run through
    # the left padding)
    runner = TextRunner()
    items = [BatchItem(_params("qwen3-next-tiny", prompt=p), 0, None) for p in ("hi", PROMPT)]
    assert [r.metrics["batch_size"] for r in runner.run_batch(items)] == [1, 1]
