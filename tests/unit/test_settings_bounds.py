"""Every numeric setting is bounded on both sides, and a value past either bound is refused
with a line naming the setting, whether it came from a file's keys or from the environment."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tasks.errors import SettingsError
from tasks.settings import Settings, load_settings
from tasks.settings.api import ApiKeySettings

LIST_ITEMS: dict[type[BaseModel], dict[str, Any]] = {
    ApiKeySettings: {"key": "k" * 16, "tenant": "acme"},
}
"""A valid item of each model settings hold in a list (a list's default is empty)."""

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Number:
    """One int or float setting: where it is and what bounds it."""

    path: Path
    """Keys from the root (an int: an index into a list)."""
    env_depth: int
    """How many leading keys one variable names; deeper keys go in its JSON (a list or a
    mapping is set whole)."""
    is_int: bool
    bounds: tuple[Any, ...]

    @property
    def key(self) -> str:
        return ".".join(str(part) for part in self.path)

    def lower(self) -> Any:
        return next((b for b in self.bounds if isinstance(b, at.Ge | at.Gt)), None)

    def upper(self) -> Any:
        return next((b for b in self.bounds if isinstance(b, at.Le | at.Lt)), None)


def _fields(model: type[BaseModel], default: Any, path: Path, env_depth: int | None
            ) -> Iterator[Number]:
    for name, field in model.model_fields.items():
        value = getattr(default, name, None) if default is not None else None
        yield from _walk(field.annotation, tuple(field.metadata), value, (*path, name),
                         env_depth)


def _walk(annotation: Any, bounds: tuple[Any, ...], default: Any, path: Path,
          env_depth: int | None) -> Iterator[Number]:
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        more = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        yield from _walk(inner, (*bounds, *more), default, path, env_depth)
    elif origin in (Union, types.UnionType):
        for member in get_args(annotation):
            if member is not type(None):
                yield from _walk(member, bounds, default, path, env_depth)
    elif annotation in (int, float):
        yield Number(path, len(path) if env_depth is None else env_depth, annotation is int,
                     bounds)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield from _fields(annotation, default, path, env_depth)
    elif origin is dict:
        assert default, f"{path}: a mapping with no default key to try"
        key = next(iter(default))
        yield from _walk(get_args(annotation)[1], (), default[key], (*path, key),
                         len(path) if env_depth is None else env_depth)
    elif origin is list:
        item = get_args(annotation)[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            assert item in LIST_ITEMS, f"{path}: name a valid {item.__name__} in LIST_ITEMS"
        yield from _walk(item, (), None, (*path, 0),
                         len(path) if env_depth is None else env_depth)


NUMBERS = list(_fields(Settings, Settings(), (), None))


def _past(number: Number, side: str) -> int | float:
    """A value just past the bound on ``side``: the bound itself when it is strict."""
    bound = number.lower() if side == "below" else number.upper()
    if isinstance(bound, at.Gt | at.Lt):
        return bound.gt if isinstance(bound, at.Gt) else bound.lt
    edge = bound.ge if isinstance(bound, at.Ge) else bound.le
    step = 1 if number.is_int else max(1.0, abs(float(edge)))
    return edge - step if side == "below" else edge + step


def _child(model: type[BaseModel] | None, name: str) -> type[BaseModel] | None:
    """The model of ``model``'s section ``name``, or of the items of its list ``name``; None
    for anything else (a mapping, a plain value)."""
    field = None if model is None else model.model_fields.get(name)
    annotation = None if field is None else field.annotation
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _nested(path: Path, value: Any, model: type[BaseModel] | None = Settings) -> Any:
    """``value`` at ``path`` below ``model``, as a file gives it; a list item gets its other
    keys from LIST_ITEMS."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        assert model is not None
        return [{**LIST_ITEMS[model], **_nested(rest, value, model)}]
    return {head: _nested(rest, value, _child(model, head))}


CASES = [pytest.param(n, side, id=f"{n.key}-{side}") for n in NUMBERS
         for side in ("below", "above") if (n.lower() if side == "below" else n.upper())]


def test_every_int_and_float_setting_has_a_lower_and_an_upper_bound() -> None:
    # given every int and float field of the settings tree, through sections, mappings and
    # lists (the walk finds the ones known to be there)
    keys = {n.key for n in NUMBERS}
    assert {"moe.router.expert_capacity", "residency.memory_budget_bytes",
            "moe.cache.budget_mb", "scheduler.slo_classes.realtime.target_s",
            "scheduler.cost_priors.image-256", "api.keys.0.burst"} <= keys
    # then none lacks a bound on either side
    assert [n.key for n in NUMBERS if n.lower() is None] == []
    assert [n.key for n in NUMBERS if n.upper() is None] == []


@pytest.mark.parametrize(("number", "side"), CASES)
def test_a_value_past_a_bound_from_a_file_is_refused_naming_the_setting(
        number: Number, side: str) -> None:
    # given a value just past one of the setting's bounds, as a file's key gives it
    value = _past(number, side)
    # when the settings are loaded
    with pytest.raises(SettingsError) as err:
        load_settings(**_nested(number.path, value))
    # then the one line names the setting and what was expected
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"invalid setting {number.key} = "), message
    assert "expected" in message


@pytest.mark.parametrize(("number", "side"), CASES)
def test_a_value_past_a_bound_from_the_environment_is_refused_naming_the_variable(
        number: Number, side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # given the same value set by the variable that names the setting (or, within a list or
    # a mapping, by the variable of that list or mapping, as JSON)
    value = _past(number, side)
    named, rest = number.path[:number.env_depth], number.path[number.env_depth:]
    variable = "STEPLINE_" + "__".join(str(part) for part in named).upper()
    item = _container_item(named)
    raw = str(value) if not rest else json.dumps(_nested(rest, value, item))
    monkeypatch.setenv(variable, raw)
    # when the settings are loaded
    with pytest.raises(SettingsError) as err:
        load_settings()
    # then the one line names the variable, the setting and what was expected
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"invalid environment variable {variable}="), message
    assert f"({number.key}" in message and "expected" in message


def _container_item(named: Path) -> type[BaseModel] | None:
    """The item model when ``named`` ends at a list of models (its JSON is that list)."""
    model: type[BaseModel] | None = Settings
    for part in named:
        model = _child(model, str(part))
    return model
