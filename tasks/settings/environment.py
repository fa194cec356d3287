"""The ``STEPLINE_*`` variables as settings: which variable supplied a value, and which hold
text that cannot be read at all, so a bad value is reported as the variable the user set —
its name, its value and what was expected — on one line, never as a pydantic traceback."""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from tasks.redact import mask_url

ENV_PREFIX = "STEPLINE_"
NESTING = "__"
_COMPLEX = {list: "a JSON list", tuple: "a JSON list", set: "a JSON list",
            frozenset: "a JSON list", dict: "a JSON object"}


@dataclass(frozen=True, slots=True)
class EnvValue:
    """One ``STEPLINE_*`` variable and the settings key it names."""

    name: str
    """As set, e.g. ``STEPLINE_SCHEDULER__POLICY``."""
    path: tuple[str, ...]
    """The key it sets, e.g. ``("scheduler", "policy")`` (pydantic-settings ignores case)."""
    raw: str

    @property
    def key(self) -> str:
        return ".".join(self.path)


def env_values(environ: Mapping[str, str]) -> list[EnvValue]:
    """Every ``STEPLINE_*`` variable of ``environ``, as the key it would set."""
    values = []
    for name, raw in environ.items():
        if name.upper().startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            path = tuple(name[len(ENV_PREFIX):].lower().split(NESTING))
            values.append(EnvValue(name, path, raw))
    return values


def unreadable_values(model: type[BaseModel], values: Sequence[EnvValue]) -> list[str]:
    """One line per variable that sets a list, a mapping or a section and does not hold JSON
    (pydantic-settings would stop on it with a traceback naming only the section)."""
    problems = []
    for value in values:
        expected = _json_shape(_annotation_at(model, value.path))
        if expected is None:
            continue
        try:
            json.loads(value.raw)
        except ValueError:
            hint = (f", or one variable per key ({value.name}{NESTING}<KEY>)"
                    if expected == "a JSON object" else "")
            problems.append(f"invalid environment variable {value.name}={value.raw!r} "
                            f"({value.key}): not JSON; expected {expected}{hint}")
    return problems


def describe_error(error: ErrorDetails, values: Sequence[EnvValue]) -> str:
    """One line for one validation error: the variable that supplied the value when one did,
    else the settings key (the value came from a config file or the defaults)."""
    loc = tuple(str(part) for part in error["loc"])
    key, value = ".".join(loc), error.get("input")
    expected = _expectation(error)
    source = supplier(loc, values)
    shown = mask_url(repr(value))  # a bad URL's password is not printed either
    if source is None:
        return f"invalid setting {key} = {shown}: {expected}"
    where = key if source.path == loc else f"{key} = {shown}"
    return f"invalid environment variable {source.name}={mask_url(repr(source.raw))} ({where}): " \
           f"{expected}"


def supplier(loc: tuple[str, ...], values: Sequence[EnvValue]) -> EnvValue | None:
    """The variable that set the value at ``loc``: one naming ``loc`` itself, or one naming a
    section above it whose JSON holds ``loc`` (the environment outranks the files)."""
    for value in sorted(values, key=lambda v: -len(v.path)):
        if value.path == loc:
            return value
        if loc[: len(value.path)] == value.path and _json_holds(value.raw, loc[len(value.path):]):
            return value
    return None


def _expectation(error: ErrorDetails) -> str:
    """pydantic's message as what was expected ("Input should be X" → "expected X")."""
    if error["type"] == "extra_forbidden":
        return "not a setting; check the name against configs/default.yaml"
    message = error["msg"]
    for prefix in ("Input should be ", "Value error, "):
        if message.startswith(prefix):
            message = message.removeprefix(prefix)
            return f"expected {message}" if prefix == "Input should be " else message
    return message


def _json_holds(raw: str, rest: tuple[str, ...]) -> bool:
    try:
        node: Any = json.loads(raw)
    except ValueError:
        return False
    for part in rest:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _annotation_at(model: type[BaseModel], path: tuple[str, ...]) -> Any:
    """The type of the key at ``path`` (through sections and mapping values), or None."""
    annotation: Any = model
    for part in path:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            if field is None:
                return None
            annotation = field.annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            return None
    return annotation


def _json_shape(annotation: Any) -> str | None:
    """What JSON a variable for ``annotation`` must hold; None for plain values (and for unions
    with a plain member, whose text pydantic-settings keeps when it is not JSON)."""
    annotation = _unwrap(annotation)
    if annotation is None:
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a JSON object"
    return _COMPLEX.get(get_origin(annotation) or annotation)  # type: ignore[call-overload]


def _unwrap(annotation: Any) -> Any:
    """``Annotated[X, ...]`` → X, ``X | None`` → X; other unions → None (not one shape)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return _unwrap(members[0]) if len(members) == 1 else None
    return annotation
