"""The Lua scripts run in Redis: files in ``tasks/lua/``, read once per process, each with its
call shape in its header; a script's ``Needs:`` preludes (the lifecycle tables generated from
``scheduler.lifecycle``, shared ``_*.lua`` functions) go in front of it when it is registered."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.lifecycle import TERMINAL_STATES, TRANSITIONS, JobState

if TYPE_CHECKING:  # annotations only: the command line imports this module without redis
    import redis
    from redis.commands.core import Script

LUA_DIR = Path(__file__).with_name("lua")
"""Where the scripts live (package data: an installed wheel carries them)."""

LIFECYCLE = "lifecycle"
"""The generated prelude: ``STATE``, ``TERMINAL`` and ``SOURCES`` from the lifecycle table."""

_HEADER_FIELD = re.compile(r"^-- (KEYS|ARGV|Needs):(.*)$")


@dataclass(frozen=True, slots=True)
class CallShape:
    """What a script's header says it takes: its keys and arguments by name, in order, and the
    preludes it needs."""

    keys: tuple[str, ...]
    args: tuple[str, ...]
    needs: tuple[str, ...]


def script_names() -> list[str]:
    """Every script in ``tasks/lua/`` (a file named ``_*.lua`` is a prelude, not a script)."""
    return sorted(p.stem for p in LUA_DIR.glob("*.lua") if not p.stem.startswith("_"))


def header(name: str) -> list[str]:
    """The comment block a script file opens with."""
    lines = []
    for line in (LUA_DIR / f"{name}.lua").read_text().splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return lines


@functools.cache
def call_shape(name: str) -> CallShape:
    """The call shape in the header of ``name``: ``-- KEYS: a, b``, ``-- ARGV: c, d`` (a list
    may go on over ``--`` lines indented further) and ``-- Needs: lifecycle, _events``."""
    found: dict[str, list[str]] = {"KEYS": [], "ARGV": [], "Needs": []}
    current = None
    for line in header(name):
        field = _HEADER_FIELD.match(line)
        if field:
            current = field.group(1)
            found[current] += _names(field.group(2))
        elif current is not None and line.startswith("--   "):
            found[current] += _names(line[2:])
        else:
            current = None
    return CallShape(tuple(found["KEYS"]), tuple(found["ARGV"]), tuple(found["Needs"]))


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


@functools.cache
def source(name: str) -> str:
    """The script as Redis runs it: its preludes, then the file."""
    parts = [_prelude(need) for need in call_shape(name).needs]
    return "\n".join([*parts, (LUA_DIR / f"{name}.lua").read_text()])


def register(client: redis.Redis, name: str) -> Script:
    """``name`` registered with ``client``: called, it sends ``EVALSHA`` and, if the server
    answers ``NOSCRIPT`` (restarted, flushed), loads the script and sends it again."""
    return client.register_script(source(name))


def json_arg(**values: Any) -> str:
    """One JSON argument of a script's optional values; a value of None is left out (a JSON
    null would reach Lua as ``cjson.null``, which is true)."""
    present = {name: value for name, value in values.items() if value is not None}
    return json.dumps(present, separators=(",", ":"), ensure_ascii=False)


def _prelude(name: str) -> str:
    if name == LIFECYCLE:
        return lifecycle_prelude()
    return (LUA_DIR / f"{name}.lua").read_text()


def lifecycle_prelude() -> str:
    """The lifecycle as Lua tables: ``STATE.X`` is the state's name (an unknown name is an
    error, not nil), ``TERMINAL[state]`` and ``SOURCES[target][state]`` are true or nil."""
    def table(items: dict[str, str]) -> str:
        assert all(k.isidentifier() for k in items), "a state name is a Lua name"
        return "{" + ", ".join(f"{k} = {v}" for k, v in sorted(items.items())) + "}"

    def flags(states: frozenset[JobState] | set[JobState]) -> str:
        return table({s.value: "true" for s in states})

    sources = {target.value: flags({s for s, moves in TRANSITIONS.items() if target in moves})
               for target in JobState}
    names = table({s.value: f"'{s.value}'" for s in JobState})
    return "\n".join([
        "-- generated from scheduler.lifecycle (JobState, TERMINAL_STATES, TRANSITIONS)",
        f"local STATE = setmetatable({names}, "
        "{__index = function(_, name) error('no job state ' .. tostring(name)) end})",
        f"local TERMINAL = {flags(TERMINAL_STATES)}",
        f"local SOURCES = {table(sources)}",
    ])
