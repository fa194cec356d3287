"""An environment value that does not parse stops every command with one line naming the
variable, its value and what was expected, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.errors import SettingsError
from tasks.runtime import current_settings
from tasks.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("STEPLINE_API", "x", "(api): not JSON; expected a JSON object, or one variable per key"),
    ("STEPLINE_API__KEYS", "x", "(api.keys): not JSON; expected a JSON list"),
    ("STEPLINE_SCHEDULER__POLICY", "bogus", "(scheduler.policy): expected 'fifo', 'priority'"),
    ("STEPLINE_TORCH_THREADS", "abc", "(torch_threads): expected a valid integer"),
    ("STEPLINE_SCHEDULER__CONVERGENCE_THRESHOLD", "1.7", "expected less than or equal to 1"),
    ("STEPLINE_SCHEDULER__ORIGIN_DETECTION_INTERVAL", "3fortnights", "is not a duration"),
    ("STEPLINE_SCHEDULER__ORIGIN_INTERVAL", "1", "(scheduler.origin_interval): not a setting"),
])
def test_a_bad_environment_value_is_one_line_naming_the_variable_value_and_expectation(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str,
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"invalid environment variable {name}={value!r} ")
    assert expected in message


def test_a_value_inside_a_json_variable_names_that_variable_and_the_key_within(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPLINE_SCHEDULER", '{"policy": 3}')
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert str(err.value).startswith(
        "invalid environment variable STEPLINE_SCHEDULER='{\"policy\": 3}' "
        "(scheduler.policy = 3): expected 'fifo'")


def test_a_bad_value_from_a_file_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("scheduler:\n  convergence_threshold: 1.7\n")
    with pytest.raises(SettingsError) as err:
        load_settings(config)
    assert str(err.value) == ("invalid setting scheduler.convergence_threshold = 1.7: "
                              "expected less than or equal to 1")


def test_each_bad_variable_gets_its_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_SCHEDULER__POLICY", "bogus")
    monkeypatch.setenv("STEPLINE_TORCH_THREADS", "-1")
    with pytest.raises(SettingsError) as err:
        load_settings()
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert {line.split("=")[0] for line in lines} == {
        "invalid environment variable STEPLINE_SCHEDULER__POLICY",
        "invalid environment variable STEPLINE_TORCH_THREADS"}


def test_the_process_settings_end_the_process_with_the_line_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPLINE_API", "x")
    current_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as ended:
            current_settings()
    finally:
        current_settings.cache_clear()
    assert str(ended.value.code).startswith("stepline: invalid environment variable "
                                            "STEPLINE_API='x' (api): not JSON")


@pytest.mark.parametrize("command", [["up"], ["jobs"], ["submit", "--kind", "text"]])
def test_a_stepline_command_stops_with_one_line_on_a_bad_variable(
    command: list[str], tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("STEPLINE_") and k != "REDIS_URL"}
    env.update(STEPLINE_RUN_DIR=str(tmp_path / "run"), STEPLINE_SCHEDULER__POLICY="bogus")
    done = subprocess.run([sys.executable, "-m", "app.cli", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        "stepline: invalid environment variable STEPLINE_SCHEDULER__POLICY='bogus' "
        "(scheduler.policy): expected 'fifo', 'priority', 'edf', 'srpt', 'least_slack' or "
        "'stepline'"]
    assert not (tmp_path / "run").exists()  # nothing was started
