"""The Lua script files: each opens with its call shape and a legend, names its keys and
arguments as locals, and spells no job state the lifecycle table owns."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from scheduler.lifecycle import JobState
from tasks import scripts

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
NAMES = scripts.script_names()
_INDEXED = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")
_LOCAL = re.compile(r"^local (\w+) = (?:cjson\.decode\()?(KEYS|ARGV)\[(\d+)\]\)?$")
"""``local job = KEYS[1]``, or ``local options = cjson.decode(ARGV[5])`` for a JSON argument."""
_ALL = re.compile(r"^local (\w+) = (KEYS|ARGV)$")
"""``local hashes = KEYS``: a script taking any number of keys (or arguments) names them all."""


def _body(name: str) -> list[str]:
    lines = (scripts.LUA_DIR / f"{name}.lua").read_text().splitlines()
    return lines[len(scripts.header(name)):]


def test_the_store_has_its_scripts_as_files() -> None:
    assert {"transition", "create", "claim", "commit", "tick_lease", "take_token",
            "count_live", "record_outcome"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_script_opens_with_its_call_shape_and_a_legend_line_per_name(name: str) -> None:
    # given the script's header
    shape = scripts.call_shape(name)
    legend = "\n".join(scripts.header(name))
    # then it says what it does, takes keys and arguments, and explains each of them
    assert scripts.header(name)[0].startswith(f"-- {name}: "), "first line: '-- <name>: what'"
    assert shape.keys and shape.args, "a header names its KEYS and ARGV"
    for each in (*shape.keys, *shape.args):
        assert re.search(rf"^-- {each} +\S", legend, re.MULTILINE), f"no legend line for {each}"


@pytest.mark.parametrize("name", NAMES)
def test_a_script_reads_its_keys_and_arguments_only_as_the_named_locals_of_its_header(
        name: str) -> None:
    # given the script's body after its header
    shape = scripts.call_shape(name)
    named: dict[str, list[str]] = {"KEYS": [], "ARGV": []}
    # when every KEYS[i] and ARGV[i] in it is found
    for line in _body(name):
        if every := _ALL.match(line):
            named[every.group(2)].append(every.group(1))
            continue
        if not _INDEXED.search(line):
            continue
        local = _LOCAL.match(line)
        assert local, f"{name}: {line!r} reads KEYS/ARGV outside a named local"
        var, table, index = local.groups()
        assert int(index) == len(named[table]) + 1, f"{name}: {line!r} out of order"
        named[table].append(var)
    # then the locals are the header's names, in the header's order
    assert tuple(named["KEYS"]) == shape.keys
    assert tuple(named["ARGV"]) == shape.args


@pytest.mark.parametrize("name", NAMES)
def test_a_script_spells_no_job_state_and_needs_only_preludes_that_exist(name: str) -> None:
    text = (scripts.LUA_DIR / f"{name}.lua").read_text()
    for state in JobState:
        assert f"'{state.value}'" not in text and f'"{state.value}"' not in text, \
            f"{name} spells {state.value}: use STATE.{state.value} from the lifecycle prelude"
    for used in re.findall(r"\bSTATE\.(\w+)", text):
        assert used in JobState.__members__, f"{name}: no job state {used}"
    for need in scripts.call_shape(name).needs:
        assert need == scripts.LIFECYCLE or (scripts.LUA_DIR / f"{need}.lua").exists()
    uses_lifecycle = re.search(r"\b(STATE|TERMINAL|SOURCES)\b", "\n".join(_body(name)))
    assert bool(uses_lifecycle) == (scripts.LIFECYCLE in scripts.call_shape(name).needs)


def test_the_lifecycle_prelude_is_built_from_the_lifecycle_table() -> None:
    prelude = scripts.lifecycle_prelude()
    terminal = re.search(r"^local TERMINAL = \{(.*)\}$", prelude, re.MULTILINE)
    assert terminal is not None
    assert set(re.findall(r"(\w+) = true", terminal.group(1))) == {
        s.value for s in JobState if s.is_terminal}


def test_no_python_module_holds_lua_and_the_wheel_carries_the_script_files() -> None:
    # given the project's Python sources
    sources = [p for package in ("app", "tasks", "scheduler", "workers")
               for p in (ROOT / package).rglob("*.py")]
    # then none calls into Redis from Lua text
    assert sources and not [p for p in sources if "redis.call" in p.read_text()]
    # and the script files are package data
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "lua/*.lua" in config["tool"]["setuptools"]["package-data"]["tasks"]
