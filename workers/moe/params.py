"""Parameters of a text job, validated once with messages that say what to send instead."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from workers.errors import ModelConfigError, ParamsError
from workers.limits import MAX_NEW_TOKENS
from workers.moe.recipes import DEFAULT_MODEL, load_recipe

MAX_PROMPT_CHARS = 16_384
MAX_CHUNK_TOKENS = 256
DEFAULT_CHUNK_TOKENS = 8
Routing = Literal["configured", "native"]

_KNOWN = {
    "prompt", "inputs", "max_new_tokens", "temperature", "top_p", "seed", "chunk_tokens",
    "model", "routing", "expert_version", "ignore_eos", "min_new_tokens",
}
_VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, slots=True)
class TextParams:
    """A validated text job: ``temperature == 0`` is greedy decoding."""

    prompt: str
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    model: str = DEFAULT_MODEL
    routing: Routing = "configured"
    expert_version: str | None = None
    """Run on this expert version; None: the hot update routes the job (else the live one)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token, up to ``max_new_tokens`` (fixed-length
    output, as benchmark clients ask for)."""
    min_new_tokens: int = 0
    """The end-of-sequence token cannot be drawn before this many new tokens (as
    ``model.generate(min_new_tokens=...)``)."""

    @property
    def num_decode_chunks(self) -> int:
        """Decode chunks after the prefill (which already yields the first token)."""
        return math.ceil((self.max_new_tokens - 1) / self.chunk_tokens)

    def tokens_after_chunk(self, index: int) -> int:
        """New tokens generated once chunk ``index`` (0 = prefill) is complete."""
        return min(self.max_new_tokens, 1 + index * self.chunk_tokens)


def validate_params(params: Mapping[str, Any]) -> TextParams:
    """Check ``params`` and return them typed; raises :class:`ParamsError` saying what to fix."""
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ParamsError(f"unknown text-job parameters {unknown}; accepted: {sorted(_KNOWN)}")
    result = TextParams(
        prompt=_prompt(params),
        max_new_tokens=_int(params, "max_new_tokens", 32, 1, MAX_NEW_TOKENS),
        temperature=_float(params, "temperature", 0.0, 0.0, 5.0),
        top_p=_float(params, "top_p", 1.0, 0.0, 1.0),
        seed=_int(params, "seed", 0, 0, 2**63 - 1),
        chunk_tokens=_int(params, "chunk_tokens", DEFAULT_CHUNK_TOKENS, 1, MAX_CHUNK_TOKENS),
        model=_model(params),
        routing=_routing(params),
        expert_version=_version(params),
        ignore_eos=_bool(params, "ignore_eos"),
        min_new_tokens=_int(params, "min_new_tokens", 0, 0, MAX_NEW_TOKENS),
    )
    if result.min_new_tokens > result.max_new_tokens:
        raise ParamsError(f"min_new_tokens ({result.min_new_tokens}) exceeds max_new_tokens "
                          f"({result.max_new_tokens}); lower it or raise max_new_tokens")
    if result.top_p <= 0.0:
        raise ParamsError("top_p must be in (0, 1]; use 1.0 to sample from the full distribution")
    return result


def _version(params: Mapping[str, Any]) -> str | None:
    value = params.get("expert_version")
    if value is None or (isinstance(value, str) and _VERSION_NAME.match(value)):
        return value
    raise ParamsError(f"expert_version {value!r}: give a version name (letters, digits, . _ -)")


def _prompt(params: Mapping[str, Any]) -> str:
    if "prompt" in params and "inputs" in params:
        raise ParamsError("give the text as either 'prompt' or 'inputs', not both")
    value = params.get("prompt", params.get("inputs"))
    if not isinstance(value, str) or not value.strip():
        raise ParamsError("'prompt' (or 'inputs') must be a non-empty string")
    if len(value) > MAX_PROMPT_CHARS:
        raise ParamsError(f"prompt has {len(value)} characters; the limit is {MAX_PROMPT_CHARS}")
    return value


def _int(params: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamsError(f"{key!r} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ParamsError(f"{key!r} = {value} is out of range; use [{low}, {high}]")
    return value


def _bool(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ParamsError(f"{key!r} must be true or false, got {value!r}")
    return value


def _float(params: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamsError(f"{key!r} must be a number in [{low}, {high}], got {value!r}")
    if not (low <= float(value) <= high) or math.isnan(float(value)):
        raise ParamsError(f"{key!r} = {value} is out of range; use [{low}, {high}]")
    return float(value)


def _model(params: Mapping[str, Any]) -> str:
    name = params.get("model", DEFAULT_MODEL)
    if not isinstance(name, str):
        raise ParamsError(f"'model' must be a recipe name, got {name!r}")
    try:
        load_recipe(name)
    except ModelConfigError as exc:
        raise ParamsError(str(exc)) from exc
    return name


def _routing(params: Mapping[str, Any]) -> Routing:
    value = params.get("routing", "configured")
    if value == "configured":
        return "configured"
    if value == "native":
        return "native"
    raise ParamsError(
        f"'routing' must be 'configured' (the router settings) or 'native' (the model's own "
        f"routing, identical to model.generate()), got {value!r}"
    )
