"""SchedulerSettings → PolicyConfig."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler import PolicyConfig, PolicyKind
from scheduler.errors import InvalidPolicy
from tasks.settings.scheduler import SchedulerSettings

pytestmark = pytest.mark.timeout(30)


def test_default_settings_give_the_default_policy() -> None:
    assert SchedulerSettings().to_policy() == PolicyConfig()


def test_yaml_durations_and_policy_name_reach_the_policy() -> None:
    settings = SchedulerSettings.model_validate(
        {"policy": "fifo", "aging_bound": "30s", "realtime_quantum": "500ms",
         "score_weights": {"tier": 0.5}})
    policy = settings.to_policy()
    assert policy.policy is PolicyKind.FIFO
    assert policy.aging_bound_s == 30.0
    assert policy.level_quanta_s == (0.5, 5.0)
    assert policy.weights.tier == 0.5


def test_out_of_bounds_setting_is_rejected_with_its_name() -> None:
    with pytest.raises(ValidationError, match="origin_margin"):
        SchedulerSettings.model_validate({"origin_margin": 2})


def test_inconsistent_settings_are_rejected_at_load_time() -> None:
    with pytest.raises(ValidationError, match="shed_load"):
        SchedulerSettings.model_validate({"shed_load": 0.5})


def test_inconsistent_policy_is_rejected_with_the_field_name() -> None:
    with pytest.raises(InvalidPolicy, match="shed_load"):
        PolicyConfig(shed_load=0.5)
