"""Record the expert routing of a real run: per request, per step (the prefill, then each decoded
token), per MoE layer, the experts chosen, and what the lookahead predictor said about that layer
before it was routed. The model generates greedily with its own (native) routing, through the
same session the workers use."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from workers.errors import ParamsError
from workers.moe.expert_cache import CacheConfig
from workers.moe.prefetch import Lookahead
from workers.moe.recipes import MODELS_DIR, build_model, load_recipe
from workers.moe.router import RouterConfig
from workers.moe.session import open_session
from workers.moe.tokenizer import encode_prompt
from workers.moe.traces import RequestTrace, RoutingTrace

MAX_RECORD_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class RecordInput:
    """One prompt to run, with how many tokens to generate."""

    prompt: str
    max_new_tokens: int


def read_inputs(path: Path, default_tokens: int) -> list[RecordInput]:
    """Prompts from ``path``: JSON Lines of ``{"prompt": str, "max_new_tokens": int}`` (the
    count optional), or plain text, one prompt per non-empty line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ParamsError(f"cannot read inputs {path}: {exc}") from exc
    inputs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ParamsError(f"{path} line {number}: not valid JSON ({exc.msg})") from exc
            prompt, tokens = raw.get("prompt"), raw.get("max_new_tokens", default_tokens)
            if not isinstance(prompt, str) or not prompt:
                raise ParamsError(f"{path} line {number}: 'prompt' must be a non-empty string")
            unknown = set(raw) - {"prompt", "max_new_tokens"}
            if unknown:
                raise ParamsError(f"{path} line {number}: unknown field(s) {sorted(unknown)}; "
                                  "use prompt and max_new_tokens")
        else:
            prompt, tokens = line, default_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not (
                1 <= tokens <= MAX_RECORD_TOKENS):
            raise ParamsError(f"{path} line {number}: max_new_tokens must be an integer in "
                              f"1..{MAX_RECORD_TOKENS}, got {tokens!r}")
        inputs.append(RecordInput(prompt, tokens))
    if not inputs:
        raise ParamsError(f"{path} holds no prompts")
    return inputs


@dataclass(slots=True)
class _Recorder:
    """Collects one request's steps from the session's routing hook."""

    steps: list[dict[int, tuple[int, ...] | None]] = field(default_factory=list)
    lookahead: list[dict[int, tuple[int, ...]]] = field(default_factory=list)
    _step: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    _ahead: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _next_ahead: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _last_layer: int = -1

    def routed(self, layer: int, experts: list[int], prediction: Lookahead | None) -> None:
        if self._step and layer <= self._last_layer:
            raise RuntimeError("a step's layers were routed out of order")
        self._step[layer] = tuple(experts)
        self._last_layer = layer
        if prediction is not None:
            # A prediction for an earlier layer is for the next token's step.
            target = self._ahead if prediction.layer > layer else self._next_ahead
            target[prediction.layer] = prediction.ranked

    def end_step(self) -> None:
        self.steps.append(dict(self._step))
        self.lookahead.append(dict(self._ahead))
        self._step, self._ahead, self._next_ahead = {}, self._next_ahead, {}
        self._last_layer = -1

    def request(self, dense_layers: Sequence[int]) -> RequestTrace:
        for step in self.steps:
            for layer in dense_layers:
                step[layer] = None
        return RequestTrace(tuple(self.steps), tuple(self.lookahead))


def record_trace(model: str, inputs: Sequence[RecordInput],
                 models_dir: Path = MODELS_DIR) -> RoutingTrace:
    """Run every input through ``model`` (greedy, native routing, one request after another)
    and return its routing trace with the lookahead predictor's predictions."""
    loaded = build_model(load_recipe(model, models_dir))
    session = open_session(loaded, CacheConfig(prefetch_experts=0), lookahead=True)
    limit = int(loaded.model.config.max_position_embeddings)
    dense = [i for i in range(loaded.num_layers) if i not in session.moe_layers]
    requests = []
    for number, item in enumerate(inputs, start=1):
        ids = encode_prompt(loaded.tokenizer, item.prompt)
        if len(ids) + item.max_new_tokens > limit:
            raise ParamsError(f"input {number}: {len(ids)} prompt tokens plus "
                              f"{item.max_new_tokens} new exceed {model}'s {limit} positions")
        recorder = _Recorder()
        session.listeners.append(recorder.routed)
        try:
            session.new_context(RouterConfig.native())
            kv = DynamicCache(config=loaded.model.config)
            new = ids
            for _ in range(item.max_new_tokens):
                with torch.inference_mode():
                    out = loaded.model(input_ids=torch.tensor([new]), cache=kv,
                                       use_cache=True, logits_to_keep=1)
                session.cache.end_forward()
                recorder.end_step()
                kv = out.cache
                token = int(torch.argmax(out.logits[0, -1]))
                if token == loaded.tokenizer.eos_token_id:
                    break
                new = [token]
        finally:
            session.listeners.remove(recorder.routed)
        requests.append(recorder.request(dense))
    return RoutingTrace(tuple(requests), model=model, num_experts=loaded.num_experts,
                        top_k=loaded.native_top_k, source="stepline experts record")
