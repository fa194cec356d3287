"""Settings: the reference values by default; env and files override; bad values name the bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.errors import SettingsError
from tasks.settings import load_settings
from tasks.settings.durations import parse_duration_s


def test_defaults_carry_the_reference_designs_values() -> None:
    s = load_settings()
    assert s.scheduler.origin_detection_interval == pytest.approx(0.1)
    assert s.scheduler.resource_reserve_ratio == 0.2
    assert s.scheduler.preemption_timeout == pytest.approx(0.05)
    assert s.scheduler.convergence_threshold == 0.8
    assert s.scheduler.slo_classes["realtime"].target_s == 1.0
    assert s.scheduler.slo_classes["interactive"].target_s == 5.0
    assert s.scheduler.slo_classes["batch"].target_s > 10.0
    assert (s.moe.router.k, s.moe.router.temperature) == (8, 0.5)
    assert (s.moe.router.expert_capacity, s.moe.router.fallback_strategy) == (256, "random")
    assert (s.moe.cache.memory_threshold, s.moe.cache.idle_unload) == (0.85, 300.0)
    assert s.moe.cache.warmup_experts == 16
    assert (s.moe.resource_limits.memory, s.moe.resource_limits.compute) == (0.75, 0.90)


def test_environment_overrides_a_nested_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPLINE_SCHEDULER__POLICY", "fifo")
    monkeypatch.setenv("STEPLINE_SCHEDULER__ORIGIN_DETECTION_INTERVAL", "250ms")
    s = load_settings()
    assert s.scheduler.policy == "fifo"
    assert s.scheduler.origin_detection_interval == pytest.approx(0.25)
    assert s.scheduler.convergence_threshold == 0.8  # siblings keep their values


def test_a_config_file_overrides_the_defaults(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("scheduler:\n  resource_reserve_ratio: 0.3\n")
    assert load_settings(config).scheduler.resource_reserve_ratio == 0.3


def test_an_out_of_bound_value_fails_naming_key_value_and_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPLINE_SCHEDULER__CONVERGENCE_THRESHOLD", "1.7")
    with pytest.raises(SettingsError) as err:
        load_settings()
    message = str(err.value)
    assert "scheduler.convergence_threshold" in message
    assert "1.7" in message
    assert "1" in message and "less than or equal" in message


def test_an_unknown_key_in_a_file_is_rejected(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("scheduler:\n  origin_interval: 1\n")
    with pytest.raises(SettingsError, match=r"scheduler\.origin_interval"):
        load_settings(config)


@pytest.mark.parametrize(("text", "seconds"), [("100ms", 0.1), ("2s", 2.0), ("5min", 300.0),
                                               ("1.5", 1.5)])
def test_durations_read_with_their_units(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


def test_a_duration_without_a_known_unit_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration_s("3 fortnights")
