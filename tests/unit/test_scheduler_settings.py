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


def test_a_more_urgent_class_with_a_longer_target_is_rejected_naming_both() -> None:
    # given an interactive target longer than batch's
    classes = {"realtime": {"target_s": 1.0}, "interactive": {"target_s": 90.0},
               "batch": {"target_s": 60.0}}
    # when the settings are validated, then they are refused naming the two classes
    with pytest.raises(ValidationError, match=r"interactive's target_s .* batch's"):
        SchedulerSettings.model_validate({"slo_classes": classes})
    # and equal targets, or a class left out, are accepted
    classes["interactive"]["target_s"] = 60.0
    assert SchedulerSettings.model_validate({"slo_classes": classes})
    assert SchedulerSettings.model_validate({"slo_classes": {"batch": {"target_s": 30.0}}})


def test_a_target_for_a_class_that_does_not_exist_is_rejected() -> None:
    # given a target for a class the scheduler does not have
    # when the settings are validated, then they are refused naming it
    with pytest.raises(ValidationError, match="premium"):
        SchedulerSettings.model_validate({"slo_classes": {"premium": {"target_s": 2.0}}})


def test_score_weights_that_are_all_zero_are_rejected_at_load_time() -> None:
    # given every score weight at 0 (the policy needs a positive sum)
    zero = dict.fromkeys(SchedulerSettings().score_weights.model_dump(), 0.0)
    # when the settings are validated, then they are refused, not left for the policy to fail
    with pytest.raises(ValidationError, match="at least one score weight"):
        SchedulerSettings.model_validate({"score_weights": zero})
